"""The optional ``pk`` field of RESERVE and PIN: one key, checked like the others."""

from __future__ import annotations

import pytest

from emsd.pool.keys import KeyBatch
from emsd.protocol.local import prev_key as _prev_key
from emsd.transport.frames import FrameError


def test_pk_decodes_an_int_key_and_a_tagged_key() -> None:
    assert _prev_key({}) is None
    int_key = KeyBatch.from_user([7])
    assert _prev_key({"pk": int_key.to_wire()[1]}).key(0) == 7  # type: ignore[union-attr]
    digest = KeyBatch.from_user([bytes(range(32))])
    assert _prev_key({"pk": digest.to_wire()[1]}).key(0) == bytes(range(32))  # type: ignore[union-attr]


@pytest.mark.parametrize("pk", [b"", b"x" * 9, "text", 5, b"\x40" + bytes(32)])
def test_a_bad_pk_is_an_invalid_argument(pk: object) -> None:
    with pytest.raises(FrameError, match="pk"):
        _prev_key({"pk": pk})
