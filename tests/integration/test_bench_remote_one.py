"""Smoke test of benchmarks/bench_remote_one.py against a real ZooKeeper and two real daemons.

Checks the shape of the report, never a speed: every figure is there, p50 <= p90, and the
node that was asked used CPU (the benchmark itself raises if a load misses its block).
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
FIGURES = {f"{op}_{what}" for op in ("put", "get")
           for what in ("p50_us", "p90_us", "cpu_a_us", "cpu_b_us", "cpu_client_us")}


@pytest.mark.timeout(180)
def test_a_round_reports_every_figure_for_saves_and_loads_through_a_node_that_does_not_own_them() -> None:
    why = zk.available()
    if why:
        pytest.skip(f"no ZooKeeper: {why}")
    proc = subprocess.run([sys.executable, "benchmarks/bench_remote_one.py", "--n", "100", "--rounds", "1",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = json.loads(proc.stdout)
    assert len(rounds) == 1 and set(rounds[0]) == FIGURES
    r = rounds[0]
    for op in ("put", "get"):
        assert 0 < r[f"{op}_p50_us"] <= r[f"{op}_p90_us"], r
        assert min(r[f"{op}_cpu_a_us"], r[f"{op}_cpu_b_us"], r[f"{op}_cpu_client_us"]) >= 0, r
    assert r["put_cpu_a_us"] + r["get_cpu_a_us"] > 0, r  # the node asked did the work
