"""Per-call timing records and the SDK's own log file.

Environment:

- ``ENABLE_CC_PROFILING``: ``"1"`` turns on one record per SDK call; any other
  value or unset leaves it off.
- ``EMS_SDK_LOG``: the directory for those records and for the SDK's log
  (default ``/var/log/ems``). If it cannot be created or written, the SDK
  falls back to ``<tempdir>/ems-<uid>`` (e.g. ``/tmp/ems-1000``).

Records: ``cc_profile_<pid>.jsonl`` in that directory, one JSON object per
line and per call, with ``op``, ``keys`` (number of keys in the request),
``success``, ``total``, ``duration_us`` (monotonic clock),
``timestamp`` (wall clock, seconds since the epoch, when the call ended),
``pid``, and ``error`` (the ``EmsErrorCode`` name) for a call that raised.
One file per process means no interleaving between processes; a lock keeps
lines whole between threads. After a ``fork`` the child opens its own file.

Cost: when profiling is off, ``Profiler.record`` is one attribute check; when
on, a few microseconds (a ``json.dumps`` and a buffered write, flushed per
line so a crash loses nothing).

The SDK's log: ``install_log_handler()`` attaches one ``FileHandler``
(``ems_sdk.log`` in the same directory, opened lazily on the first record) to
the ``"ems"`` logger, idempotently; ``remove_log_handler()`` detaches and
closes it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ems.common.exception import EmsException

ENV_PROFILING = "ENABLE_CC_PROFILING"
ENV_LOG_DIR = "EMS_SDK_LOG"
DEFAULT_LOG_DIR = "/var/log/ems"
LOG_FILE = "ems_sdk.log"
LOGGER_NAME = "ems"

_handler_lock = threading.Lock()
_handler: logging.FileHandler | None = None


def _usable_dir(path: Path) -> bool:
    """Create ``path`` if needed; True if this process can write files in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def fallback_log_dir() -> Path:
    """``<tempdir>/ems-<uid>``: per user, so users never fight over permissions."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"ems-{uid}"


def sdk_log_dir() -> Path:
    """The directory for profiling records and the SDK log, created if needed.

    ``$EMS_SDK_LOG`` (default ``/var/log/ems``) if it can be created and
    written, else ``fallback_log_dir()``. Returns the fallback path even if
    that too cannot be created (writers then fail and say so in the log).
    """
    wanted = Path(os.environ.get(ENV_LOG_DIR) or DEFAULT_LOG_DIR)
    if _usable_dir(wanted):
        return wanted
    fallback = fallback_log_dir()
    _usable_dir(fallback)
    return fallback


def profiling_enabled() -> bool:
    """True when ``ENABLE_CC_PROFILING`` is exactly ``"1"``."""
    return os.environ.get(ENV_PROFILING) == "1"


class Profiler:
    """Writes one JSON line per SDK call when enabled; does nothing otherwise.

    ``Profiler(enabled, directory=None)``: ``directory`` defaults to
    ``sdk_log_dir()``, resolved on the first record. ``Profiler.from_env()``
    reads ``ENABLE_CC_PROFILING``. Never raises from ``record``: a profiling
    failure is logged once and turns the profiler off.
    """

    def __init__(self, enabled: bool, directory: Path | None = None) -> None:
        self.enabled = bool(enabled)
        self._directory = directory
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._pid = 0

    @classmethod
    def from_env(cls) -> Profiler:
        return cls(profiling_enabled())

    @property
    def path(self) -> Path:
        """This process's record file."""
        directory = self._directory if self._directory is not None else sdk_log_dir()
        self._directory = directory
        return directory / f"cc_profile_{os.getpid()}.jsonl"

    def record(self, op: str, start_ns: int, result: Any, keys: int | None = None) -> None:
        """Record one call that started at ``start_ns`` (``time.perf_counter_ns()``).

        ``result``: the call's ``CcResult``, or the exception it raised.
        ``keys``: number of keys in the request (default: ``result.total``).
        """
        if not self.enabled:
            return
        self._write(_record(op, start_ns, result, keys))

    @contextmanager
    def timed(self, op: str, keys: int | None = None) -> Iterator[dict[str, Any]]:
        """Time the ``with`` body; put the ``CcResult`` in ``box["result"]``.

        An exception escaping the body is recorded, then re-raised.
        """
        box: dict[str, Any] = {"result": None}
        if not self.enabled:
            yield box
            return
        start = time.perf_counter_ns()
        try:
            yield box
        except BaseException as exc:
            self.record(op, start, exc, keys)
            raise
        self.record(op, start, box["result"], keys)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, line: str) -> None:
        try:
            with self._lock:
                pid = os.getpid()
                if self._file is None or self._pid != pid:
                    # A forked child writes its own file, not through the parent's.
                    if self._file is not None:
                        self._file.close()
                    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
                    self._pid = pid
                self._file.write(line)
                self._file.flush()
        except OSError as exc:
            self.enabled = False
            logging.getLogger(LOGGER_NAME).warning(
                "profiling records cannot be written (%s); profiling is off", exc)


def _record(op: str, start_ns: int, result: Any, keys: int | None) -> str:
    duration_us = (time.perf_counter_ns() - start_ns) // 1000
    entry: dict[str, Any] = {"op": op}
    if isinstance(result, BaseException):
        entry.update(keys=keys, success=0, total=keys)
        entry["error"] = (result.status_code().name if isinstance(result, EmsException)
                          else type(result).__name__)
    else:
        total = getattr(result, "total", None)
        entry.update(keys=total if keys is None else keys,
                     success=getattr(result, "success", None), total=total)
    entry.update(duration_us=duration_us, timestamp=round(time.time(), 6), pid=os.getpid())
    return json.dumps(entry, separators=(",", ":")) + "\n"


def install_log_handler(level: int = logging.INFO) -> Path:
    """Attach the SDK's log file to the ``"ems"`` logger (once); return its path.

    The file is ``sdk_log_dir() / "ems_sdk.log"``, opened on the first record.
    The logger's level is set to ``level`` only if it has none yet, so an
    application's own logging configuration wins.
    """
    global _handler
    with _handler_lock:
        if _handler is not None:
            return Path(_handler.baseFilename)
        path = sdk_log_dir() / LOG_FILE
        handler = logging.FileHandler(path, encoding="utf-8", delay=True)
        handler.setLevel(level)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(process)d %(threadName)s %(levelname)s %(name)s: %(message)s"))
        logger = logging.getLogger(LOGGER_NAME)
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
        logger.addHandler(handler)
        _handler = handler
        return path


def remove_log_handler() -> None:
    """Detach and close the handler ``install_log_handler`` attached, if any."""
    global _handler
    with _handler_lock:
        if _handler is None:
            return
        logging.getLogger(LOGGER_NAME).removeHandler(_handler)
        _handler.close()
        _handler = None
