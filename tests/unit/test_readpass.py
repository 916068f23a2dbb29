"""Read passes (emsd.protocol.readpass): only a genuine pass, unexpired, names its tenant."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emsd.protocol import readpass
from emsd.transport.frames import FrameError

SECRET = b"s" * 32
tenants = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._@-", max_size=512)


@given(tenants, st.integers(1, 2**40))
def test_a_pass_names_its_tenant_until_it_expires(tenant: str, expires: int) -> None:
    blob = readpass.issue(SECRET, tenant, expires)
    assert len(blob) <= readpass.MAX_PASS
    assert readpass.check(SECRET, blob, expires - 0.5) == (tenant, expires)
    with pytest.raises(FrameError, match="expired"):
        readpass.check(SECRET, blob, expires)


@given(tenants, st.data())
def test_any_changed_byte_is_refused(tenant: str, data: st.DataObject) -> None:
    blob = bytearray(readpass.issue(SECRET, tenant, 2**40))
    at = data.draw(st.integers(0, len(blob) - 1))
    blob[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(FrameError):
        readpass.check(SECRET, bytes(blob), 0)


def test_another_secret_or_another_shape_is_refused() -> None:
    blob = readpass.issue(SECRET, "team-a", 2**40)
    with pytest.raises(FrameError, match="not signed"):
        readpass.check(b"t" * 32, blob, 0)
    for bad in (None, "text", b"", b"x" * 32, blob + b"x" * readpass.MAX_PASS):
        with pytest.raises(FrameError):
            readpass.check(SECRET, bad, 0)
