"""The disk tier's slot allocator (emsd.tier.space): slots never overlap, bytes add up."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.tier.space import SECTOR, DiskSpace, FreeSlots, SpaceError, slot_for

EXTENT = 16 * SECTOR


def test_slots_are_sector_aligned_and_of_their_class() -> None:
    space = DiskSpace(4 * EXTENT, EXTENT)
    a = space.alloc(5000)
    b = space.alloc(5000)
    assert a is not None and b is not None
    assert a % SECTOR == 0 and b % SECTOR == 0 and abs(a - b) >= slot_for(5000)
    assert space.bytes_used == 2 * slot_for(5000)


def test_full_space_says_none_and_a_freed_extent_serves_another_size() -> None:
    space = DiskSpace(2 * EXTENT, EXTENT)
    big = [space.alloc(EXTENT) for _ in range(2)]
    assert None not in big and space.alloc(SECTOR) is None
    space.free(big[0], EXTENT)  # type: ignore[arg-type]
    assert space.alloc(SECTOR) is not None


def test_geometry_and_bad_frees_are_refused() -> None:
    with pytest.raises(SpaceError):
        DiskSpace(EXTENT, EXTENT + 1)
    with pytest.raises(SpaceError):
        DiskSpace(EXTENT - SECTOR, EXTENT)
    space = DiskSpace(EXTENT, EXTENT)
    with pytest.raises(SpaceError):
        space.free(0, SECTOR)
    assert space.alloc(0) is None and space.alloc(EXTENT + 1) is None


def test_restore_claims_exactly_the_slots_that_fit() -> None:
    space = DiskSpace(2 * EXTENT, EXTENT)
    assert space.restore(2 * SECTOR, SECTOR)
    assert not space.restore(2 * SECTOR, SECTOR)  # claimed twice
    assert not space.restore(3 * SECTOR, 2 * SECTOR)  # another class on the same extent
    assert not space.restore(EXTENT + SECTOR, 2 * SECTOR)  # not on a slot boundary of its class
    assert not space.restore(2 * EXTENT, SECTOR)  # outside the file
    assert space.alloc(SECTOR) not in (None, 2 * SECTOR)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, EXTENT)), max_size=120))
def test_slots_never_overlap_and_accounting_holds(ops: list[tuple[bool, int]]) -> None:
    space = DiskSpace(6 * EXTENT, EXTENT)
    held: dict[int, int] = {}
    for alloc, n in ops:
        if alloc or not held:
            off = space.alloc(n)
            if off is None:
                assert not space.has_room(n)
                continue
            end = off + slot_for(n)
            assert off % SECTOR == 0 and end <= space.size
            assert all(end <= o or o + slot_for(m) <= off for o, m in held.items())
            held[off] = n
        else:
            off = next(iter(held))
            space.free(off, held.pop(off))
        assert space.bytes_used == sum(slot_for(m) for m in held.values())
    for off, n in list(held.items()):
        space.free(off, n)
    assert space.bytes_used == 0 and all(s == 0 for s in space.extent_slot)


def test_a_class_hands_out_its_lowest_free_slot_first() -> None:
    space = DiskSpace(4 * EXTENT, EXTENT)
    first = [space.alloc(2 * SECTOR) for _ in range(8)]
    assert first == [i * 2 * SECTOR for i in range(8)]  # one after another, as demoted
    for off in (6 * SECTOR, 2 * SECTOR):
        space.free(off, 2 * SECTOR)
    assert [space.alloc(2 * SECTOR) for _ in range(3)] == [2 * SECTOR, 6 * SECTOR, 16 * SECTOR]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add-unheaped", "discard", "pop"]), st.integers(0, 40)),
                max_size=200))
def test_free_slots_pop_the_lowest_of_what_is_free(ops: list[tuple[str, int]]) -> None:
    free, model = FreeSlots(), set[int]()
    for op, n in ops:
        if op.startswith("add"):
            free.update(range(n, n + 3), heap=op == "add")  # unheaped: as a restart adds an extent
            model.update(range(n, n + 3))
        elif op == "discard":
            free.discard(n)
            model.discard(n)
        elif model:
            assert free.pop() == min(model)
            model.remove(min(model))
        assert bool(free) == bool(model) and all((i in free) == (i in model) for i in range(41))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * EXTENT // SECTOR), st.sampled_from([SECTOR, 2 * SECTOR, 5000])),
                max_size=60),
       st.integers(0, 40))
def test_a_restart_then_allocations_never_hand_out_a_restored_slot(rows: list[tuple[int, int]],
                                                                   allocs: int) -> None:
    """Slots restored at a restart stay taken; the rest of their extents are handed out lowest
    first, and the bytes add up (the heaps are built lazily after a restore)."""
    space = DiskSpace(3 * EXTENT, EXTENT)
    held: dict[int, int] = {}
    for sector, n in rows:
        off = sector * SECTOR
        if space.restore(off, n):
            assert all(off + slot_for(n) <= o or o + slot_for(m) <= off for o, m in held.items())
            held[off] = n
    assert space.bytes_used == sum(slot_for(m) for m in held.values())
    by_class: dict[int, list[int]] = {}
    for _ in range(allocs):
        off = space.alloc(SECTOR)
        if off is None:
            break
        assert all(off + SECTOR <= o or o + slot_for(m) <= off for o, m in held.items())
        held[off] = SECTOR
        by_class.setdefault(space.extent_of(off), []).append(off)
    for offs in by_class.values():
        assert offs == sorted(offs)  # one extent's free slots, lowest first
    assert space.bytes_used == sum(slot_for(m) for m in held.values())
    for off, n in held.items():
        space.free(off, n)
    assert space.bytes_used == 0


def _state(space: DiskSpace) -> tuple:
    free = {s: sorted(f._set) for s, f in space._free.items() if f}
    return space.extent_slot, space.extent_used, space.bytes_used, space._free_extents, free


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 3 * EXTENT // SECTOR + 2),
                          st.sampled_from([0, 1, SECTOR, 2 * SECTOR, 5000, 3 * SECTOR, EXTENT, EXTENT + 1])),
                max_size=80),
       st.booleans())
def test_restore_many_claims_what_restore_row_by_row_claims(rows: list[tuple[int, int]], busy: bool) -> None:
    """A restart's re-index in whole arrays gives each row the answer ``restore`` gives it in
    turn (misfits, another class on an extent, a slot claimed twice) and leaves the same space:
    the same classes, counts, free extents in the same order and free slots; the next
    allocations come out the same. ``busy``: a space with a slot taken already (the loop)."""
    import numpy as np

    one, many = DiskSpace(3 * EXTENT, EXTENT), DiskSpace(3 * EXTENT, EXTENT)
    if busy:
        assert one.alloc(SECTOR) == many.alloc(SECTOR)
    want = [one.restore(sector * SECTOR, n) for sector, n in rows]
    offs = np.array([sector * SECTOR for sector, _ in rows], dtype=np.int64)
    got = many.restore_many(offs, np.array([n for _, n in rows], dtype=np.int64))
    assert got.tolist() == want
    assert _state(many) == _state(one)
    for n in (SECTOR, 5000, 2 * SECTOR, SECTOR):
        assert many.alloc(n) == one.alloc(n)
