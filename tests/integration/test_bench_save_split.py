"""Smoke test of benchmarks/bench_save_split.py against a real daemon: the shape of its report,
never a speed (every part there, in order p10 <= p50 <= p90, most saves matched with the
daemon's read of them), and its matching of marks on made-up times."""

from __future__ import annotations

import array
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_save_split as split  # noqa: E402


def test_marks_become_reads_and_saves_their_parts() -> None:
    E, W, X = split.ENTRY, split.WRITTEN, split.EXIT
    marks = array.array("q", [E, 100, W, 150, X, 155, E, 200, X, 210, E, 300, W, 380, X, 381])
    reads = split.daemon_reads(marks.tobytes())
    assert reads == [(100, 150), (300, 380)]  # the middle read wrote no answer
    unpolled = array.array("q", [E, 100, X, 150, E, 300, X, 380])  # busy polling off: no written mark
    assert split.daemon_reads(unpolled.tobytes()) == reads
    calls = [(90, 170), (290, 400)]
    puts = [(95, 7), (295, 8)]
    answers = {7: 160, 8: 390}
    assert split.split(calls, puts, answers, reads) == [(5, 5, 50, 10, 10, 80), (5, 5, 80, 10, 10, 110)]
    assert split.split(calls, puts, {7: 140, 8: 390}, reads) == [(5, 5, 80, 10, 10, 110)]  # read after answer


@pytest.mark.timeout(120)
def test_a_short_run_reports_every_part() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/bench_save_split.py", "--n", "200", "--pool", "256MiB",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=110,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["saves"] == 200 and out["matched"] >= 100, out
    for name in (*split.PARTS, "call", "every call"):
        q = out[name]
        assert 0 <= q["p10"] <= q["p50"] <= q["p90"], (name, q)
    assert out["call"]["p50"] > 0
    assert sum(out["slowest tenth"].values()) == pytest.approx(1.0)
    waits = out["grant waits"]
    assert 0 <= waits["saves"] <= 200 and waits["max"] >= waits["p99"] >= 0, waits
