"""The daemon as a process: config errors, probes, metrics, bad clients, kills."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from ems import CcConfig, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.client import DaemonClient
from emsd.pool.keys import KeyBatch
from emsd.pool.region import read_hugepage_info
from emsd.protocol.local import (
    CountAnswer,
    ExistsRequest,
    PinAnswer,
    PinRequest,
    ReserveRequest,
)
from emsd.transport.frames import PROTOCOL_VERSION, Op, Status
from tests.messages import called, namespace_id

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4


def run_emsd(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "emsd", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize(("body", "key"), [
    ('[pool]\nsize = "lots"\n', "pool.size"),
    ('[pool]\nsize = "512KiB"\n', "pool.size"),
    ('[pool]\nhugepages = "maybe"\n', "pool.hugepages"),
    ('[pool]\npage_size = "100KiB"\n', "pool.page_size"),
    ('[node]\nid = "has space"\n', "node.id"),
    ('[node]\nsocket_dir = "relative/dir"\n', "node.socket_dir"),
    ('[metrics]\nlisten = "nowhere"\n', "metrics.listen"),
    ('[pool]\nsiez = "1GiB"\n', "pool.siez"),
    ("[pool\n", "--config"),
    ('[cluster]\nzookeeper = "zk:2181"\n', "cluster.secret_file"),
    ('[cluster]\nzookeeper = "zk"\n', "cluster.zookeeper"),
    ('[cluster]\nreplicas = 0\n', "cluster.replicas"),
    ('[cluster]\npeer_listen = "nowhere"\n', "cluster.peer_listen"),
    ('[pool]\nwarm_restart = "yes"\n', "pool.warm_restart"),
    ('[pool]\nstate_dir = "relative"\n', "pool.state_dir"),
    ('[log]\nformat = "xml"\n', "log.format"),
])
def test_bad_config_is_one_line_naming_the_key_and_exit_2(tmp_path: Path, body: str, key: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(body)
    proc = run_emsd("--config", str(cfg))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and "Traceback" not in proc.stderr


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    proc = run_emsd("--config", str(tmp_path / "absent.toml"))
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


@pytest.mark.serial  # not beside a run that raises the hugepage count
def test_hugepages_on_without_hugepages_fails_clearly(emsd_factory: Any) -> None:
    info = read_hugepage_info()
    if info is not None and info.available > 0:
        pytest.skip("this host has free hugepages")
    d = emsd_factory(start=False, pool={"hugepages": "on"})
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) == 2
    assert "pool.hugepages" in d.log()


def ns_name() -> str:
    from ems.namespace import namespace_name

    return namespace_name(None, CcConfig(rank_id=0, device_id=0, model_id="m"), "")


@pytest.mark.parametrize(("daemon_us", "sdk_us"), [(0, "0"), (0, "200"), (1000, "0")])
def test_busy_polling_on_either_side_or_neither_changes_no_answer(emsd_factory: Any, monkeypatch: Any,
                                                                  daemon_us: int, sdk_us: str) -> None:
    """``node.busy_poll`` and ``EMS_BUSY_POLL_US`` only decide who sleeps while waiting."""
    d = emsd_factory(node={"busy_poll": daemon_us})
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    monkeypatch.setenv("EMS_BUSY_POLL_US", sdk_us)
    Ems._reset()
    try:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
        cc = Ems.get_cc()
        src = [[torch.randn(32, BLOCK, 16) for _ in range(2)]]
        cc.register_kvcache(src)
        def slots(b: int) -> list[int]:
            return list(range(BLOCK * b, BLOCK * (b + 1)))

        for b in range(32):  # one block a call, as the polls are for
            assert cc.save(slots(b), hashes=[100 + b], offsets=[BLOCK]).success == 1
        dst = [[torch.zeros_like(t) for t in layer] for layer in src]
        cc.register_kvcache(dst)
        for b in range(32):
            assert cc.load(slots(b), hashes=[100 + b], offsets=[BLOCK]).success == 1
            assert cc.exists([100 + b, 999]).success == 1
        assert all(torch.equal(x, y) for x, y in zip(src[0], dst[0], strict=True))
    finally:
        Ems._reset()
    assert d.alive()


def test_healthz_and_metrics_after_a_workload(emsd: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(emsd.socket_dir))
    Ems._reset()
    try:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
        cc = Ems.get_cc()
        kv = [[torch.ones(8, BLOCK, 16) for _ in range(2)]]
        cc.register_kvcache(kv)
        assert cc.save(list(range(8)), hashes=[1, 2], offsets=[4, 4]).success == 2
        assert cc.load(list(range(12)), hashes=[1, 2, 3], offsets=[4, 4, 4]).success == 2
        assert cc.exists([1, 9]).success == 1
    finally:
        Ems._reset()
    assert emsd.http("/healthz") == (200, b"ok\n")
    assert emsd.http("/readyz") == (200, b"ready\n")
    assert emsd.http("/nope")[0] == 404
    assert emsd.metric("emsd_warm_restart_info", 'outcome="new"') == 1
    assert emsd.metric("emsd_cluster_membership_state", 'state="standalone"') == 1
    assert emsd.metric("emsd_cluster_members") == 1
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(emsd.http("/metrics")[1].decode())}
    by_tenant = {s.labels["tenant"]: s.value for s in fams["emsd_pool_tenant_bytes"].samples}
    assert by_tenant[""] > 0  # the default tenant's committed bytes
    assert "emsd_pool_namespace_bytes" not in fams  # names are clients': only with metrics.namespace_labels
    assert emsd.metric("emsd_ops_total", 'op="reserve",result="ok"') == 1
    assert emsd.metric("emsd_lookup_keys_total", 'op="pin",result="hit"') == 2
    assert emsd.metric("emsd_lookup_keys_total", 'op="pin",result="miss"') == 1
    assert emsd.metric("emsd_lookup_keys_total", 'op="exists",result="miss"') == 1
    assert emsd.metric("emsd_pool_bytes", 'state="used"') > 0
    assert emsd.metric("emsd_pool_entries") == 2
    assert emsd.metric("emsd_op_duration_seconds_count", 'op="pin"') == 1


def hello(sock: socket.socket) -> dict[str, Any]:
    head = msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": int(Op.HELLO)})
    sock.sendall(struct.pack("<II", len(head), 0) + head)
    data, fds, _, _ = socket.recv_fds(sock, 65536, 1)
    for fd in fds:
        os.close(fd)
    return msgpack.unpackb(data[8:])


def raw_request(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
    head = msgpack.packb({"v": PROTOCOL_VERSION, "id": 2, **header})
    sock.sendall(struct.pack("<II", len(head), len(payload)) + head + payload)
    prefix = _recv_exact(sock, 8)
    hlen, plen = struct.unpack("<II", prefix)
    answer = msgpack.unpackb(_recv_exact(sock, hlen))
    _recv_exact(sock, plen)
    return answer


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


GARBAGE = [
    b"\xff" * 64,                                          # absurd lengths
    struct.pack("<II", 10, 0) + b"\x00" * 10,               # header not msgpack map
    struct.pack("<II", 2**31, 0),                           # header too large
    struct.pack("<II", 4, 2**30) + b"abcd",                 # payload too large
    struct.pack("<II", 3, 0) + msgpack.packb([1, 2]),       # header is a list
]


@pytest.mark.parametrize("junk", GARBAGE)
def test_garbage_before_hello_leaves_the_daemon_serving(sdk_env: Any, junk: bytes) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sdk_env.socket_dir / "emsd.sock"))
        s.sendall(junk)
        try:
            s.recv(4096)
        except OSError:
            pass
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert Ems.check_health()


@pytest.mark.parametrize("header", [
    {"op": 99},
    {"op": int(Op.RESERVE), "ns": 0, "n": 1, "kt": 0},          # namespace not opened
    {"op": int(Op.EXISTS), "ns": "x", "n": 1, "kt": 0},
    {"op": int(Op.COMMIT), "c": 1, "a": 0},                     # handle not ours
    {"op": int(Op.RELEASE)},
    {"op": "exists"},
])
def test_bad_requests_get_an_error_status_and_the_connection_survives(
        sdk_env: Any, header: dict[str, Any]) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sdk_env.socket_dir / "emsd.sock"))
        assert hello(s)["st"] == Status.OK
        payload = b"\x01\x00\x00\x00" if header.get("op") in (Op.COMMIT, Op.RELEASE) else b"\x00" * 8
        answer = raw_request(s, header, payload)
        assert answer["st"] == Status.INVALID_ARGUMENT and answer["msg"]
        assert raw_request(s, {"op": int(Op.PING)})["st"] == Status.OK


def test_garbage_after_hello_closes_only_that_connection(sdk_env: Any) -> None:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    cc.register_kvcache([[torch.ones(4, BLOCK, 8)]])
    assert cc.save(list(range(4)), hashes=[1], offsets=[4]).success == 1
    for junk in GARBAGE:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(sdk_env.socket_dir / "emsd.sock"))
            assert hello(s)["st"] == Status.OK
            s.sendall(junk)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
    assert cc.exists([1]).success == 1
    assert sdk_env.alive()


CLIENT_LOOP = textwrap.dedent("""
    import sys, torch
    from ems import Ems, EmsConfig, CcConfig
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    kv = [[torch.randn(64, 4, 64, 64) for _ in range(2)] for _ in range(2)]  # 128 KiB per slot row set
    cc.register_kvcache(kv)
    mode = sys.argv[1]
    slots = list(range(64 * 4))
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        if mode == "save":
            cc.save(slots, hashes=[i * 1000 + k for k in range(64)], offsets=[4] * 64)
        else:
            cc.load(slots, hashes=[k for k in range(64)], offsets=[4] * 64)
""")


@pytest.mark.parametrize("mode", ["save", "load"])
def test_client_killed_mid_call_leaks_no_reservation_or_pin(emsd_factory: Any, mode: str) -> None:
    # 1 GiB: a connection may hold 1/64 of the pool in grants, so the 16 MiB saves get them
    d = emsd_factory(pool={"size": "1GiB", "page_size": "16MiB", "prefault": False})
    env = {**os.environ, "EMS_SOCKET_DIR": str(d.socket_dir)}
    if mode == "load":
        seed = subprocess.run([sys.executable, "-c", CLIENT_LOOP.replace("while True", "while i < 1"),
                               "save"], env=env, capture_output=True, text=True, timeout=60)
        assert seed.returncode == 0, seed.stderr
    victim = subprocess.Popen([sys.executable, "-c", CLIENT_LOOP, mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert victim.stdout is not None
    assert victim.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 20
    ops = ("reserve", "put") if mode == "save" else ("pin",)
    while sum(d.metric("emsd_ops_total", f'op="{op}",result="ok"') for op in ops) < 5:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.01)
    if mode == "save":  # after its first save, it saves into granted chunks (one PUT a save)
        assert d.metric("emsd_ops_total", 'op="put",result="ok"') >= 1
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        deadline = time.monotonic() + 10
        while True:
            stats, _ = client.call(Op.STATS, {}, timeout=5)
            if stats["pending"] == 0 and stats["pinned"] == 0 and stats["granted"] == 0 \
                    and d.metric("emsd_clients_connected") == 1:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
    finally:
        client.close()
    assert d.alive()


def test_daemon_killed_makes_calls_fail_fast_with_io_error(sdk_env: Any) -> None:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    cc.register_kvcache([[torch.ones(4, BLOCK, 8)]])
    assert cc.save(list(range(4)), hashes=[1], offsets=[4]).success == 1
    sdk_env.kill9()
    t0 = time.monotonic()
    for call in (lambda: cc.exists([1]), lambda: cc.load(list(range(4)), hashes=[1], offsets=[4]),
                 lambda: cc.save(list(range(4)), hashes=[2], offsets=[4])):
        with pytest.raises(EmsException) as info:
            call()
        assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    fut = cc.async_load(list(range(4)), hashes=[1], offsets=[4])
    with pytest.raises(EmsException):
        cc.get_result(fut)
    assert Ems.check_health() is False
    assert time.monotonic() - t0 < 2.0


def test_sigterm_exits_zero_and_removes_the_socket(emsd: Any) -> None:
    assert (emsd.socket_dir / "emsd.sock").exists()
    assert emsd.terminate() == 0
    assert not (emsd.socket_dir / "emsd.sock").exists()
    assert "stopped" in emsd.log()


def test_a_second_daemon_on_the_same_socket_refuses_to_start(emsd: Any, emsd_factory: Any) -> None:
    other = emsd_factory(start=False, node={"socket_dir": str(emsd.socket_dir)})
    other.start(wait=False)
    assert other.proc.wait(20) == 2
    assert "already serving" in other.log()
    assert emsd.alive()
    # The refused daemon leaves the running one's socket file alone: new clients still reach it.
    client = DaemonClient(emsd.socket_dir / "emsd.sock")
    client.connect({})
    try:
        assert client.call(Op.STATS, {}, timeout=5)[0]["node"] == emsd.sections["node"]["id"]
    finally:
        client.close()


def test_full_pool_of_pinned_blocks_shows_in_success_not_an_exception(emsd_factory: Any,
                                                                     monkeypatch: Any) -> None:
    # One save fills the pool: let one connection hold all of it reserved (default: half).
    d = emsd_factory(pool={"size": "8MiB", "page_size": "8MiB", "connection_uncommitted": "8MiB"})
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    try:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
        cc = Ems.get_cc()
        kv = [[torch.ones(8, BLOCK, 512, 512, dtype=torch.uint8)]]  # 1 MiB blocks: 8 fill the pool
        cc.register_kvcache(kv)
        slots = list(range(8 * BLOCK))
        first = cc.save(slots, hashes=list(range(8)), offsets=[BLOCK] * 8)
        assert first.success == 8
        # Pin all of them from a second connection and keep the pins.
        holder = DaemonClient(d.socket_dir / "emsd.sock")
        holder.connect({})
        ns = cc._ns(Ems._current_client(), None)
        pin = PinRequest(namespace_id(holder, cc._namespace), KeyBatch.from_user(list(range(8))))
        pinned = PinAnswer.decode(*called(holder, Op.PIN, pin), 8)
        assert len(pinned.handles) == 8 and ns >= 0
        res = cc.save(slots, hashes=list(range(100, 108)), offsets=[BLOCK] * 8)
        assert (res.success, res.total) == (0, 8)
        assert cc.exists(list(range(8))).success == 8  # pinned blocks survived
        holder.close()
        deadline = time.monotonic() + 5
        while cc.save(slots, hashes=list(range(100, 108)), offsets=[BLOCK] * 8).success < 8:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert cc.exists(list(range(100, 108))).success == 8
    finally:
        Ems._reset()


def test_json_logs_are_one_object_per_line_with_a_startup_summary(emsd_factory: Any) -> None:
    import json

    d = emsd_factory(log={"level": "info", "format": "json"})
    assert d.terminate() == 0
    lines = [json.loads(line) for line in d.log().splitlines() if line.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(rec) for rec in lines)
    ready = [rec["msg"] for rec in lines if rec["msg"].startswith("ready: ")]
    assert len(ready) == 1
    for fact in ("pool 64 MiB shm", "warm restart new", "standalone", "transport none", "metrics 127.0.0.1:"):
        assert fact in ready[0], ready[0]


def _wait_for_stats(client: DaemonClient, ok: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        stats, _ = client.call(Op.STATS, {}, timeout=5)
        if ok(stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_save_or_load_failing_while_the_daemon_answers_leaves_nothing_held(
        sdk_env: Any, monkeypatch: Any, op: str) -> None:
    """The SDK plans its copy while the daemon reserves (or pins): if planning fails, the
    reservation is aborted (the pins dropped) and the planning error is what the caller sees."""
    from ems.layout import KvLayout

    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    cc.register_kvcache([[torch.ones(8, BLOCK, 8)]])
    assert cc.save(list(range(8)), hashes=[1, 2], offsets=[4, 4]).success == 2

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("planning failed")

    monkeypatch.setattr(KvLayout, "plan", broken)
    call = cc.save if op == "save" else cc.load
    with pytest.raises(RuntimeError, match="planning failed"):
        call(list(range(8)), hashes=[3, 4] if op == "save" else [1, 2], offsets=[4, 4])
    stats = _wait_for_stats(Ems._current_client(), lambda s: s["pending"] == 0 and s["pinned"] == 0)
    assert stats["entries"] == 2  # the save's keys were never committed
    monkeypatch.undo()
    assert cc.exists([1, 2, 3]).success == 2


def test_a_submitted_request_given_up_at_once_is_undone_by_its_late_callback(sdk_env: Any) -> None:
    """``wait(timeout=0)`` gives up before anyone read the answer; when the answer comes, the
    ``late`` callback aborts the reservation, as for a call that timed out."""
    from ems.context_caching import _abort_late

    client = DaemonClient(sdk_env.socket_dir / "emsd.sock")
    client.connect({})
    try:
        ns = namespace_id(client, "n")
        keys = KeyBatch.from_user([7, 8])
        reserve = ReserveRequest(ns, keys, np.full(2, 64, np.uint64))
        pending = client.submit(Op.RESERVE, *reserve.encode(), late=_abort_late(client, 2))
        with pytest.raises(EmsException) as info:
            client.wait(pending, timeout=0)
        assert info.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        stats = _wait_for_stats(client, lambda s: s["pending"] == 0)  # the answer came, then the abort
        assert stats["entries"] == 0
        header, payload = client.wait(client.submit(Op.EXISTS, *ExistsRequest(ns, keys).encode()), 5)
        assert CountAnswer.decode(header, payload, 2).held == 0
    finally:
        client.close()
