"""Smoke test of benchmarks/bench_parts.py against a real ZooKeeper and two real daemons.

Checks the report's shape and the PINs each case costs, never a speed (the benchmark itself
raises if a load loads other than it should): a load that ends at a miss is one PIN, and two
when the SDK is made to pin the rest again (as against an emsd that offers no ``more``); a
local load of three times ``part`` is one PIN, and three in parts (as against an emsd that
offers no ``bring``).
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
CASES = ("local_ms", "local_parts_ms", "one_remote_ms", "one_then_miss_ms",
         "one_then_miss_pinned_again_ms", "miss_ms")


@pytest.mark.timeout(180)
def test_a_run_reports_every_case_and_a_load_that_ends_at_a_miss_or_is_all_here_costs_one_pin() -> None:
    why = zk.available()
    if why:
        pytest.skip(f"no ZooKeeper: {why}")
    cmd = [sys.executable, "benchmarks/bench_parts.py", "--reps", "1", "--json", "--checksum"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert set(r) == {"part_mib", "shared_index", *CASES, *(f"{c}_pins" for c in CASES)}
    assert r["part_mib"] == 64 and all(r[c] > 0 for c in CASES), r
    pins = (r["one_then_miss_ms_pins"], r["one_then_miss_pinned_again_ms_pins"], r["miss_ms_pins"])
    assert pins == (1, 2, 1), r
    # Checksums on: no shared index, so local loads PIN too. Three times ``part`` of blocks
    # here: one PIN (a PIN bounds what it brings here, not what it pins), three in parts.
    assert r["shared_index"] == 0 and (r["local_ms_pins"], r["local_parts_ms_pins"]) == (1, 3), r
