"""``emsd.pool.nametable``: the namespace-name table of the pool's ledger and the disk tier's index."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from emsd.pool import nametable

BASE = 64
names = st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode()) <= nametable.SLOT - 2)


@given(st.dictionaries(st.integers(0, nametable.SLOTS - 1), names, max_size=20))
def test_written_names_read_back_and_nothing_else(table: dict[int, str]) -> None:
    buf = bytearray(BASE + nametable.SIZE)
    for ns, name in table.items():
        assert nametable.write_name(buf, BASE, ns, name.encode())
    assert nametable.read_names(buf, BASE) == table


@given(names, names)
def test_every_state_of_a_rewrite_reads_as_the_old_name_the_new_one_or_none(old: str, new: str) -> None:
    """A crash may stop a rewrite after any byte: the slot never reads as a mix of the two names."""
    buf = bytearray(BASE + nametable.SIZE)
    nametable.write_name(buf, BASE, 7, old.encode())
    done = bytearray(buf)
    nametable.write_name(done, BASE, 7, new.encode())
    at, raw = BASE + 7 * nametable.SLOT, new.encode()
    state = bytearray(buf)
    state[at : at + 2] = b"\0\0"  # write_name zeroes the length first, then writes the bytes
    for i in range(at + 2, at + 2 + len(raw)):
        assert nametable.read_names(state, BASE).get(7) is None
        state[i] = done[i]
    state[at : at + 2] = done[at : at + 2]  # and sets the length last
    assert state == done and nametable.read_names(state, BASE)[7] == new


def test_out_of_range_ids_and_long_names_are_refused() -> None:
    buf = bytearray(BASE + nametable.SIZE)
    assert not nametable.write_name(buf, BASE, nametable.SLOTS, b"x")
    assert not nametable.write_name(buf, BASE, -1, b"x")
    assert not nametable.write_name(buf, BASE, 0, b"x" * (nametable.SLOT - 1))
    assert buf == bytearray(BASE + nametable.SIZE)
