"""Smoke test of benchmarks/bench_disk_index.py on a real disk tier in /var/tmp.

Checks what the report says, never a speed: every block was named by the snapshot (the
benchmark fails otherwise), each demotion at the quota evicted one block, and a handoff's
lookup found the blocks a three-node ring gives to the other two, and a restart re-indexed every
block the tier held before it (the benchmark fails otherwise), and its index memory is reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_the_disk_index_benchmark_reports_every_figure() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/bench_disk_index.py", "--blocks", "4000",
                           "--repeat", "3", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=110, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["blocks"] == 4000
    assert 4000 // 3 < out["away_blocks"] < 4000  # the other two nodes' share of a third each
    for field in ("keys_on_disk_ms", "checkout_us", "demote_on_disk_us", "demote_at_quota_us",
                  "demote_no_quota_us", "drop_ms", "away_whole_ms",
                  "restart_s", "dict_floor_s", "index_bytes_a_block"):
        assert out[field] > 0, field
    assert 0 < out["away_longest_part_ms"] <= out["away_whole_ms"]
