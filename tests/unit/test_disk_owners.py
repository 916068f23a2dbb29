"""SlotOwners (emsd.tier.owners): which entry holds each disk slot, against a dict."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.tier.owners import SlotOwners

EXTENT = 4096
EXTENTS = 4
SLOTS = (512, 1024, 4096)  # the size classes an extent may be carved in

_slot_at = st.tuples(st.integers(0, EXTENTS - 1), st.sampled_from(SLOTS), st.integers(0, 7))
_step = st.one_of(
    st.tuples(st.just("set"), _slot_at, st.integers(0, 50)),
    st.tuples(st.just("clear"), _slot_at, st.integers(0, 50)),
    st.tuples(st.just("set_many"), st.lists(st.tuples(st.integers(0, 7), st.integers(0, 50)), max_size=6),
              st.tuples(st.integers(0, EXTENTS - 1), st.sampled_from(SLOTS))),
)


def _offset(e: int, slot: int, k: int) -> int:
    return e * EXTENT + (k % (EXTENT // slot)) * slot


@settings(max_examples=300, deadline=None)
@given(st.lists(_step, max_size=40))
def test_owners_answer_what_a_dict_of_the_current_carving_answers(steps: list[tuple]) -> None:
    """Any mix of set, set_many and clear: ``on_extent`` names the owners set on the extent
    since it was last carved in another slot size (a carving of another size forgets the
    old one's owners), without those cleared by their own owner."""
    owners = SlotOwners(EXTENT)
    carving: dict[int, int] = {}  # extent -> its slot size
    model: dict[int, dict[int, int]] = {}  # extent -> slot offset -> owner
    for step in steps:
        if step[0] == "set_many":
            _, rows, (e, slot) = step
            rows = list({_offset(e, slot, k): (k, o) for k, o in reversed(rows)}.values())  # a slot once
            offs = [_offset(e, slot, k) for k, _ in rows]
            owners.set_many(np.array(offs, dtype=np.int64), np.full(len(rows), slot),
                            np.array([o for _, o in rows], dtype=np.int32))
            if rows:
                if carving.get(e) != slot:
                    carving[e], model[e] = slot, {}
                for off, (_, o) in zip(offs, rows, strict=True):
                    model[e][off] = o
            continue
        op, (e, slot, k), o = step
        off = _offset(e, slot, k)
        if op == "set":
            owners.set(off, slot, o)
            if carving.get(e) != slot:
                carving[e], model[e] = slot, {}
            model[e][off] = o
        elif carving.get(e) == slot and model[e].get(off) == o:
            owners.clear(off, slot, o)
            del model[e][off]
        else:
            owners.clear(off, slot, o)  # another's slot, or another carving: nothing changes
    for e in range(EXTENTS):
        for slot in SLOTS:
            want = sorted(model[e].values()) if carving.get(e) == slot else []
            assert sorted(owners.on_extent(e, slot)) == want, (e, slot)


def test_an_owner_costs_four_bytes_of_its_extents_slots() -> None:
    owners = SlotOwners(1 << 20)
    owners.set_many(np.arange(0, 1 << 20, 4096), np.full(256, 4096), np.arange(256, dtype=np.int32))
    assert owners.nbytes() == 256 * 4
    assert owners.on_extent(0, 4096) == list(range(256))
