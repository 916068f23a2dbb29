"""emsctl against real daemons: status, stats, owner, drop, drain and config check, as tables and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402
from test_cluster import BLOCK, BLOCKS, KEYS, SLOTS, kv, load_equal, stats, use, wait_for  # noqa: E402
from test_tenants import KEY_A, tenants_file  # noqa: E402, F401 - a fixture, taken through request

from ems import CcConfig, CcKvOption, Ems  # noqa: E402
from ems.namespace import namespace_name  # noqa: E402

NS = namespace_name(None, CcConfig(rank_id=0, device_id=0, model_id="m"), "")


def emsctl(*args: str, socket_dir: Path | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    where = ["--socket-dir", str(socket_dir)] if socket_dir is not None else []
    return subprocess.run([sys.executable, "-m", "emsd.ctl", *where, *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


pytestmark = pytest.mark.usefixtures("reset_sdk")


def test_status_stats_owner_and_config_check_on_a_standalone_node(emsd: Any, monkeypatch: Any,
                                                                   tmp_path: Path) -> None:
    cc = use(emsd, monkeypatch)
    cc.register_kvcache(kv(1))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS

    out = emsctl("status", socket_dir=emsd.socket_dir)
    assert out.returncode == 0, out.stderr
    assert "test-0" in out.stdout and "standalone" in out.stdout and "100.0%" in out.stdout
    st = json.loads(emsctl("--json", "status", socket_dir=emsd.socket_dir).stdout)
    assert st["entries"] == BLOCKS and st["restart"] == "new" and NS in st["namespace_names"]
    assert st["clients"] == 2  # the SDK and emsctl itself
    assert st["granted"] >= 0 and "(granted " in out.stdout  # chunks held for clients' next saves

    stop = threading.Event()

    def load_loop() -> None:
        while not stop.is_set():
            cc.load(SLOTS, hashes=KEYS[:-1] + [1], offsets=[BLOCK] * BLOCKS)

    loader = threading.Thread(target=load_loop)
    loader.start()
    try:
        rates = json.loads(emsctl("--json", "stats", "--interval", "0.5", socket_dir=emsd.socket_dir).stdout)
    finally:
        stop.set()
        loader.join()
    assert rates["ops_per_s"]["pin"] > 0
    assert 0.9 < rates["load_hit_ratio"] < 1.0  # 47 hits and one miss a call
    table = emsctl("stats", "--interval", "0.2", socket_dir=emsd.socket_dir)
    assert table.returncode == 0 and "load hit ratio" in table.stdout

    owners = json.loads(emsctl("--json", "owner", "--namespace", NS, "1", "0xabcd",
                               socket_dir=emsd.socket_dir).stdout)
    assert owners["owners"] == {"1": ["test-0"], "0xabcd": ["test-0"]}
    bad_key = emsctl("owner", "--namespace", NS, "x1", socket_dir=emsd.socket_dir)
    assert bad_key.returncode == 2 and "KEY" in bad_key.stderr

    good = emsd.config_path
    assert emsctl("config", "check", str(good)).returncode == 0
    broken = tmp_path / "bad.toml"
    broken.write_text('[pool]\nsize = "lots"\n')
    res = emsctl("config", "check", str(broken))
    assert res.returncode == 2 and "pool.size" in res.stderr and len(res.stderr.splitlines()) == 1

    gone = emsctl("status", socket_dir=tmp_path)
    assert gone.returncode == 1 and "cannot reach emsd" in gone.stderr
    assert emsd.alive()


@pytest.mark.skipif(zk.available() is not None, reason=str(zk.available()))
def test_drop_forgets_a_namespace_that_the_engine_still_has_open(emsd: Any, monkeypatch: Any) -> None:
    cc = use(emsd, monkeypatch)
    cc.register_kvcache(kv(2))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    out = emsctl("drop", "--namespace", NS, socket_dir=emsd.socket_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"dropped {NS}: {BLOCKS} blocks evicted on this node"
    assert cc.exists(KEYS).success == 0  # the engine's open connection sees the drop
    again = json.loads(emsctl("--json", "drop", "--namespace", NS, socket_dir=emsd.socket_dir).stdout)
    assert again == {"namespace": NS, "dropped": 0}
    refused = emsctl("drop", "--namespace", "", socket_dir=emsd.socket_dir)
    assert refused.returncode == 1 and "namespace name" in refused.stderr


def test_drop_of_a_tenants_namespace_speaks_for_that_tenant(emsd_factory: Any, request: Any,
                                                            monkeypatch: Any) -> None:
    from ems import EmsConfig

    d = emsd_factory(tenants={"file": str(request.getfixturevalue("tenants_file"))})
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(access_id="team-a", access_key=KEY_A,
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    cc.register_kvcache(kv(2))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    ns = namespace_name("team-a", CcConfig(rank_id=0, device_id=0, model_id="m"), "")
    team_a = {"EMS_ACCESS_KEY": KEY_A}
    # A tenants file, no default tenant: the operator's session (root here) sees no tenant's names.
    operator = emsctl("--json", "status", socket_dir=d.socket_dir)
    assert operator.returncode == 0, operator.stderr
    assert not any(n.startswith("tenant:") for n in json.loads(operator.stdout)["namespace_names"])
    status = emsctl("--json", "--access-id", "team-a", "status", socket_dir=d.socket_dir, env=team_a)
    listed = f"tenant:team-a/{ns}"  # the daemon's name of it, as status lists it
    assert listed in json.loads(status.stdout)["namespace_names"]
    hint = emsctl("drop", "--namespace", listed, socket_dir=d.socket_dir)  # the default tenant cannot
    assert hint.returncode == 2 and "--access-id team-a" in hint.stderr
    other = emsctl("--access-id", "team-b", "drop", "--namespace", listed, socket_dir=d.socket_dir,
                   env=team_a)
    assert other.returncode == 2 and "tenant 'team-a'" in other.stderr
    no_key = emsctl("--access-id", "team-a", "drop", "--namespace", ns, socket_dir=d.socket_dir,
                    env={"EMS_ACCESS_KEY": ""})
    assert no_key.returncode == 2 and "EMS_ACCESS_KEY" in no_key.stderr
    wrong = emsctl("--access-id", "team-a", "drop", "--namespace", ns, socket_dir=d.socket_dir,
                   env={"EMS_ACCESS_KEY": "x" * 44})
    assert wrong.returncode == 1 and "refused" in wrong.stderr
    assert cc.exists(KEYS).success == BLOCKS  # nothing dropped so far
    out = emsctl("--json", "--access-id", "team-a", "drop", "--namespace", listed, socket_dir=d.socket_dir,
                 env=team_a)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"namespace": ns, "dropped": BLOCKS}
    assert cc.exists(KEYS).success == 0
    assert d.proc.poll() is None


def test_drain_moves_a_nodes_share_to_the_others_before_it_stops(emsd_factory: Any, tmp_path: Path,
                                                                 monkeypatch: Any) -> None:
    server = zk.ZooKeeperServer(tmp_path / "zk").start()
    try:
        secret = tmp_path / "secret"
        secret.write_text("drain-test-cluster-secret\n")
        secret.chmod(0o600)
        a, b = (emsd_factory(cluster={"name": "d", "zookeeper": server.hosts, "secret_file": str(secret),
                                      "peer_listen": f"127.0.0.1:{zk.free_port()}", "session_timeout": 4})
                for _ in range(2))
        wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in (a, b)))
        src = kv(2)
        cc = use(a, monkeypatch)
        cc.register_kvcache(src)
        assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                       option=CcKvOption(write_rcache=False)).success == BLOCKS
        held_a = stats(a)["entries"]
        assert 0 < held_a < BLOCKS
        owners = json.loads(emsctl("--json", "owner", "--namespace", NS, *map(str, KEYS),
                                   socket_dir=a.socket_dir).stdout)["owners"]
        assert sum(v == ["test-0"] for v in owners.values()) == held_a

        out = emsctl("drain", socket_dir=a.socket_dir)
        assert out.returncode == 0, out.stderr
        assert f"drained: {held_a} blocks moved" in out.stdout and "to go" in out.stderr  # progress lines
        wait_for(lambda: stats(b)["members"] == ["test-1"])
        assert stats(b)["entries"] == BLOCKS  # b now holds the whole share
        Ems._reset()
        assert a.terminate() == 0
        load_equal(b, src, KEYS, monkeypatch)
    finally:
        server.stop()


def test_placement_set_is_refused_without_a_zookeeper_cluster(emsd: Any) -> None:
    """No ZooKeeper, no shared record: the command fails with why, and the daemon keeps serving."""
    out = emsctl("placement", "set", "--vnodes", "64", "--replicas", "1", socket_dir=emsd.socket_dir)
    assert out.returncode == 1, out.stderr
    assert "only a ZooKeeper cluster keeps a placement record" in out.stderr, out.stderr
    assert emsd.alive() and stats(emsd)["membership"] == "standalone"
