"""benchmarks/bench_disk.py and benchmarks/workload/disk_tier.py: their pure parts."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_disk import check, fill, kv
from benchmarks.workload.disk_tier import modelled_ttft
from benchmarks.workload.replay import BLOCK, Replayed
from benchmarks.workload.ttft import LoadCost


@given(st.integers(0, 10_000), st.integers(1, 8))
def test_a_filled_block_checks_and_another_blocks_pattern_does_not(first: int, count: int) -> None:
    tensors = kv(64 << 10, 8)
    fill(tensors, first, count)
    assert check(tensors, first, count) == count
    assert check(tensors, first + 251, count) == count  # the pattern repeats every 251 blocks
    assert check(tensors, first + 1, count) == 0  # each block's byte differs from its neighbour's
    tensors[0][1][count - 1, 3, 5] ^= 1  # one byte of the last block's V
    assert check(tensors, first, count) == count - 1


def row(hit_blocks: int, disk_reads: float | None) -> dict[str, object]:
    rep = Replayed(prompt=np.array([4096, 4096]), hit=np.array([hit_blocks, hit_blocks]) * BLOCK,
                   load_s=np.zeros(2), save_s=np.zeros(2), saved_blocks=0)
    return {"rep": rep, **({"disk": {"reads": disk_reads}} if disk_reads is not None else {})}


def test_hits_served_from_disk_load_at_the_disks_speed() -> None:
    load = LoadCost(0.001, 10e9)
    dram = modelled_ttft(row(32, None), load, 1e9)
    same = modelled_ttft(row(32, 0.0), load, 1e9)
    half = modelled_ttft(row(32, 32.0), load, 1e9)
    disk = modelled_ttft(row(32, 64.0), load, 1e9)
    assert dram == same < half < disk
    fast_disk = modelled_ttft(row(32, 64.0), load, 10e9)
    assert abs(fast_disk - dram) < 1e-12  # a disk as fast as DRAM models as DRAM
