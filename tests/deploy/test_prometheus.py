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


def test_rules_name_only_metrics_emsd_serves(emsd_disk: Any) -> None:
    status, body = emsd_disk.http("/metrics")  # with a disk tier: its metrics are named too
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


PROMETHEUS = shutil.which("prometheus")


needs_prometheus = pytest.mark.skipif(PROMETHEUS is None,
                                      reason="prometheus is not installed (Debian's prometheus package)")


def start_prometheus(tmp_path: Path, metrics_port: int) -> tuple[subprocess.Popen[bytes], int]:
    """A real Prometheus with the shipped config and rules, scraping ``metrics_port`` every second;
    (the process, its API port). The caller terminates it."""
    import shutil as sh
    import socket

    assert PROMETHEUS is not None
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
    cfg["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    sh.copy(PROM / "emsd-rules.yml", tmp_path / "emsd-rules.yml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - the child keeps it
    server = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    log.close()
    return server, port


@needs_prometheus
def test_a_real_prometheus_scrapes_emsd_with_the_shipped_config(emsd: Any, monkeypatch: Any,
                                                                tmp_path: Path) -> None:
    """The shipped scrape config, pointed at a test daemon, run by a real Prometheus server."""
    import json
    import time
    import urllib.parse
    import urllib.request

    import torch

    from ems import CcConfig, Ems, EmsConfig

    server, port = start_prometheus(tmp_path, emsd.metrics_port)

    def query(expr: str) -> list[Any]:
        url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return list(json.load(resp)["data"]["result"])
        except OSError:
            return []

    try:
        monkeypatch.setenv("EMS_SOCKET_DIR", str(emsd.socket_dir))
        Ems._reset()
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
        cc = Ems.get_cc()
        cc.register_kvcache([[torch.ones(8, 4, 16) for _ in range(2)]])
        assert cc.save(list(range(8)), hashes=[1, 2], offsets=[4, 4]).success == 2
        assert cc.load(list(range(12)), hashes=[1, 2, 3], offsets=[4, 4, 4]).success == 2
        deadline = time.monotonic() + 60
        while True:
            up = query('up{job="emsd"}')
            hits = query('emsd_lookup_keys_total{op="pin",result="hit"}')
            if up and hits:
                break
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        assert up[0]["value"][1] == "1"
        assert float(hits[0]["value"][1]) == 2
        assert float(query("emsd_pool_entries")[0]["value"][1]) == 2
        assert query('emsd_cluster_membership_state{state="standalone"} == 1')
        assert query("histogram_quantile(0.99, sum by (le) (emsd_op_duration_seconds_bucket))")
        rules = query("ALERTS")  # the shipped rules load and evaluate (none fires on a healthy node)
        assert all(r["metric"].get("alertstate") != "firing" for r in rules)
    finally:
        Ems._reset()
        server.terminate()
        server.wait(20)
