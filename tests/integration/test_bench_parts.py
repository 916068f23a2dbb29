"""Smoke test of benchmarks/bench_parts.py against a real ZooKeeper and two real daemons.

Checks the report's shape and the PINs each case costs, never a speed (the benchmark itself
raises if a load loads other than it should): a load that ends at a miss is one PIN, and two
when the SDK is made to pin the rest again (as against an emsd that offers no ``more``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CASES = ("local_parts_ms", "local_one_pin_ms", "one_remote_ms", "one_then_miss_ms",
         "one_then_miss_pinned_again_ms", "miss_ms")


@pytest.mark.timeout(180)
def test_a_run_reports_every_case_and_a_load_that_ends_at_a_miss_costs_one_pin() -> None:
    why = zk.available()
    if why:
        pytest.skip(f"no ZooKeeper: {why}")
    proc = subprocess.run([sys.executable, "benchmarks/bench_parts.py", "--reps", "1", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert set(r) == {"part_mib", "shared_index", *CASES, *(f"{c}_pins" for c in CASES)}
    assert r["part_mib"] == 64 and all(r[c] > 0 for c in CASES), r
    pins = (r["one_then_miss_ms_pins"], r["one_then_miss_pinned_again_ms_pins"], r["miss_ms_pins"])
    assert pins == (1, 2, 1), r
    assert r["local_parts_ms_pins"] == 0  # all in the shared index: no PIN at all
