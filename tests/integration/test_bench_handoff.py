"""Smoke test of benchmarks/bench_handoff.py against a real ZooKeeper and real daemons.

Checks what the report says, never a speed: with the handoff the newcomer finds every key and
the pass moved exactly its share; without it, the newcomer's own share is what it misses.
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


@pytest.mark.timeout(240)
def test_with_the_handoff_the_newcomer_finds_every_key_and_without_it_misses_its_share() -> None:
    why = zk.available()
    if why:
        pytest.skip(f"no ZooKeeper: {why}")
    proc = subprocess.run([sys.executable, "benchmarks/bench_handoff.py", "--blocks", "32", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=230,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    on, off = json.loads(proc.stdout)["runs"]
    assert on["handoff"] and not off["handoff"]
    assert 0 < on["b_share"] == off["b_share"] < 32
    assert on["found_through_b"] == 32 and on["moved"] == on["b_entries"] == on["b_share"]
    assert on["kept"] == 0 and on["seconds"] > 0 and on["gbps"] > 0
    assert off["found_through_b"] == 32 - off["b_share"]
