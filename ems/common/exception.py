"""The SDK's one exception type and its error codes (names as published by EMS).

Every failure the SDK reports is an ``EmsException`` carrying one
``EmsErrorCode``. A cache miss is never an exception: it shows as
``CcResult.success < CcResult.total``.
"""

from __future__ import annotations

from enum import IntEnum


class EmsErrorCode(IntEnum):
    """Error codes; the daemon's wire status codes map one-to-one onto these."""

    EMS_SUCCESS = 0
    EMS_INVALID_ARGUMENT = 1  # bad parameters, not registered, unknown tenant or wrong key
    EMS_IO_ERROR = 2  # the daemon or the connection to it failed
    EMS_IO_TIMEOUT = 3  # the call's timeout passed; retry with a longer one
    EMS_INTERNAL_ERROR = 4  # a fault inside the SDK or in device memory access
    EMS_RECOVERD_ERROR = 5  # the daemon is up but recovering; retry init later (spelling as published)


class EmsException(Exception):
    """An SDK failure: ``status_code()`` says which kind, ``message()`` what happened."""

    def __init__(self, code: EmsErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code = EmsErrorCode(code)
        self._message = message

    def status_code(self) -> EmsErrorCode:
        return self._code

    def message(self) -> str:
        return self._message


def invalid(message: str) -> EmsException:
    """Shorthand for an ``EMS_INVALID_ARGUMENT`` exception."""
    return EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, message)
