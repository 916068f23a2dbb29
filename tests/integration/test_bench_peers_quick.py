"""Smoke test of benchmarks/peers: the quick mode against a real emsd, the memmove reference,
and Redis and memcached when this machine has them (scripts/setup-bench-peers.sh; CI's
scripts/setup.sh installs neither, so there they must be reported as not run, with a reason).

Checks the shape of the report, never a speed: every cell of the systems that ran has a
positive throughput and latencies, emsd's ratios are computed against each other system,
and a system that is missing is named with why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import stats

ROOT = Path(__file__).resolve().parents[2]
CELLS = {f"{s}/{m}/{o}" for s in stats.SIZES for m in stats.MODES for o in stats.OPS}
# The hugepages run raises the machine's hugepage count for a while and counts what each
# system maps; emsd on hugepages = "auto" (the quick run's) takes what is free: these run
# alone (scripts/test.sh), as do the other tests of the hugepage count.
pytestmark = pytest.mark.serial


@pytest.mark.timeout(300)
def test_quick_run_reports_every_cell_or_why_a_system_did_not_run(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    systems = ["memmove", "emsd", "redis", "memcached"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--quick", "--rounds", "1", "--systems", ",".join(systems),
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ran = report["systems"]
    assert {"memmove", "emsd"} <= set(ran), report["missing"]
    assert report["failed"] == {}
    for name in systems:
        assert (name in ran) != (name in report["missing"]), name  # ran, or named as not run
        if name in report["missing"]:
            assert report["missing"][name], f"{name} is missing without a reason"
    for name in ran:
        cells = report["results"][name]
        assert set(cells) == CELLS, name
        for key, cell in cells.items():
            assert cell["gbps"] > 0 and 0 < cell["p50_us"] <= cell["p99_us"], (name, key, cell)
    assert set(report["ratios"]["emsd"]) == set(ran) - {"emsd"}
    assert all(r is not None and r > 0 for r in report["ratios"]["emsd"]["memmove"].values())
    assert report["cpu"]["wall_s"] > 0 and report["cpu"]["other_processes_cpu_s"] >= 0
    assert "not run" in proc.stdout or set(ran) == set(systems)


@pytest.mark.timeout(300)
def test_hugepages_run_puts_emsd_on_hugepages_and_restores_the_count(tmp_path: Path) -> None:
    from emsd.pool.region import NR_HUGEPAGES, read_hugepage_info

    info = read_hugepage_info()
    if info is None or os.geteuid() != 0:
        pytest.skip("needs root and a kernel with hugetlb")
    before = Path(NR_HUGEPAGES).read_text()
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--quick", "--rounds", "1", "--systems", "memmove,emsd",
         "--hugepages", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(NR_HUGEPAGES).read_text() == before
    huge = json.loads(out.read_text())["hugepages"]
    pool_pages = (1 << 30) // info.page_size  # the quick run's emsd pool: 1 GiB
    if huge["free_at_start"] < pool_pages:
        pytest.skip(f"the kernel found only {huge['free_at_start']} free hugepages")
    assert huge["taken"] == {"memmove": 0, "emsd": pool_pages}
    assert f"emsd {pool_pages}" in proc.stdout
