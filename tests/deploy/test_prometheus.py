"""deploy/prometheus: promtool accepts the config and the rules, the rules' unit tests pass, and every
emsd metric the rules name is one a running daemon serves."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from emsd.config import load_config

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (scripts/setup-deploy-checks.sh)")

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (scripts/setup-deploy-checks.sh installs Debian's prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=PROM)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM / "emsd-rules.yml").read_text())
    return [r for group in doc["groups"] for r in group["rules"]]


@needs_promtool
def test_promtool_check_config() -> None:
    run = promtool("check", "config", "prometheus.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 rule files found" in run.stdout


@needs_promtool
def test_promtool_check_rules() -> None:
    run = promtool("check", "rules", "emsd-rules.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(rules())} rules found" in run.stdout


@needs_promtool
def test_promtool_rule_unit_tests(tmp_path: Path) -> None:
    run = promtool("test", "rules", "emsd-rules.test.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    # The unit tests can fail: the same tests against rules with a raised threshold.
    (tmp_path / "emsd-rules.yml").write_text(
        (PROM / "emsd-rules.yml").read_text().replace("> 0.05", "> 0.5"))
    shutil.copy(PROM / "emsd-rules.test.yml", tmp_path)
    assert PROMTOOL is not None
    run = subprocess.run([PROMTOOL, "test", "rules", "emsd-rules.test.yml"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert run.returncode != 0 and "EmsdSlowRequests" in run.stdout + run.stderr


def served_names(metrics_text: str) -> set[str]:
    """Sample names a scrape can return: from # TYPE lines (histograms add _bucket/_sum/_count)."""
    names: set[str] = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_rules_name_only_metrics_emsd_serves(emsd: Any) -> None:
    status, body = emsd.http("/metrics")
    assert status == 200
    served = served_names(body.decode())
    used = {m for r in rules() for m in re.findall(r"\bemsd_[a-z0-9_]+", str(r["expr"]))}
    assert used, "the rules name no emsd metric"
    assert used <= served, f"not served by emsd: {sorted(used - served)}"
    assert "emsd_no_such_metric" not in served


def test_scrape_config_matches_the_rules_and_the_daemons_default() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    host_config = load_config(ROOT / "deploy" / "systemd" / "emsd.toml")
    assert job["static_configs"][0]["targets"] == [host_config.metrics.listen]
    assert config["rule_files"] == ["emsd-rules.yml"]
    jobs = {j for r in rules() for j in re.findall(r'job="([^"]+)"', str(r["expr"]))}
    assert jobs == {job["job_name"]}
