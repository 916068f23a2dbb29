"""deploy/grafana: the dashboard is well-formed, every metric its panels use is one a running emsd
serves, and every expression is valid PromQL to a real Prometheus scraping a real daemon."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from test_prometheus import needs_prometheus, served_names, start_prometheus

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "emsd-dashboard.json"


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def as_promql(expr: str) -> str:
    """A panel expression as Grafana sends it: template variables filled in."""
    return expr.replace("$__rate_interval", "1m").replace("$instance", ".*")


def test_the_dashboard_is_well_formed() -> None:
    d = dashboard()
    panels = d["panels"]
    assert len(panels) >= 15
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    names = {v["name"] for v in d["templating"]["list"]}
    assert names == {"datasource", "instance"}
    assert all('instance=~"$instance"' in e for e in exprs())  # every panel follows the node picker


def test_panels_use_only_metrics_emsd_serves(emsd_disk: Any) -> None:
    status, body = emsd_disk.http("/metrics")  # with a disk tier: its panels' metrics too
    assert status == 200
    served = served_names(body.decode())
    used = {m for e in exprs() for m in re.findall(r"\bemsd_[a-z0-9_]+", e)}
    assert len(used) >= 15
    assert used <= served, f"not served by emsd: {sorted(used - served)}"


@needs_prometheus
def test_every_panel_expression_is_valid_promql_against_a_real_prometheus(emsd_disk: Any,
                                                                          tmp_path: Path) -> None:
    server, port = start_prometheus(tmp_path, emsd_disk.metrics_port)

    def query(expr: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return dict(json.load(resp))
        except urllib.error.HTTPError as exc:  # 400 for a bad expression, with the reason
            return dict(json.load(exc))

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if query('up{job="emsd"}').get("data", {}).get("result"):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        bad = {e: r.get("error") for e in exprs() if (r := query(as_promql(e)))["status"] != "success"}
        assert not bad, bad
        assert query("this is not promql")["status"] == "error"  # the check can fail
        ready = query(as_promql(exprs()[0]))["data"]["result"]
        assert ready and float(ready[0]["value"][1]) == 1  # the first panel shows the daemon
    finally:
        server.terminate()
        server.wait(20)
