"""emsd.tier.engine.runs: how a promotion's reads are cut into one I/O a run of adjacent slots."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from emsd.tier.engine import direct_ok, runs
from emsd.tier.space import SECTOR

LIMIT = 8 * SECTOR


@st.composite
def reads(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Blocks in distinct slots of a file, some adjacent, some not movable with O_DIRECT."""
    n = draw(st.integers(0, 24))
    lengths = [draw(st.sampled_from([SECTOR, 2 * SECTOR, 3 * SECTOR, 5000])) for _ in range(n)]
    gaps = [draw(st.sampled_from([0, 0, 0, SECTOR])) for _ in range(n)]
    offsets, at = [], 0
    for length, gap in zip(lengths, gaps, strict=True):
        at += gap
        offsets.append(at)
        at += -(-length // SECTOR) * SECTOR
    order = draw(st.permutations(range(n)))
    bases = [draw(st.sampled_from([0, SECTOR, 100])) + i * 16 * SECTOR for i in range(n)]
    return [offsets[i] for i in order], [lengths[i] for i in order], bases


@given(reads(), st.booleans())
def test_runs_cover_every_block_once_and_join_only_adjacent_movable_slots(
        r: tuple[list[int], list[int], list[int]], direct: bool) -> None:
    offsets, lengths, bases = r
    out = runs(offsets, lengths, bases, direct, LIMIT)
    flat = [i for span in out for i in span]
    assert sorted(flat) == list(range(len(offsets)))
    assert [offsets[i] for i in flat] == sorted(offsets)  # in file order
    movable = [direct and direct_ok(bases[i], lengths[i]) for i in range(len(offsets))]
    for span in out:
        if len(span) > 1:
            assert all(movable[i] for i in span)
            assert all(offsets[a] + lengths[a] == offsets[b] for a, b in pairwise(span))
            assert sum(lengths[i] for i in span) <= LIMIT
    for a, b in pairwise(out):  # a cut only where the next block could not join
        last, first = a[-1], b[0]
        could = movable[last] and movable[first] and offsets[last] + lengths[last] == offsets[first]
        assert not could or sum(lengths[i] for i in a) + lengths[first] > LIMIT
