"""Smoke test of benchmarks/bench_drain_queue.py: both drains make every block a copy (the
benchmark fails otherwise) in the same number of steps. Never a speed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_both_drains_take_every_block_in_the_same_steps() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/bench_drain_queue.py", "--blocks", "20000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=110,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [int(s) for s in re.findall(r"\((\d+) steps\)", proc.stdout)]
    assert len(steps) == 2 and steps[0] == steps[1] >= 20000 // 256, proc.stdout
