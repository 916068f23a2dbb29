"""The shared index against a real daemon (``emsd.pool.shared_index``): the SDK loads blocks
in the pool and answers ``exists`` of them without a round trip, never returns bytes of a
block that was evicted, dropped or reused meanwhile, keeps the LRU current with ``TOUCH``,
and cannot write the table; where it is not offered (off, tenants, checksums) the SDK asks
the daemon as before."""

from __future__ import annotations

import mmap
import os
import socket
import time
from typing import Any

import pytest
import torch

from ems import CcConfig, Ems, EmsConfig
from ems.client import DaemonClient
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import CountAnswer, TouchRequest
from emsd.transport.frames import PROTOCOL_VERSION, FrameDecoder, Op, encode_parts
from tests.messages import called, namespace_id

BLOCKS, TOKENS = 8, 4
SLOTS = list(range(BLOCKS * TOKENS))
KEYS = [900 + k for k in range(BLOCKS)]
OFFSETS = [TOKENS] * BLOCKS
KEY = "KeyA0123456789abcdefghijklmnopqrstuvwxyz"  # a tenant's access key


def ops(d: Any, op: str) -> float:
    """Requests of ``op`` the daemon handled, whatever their result."""
    _, body = d.http("/metrics")
    return sum(float(line.split()[-1]) for line in body.decode().splitlines()
               if line.startswith(f'emsd_ops_total{{op="{op}"'))


def connect(d: Any, monkeypatch: pytest.MonkeyPatch, model: str = "shared") -> tuple[Any, list[Any]]:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id=model)))
    cc = Ems.get_cc()
    kv = [[torch.zeros((BLOCKS, TOKENS, 16, 64)) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    return cc, kv


def connect_second(d: Any) -> tuple[Any, list[Any], DaemonClient]:
    """A second engine process's connection to the same namespace (a raw ``ContextCaching``)."""
    from ems.cc_v1.cc_config import CcConfig_v1
    from ems.context_caching import ContextCaching
    from ems.profiling import Profiler

    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    config = CcConfig_v1(rank_id=0, device_id=0, model_id="shared")
    cc = ContextCaching(lambda: client, config, None, Profiler.from_env())
    kv = [[torch.zeros((BLOCKS, TOKENS, 16, 64)) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    return cc, kv, client


def fill(kv: list[Any], value: float) -> None:
    for layer in kv:
        for t in layer:
            t.fill_(value)


def values(kv: list[Any]) -> set[float]:
    return {float(v) for layer in kv for t in layer for v in t.unique().tolist()}


@pytest.fixture(autouse=True)
def _reset() -> Any:
    yield
    Ems._reset()


def test_loads_and_exists_of_blocks_in_the_pool_need_no_round_trip(emsd: Any, monkeypatch: Any) -> None:
    cc, kv = connect(emsd, monkeypatch)
    client = Ems._client
    assert client.index is not None, "the daemon offers its shared index by default"
    fill(kv, 3.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    pins, exists, touches = ops(emsd, "pin"), ops(emsd, "exists"), ops(emsd, "touch")

    fill(kv, 0.0)
    assert cc.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    assert values(kv) == {3.0}
    assert cc.exists(KEYS).success == BLOCKS
    assert cc.exists(KEYS + [1]).success == BLOCKS  # a key not here: the daemon answers
    assert ops(emsd, "pin") == pins and ops(emsd, "exists") == exists + 1
    deadline = time.monotonic() + 5  # the TOUCH went with the EXISTS, or on its own before
    while ops(emsd, "touch") < touches + 1:
        assert time.monotonic() < deadline, "no TOUCH reached the daemon"
        time.sleep(0.01)
    assert emsd.metric("emsd_lookup_keys_total", 'op="pin",result="hit"') >= BLOCKS
    _, body = emsd.http("/metrics")
    assert "\nemsd_shared_index_unpublished_total 0.0\n" in body.decode()  # every block had a slot


def test_the_daemon_counts_loads_and_exists_read_through_the_table_without_another_call(emsd: Any,
                                                                          monkeypatch: Any) -> None:
    cc, kv = connect(emsd, monkeypatch)
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    for _ in range(3):
        assert cc.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    assert cc.exists(KEYS).success == BLOCKS
    deadline = time.monotonic() + 5
    while (emsd.metric("emsd_lookup_keys_total", 'op="pin",result="hit"') < 3 * BLOCKS
           or emsd.metric("emsd_lookup_keys_total", 'op="exists",result="hit"') < BLOCKS):
        assert time.monotonic() < deadline, "the loads' touches never reached the daemon"
        time.sleep(0.01)
    assert ops(emsd, "pin") == 0 and ops(emsd, "exists") == 0


def test_a_load_that_is_not_all_in_the_table_asks_the_daemon(emsd: Any, monkeypatch: Any) -> None:
    cc, kv = connect(emsd, monkeypatch)
    fill(kv, 5.0)
    assert cc.save(SLOTS[: 4 * TOKENS], hashes=KEYS[:4], offsets=OFFSETS[:4]).success == 4
    pins = ops(emsd, "pin")
    fill(kv, 0.0)
    assert cc.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == 4  # leading hits, as before
    assert ops(emsd, "pin") == pins + 1
    assert bool((kv[0][0][:4] == 5.0).all()) and not kv[0][0][4:].any()


def test_dropped_blocks_are_not_found_through_the_table(emsd: Any, monkeypatch: Any) -> None:
    cc, kv = connect(emsd, monkeypatch)
    other, other_kv, other_client = connect_second(emsd)
    try:
        check_drop(emsd, cc, kv, other, other_kv)
    finally:
        other_client.close()


def check_drop(emsd: Any, cc: Any, kv: list[Any], other: Any, other_kv: list[Any]) -> None:
    fill(kv, 1.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    assert other.exists(KEYS).success == BLOCKS
    assert cc.clear() == BLOCKS
    for who, its_kv in ((cc, kv), (other, other_kv)):
        fill(its_kv, -1.0)
        assert who.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == 0
        assert who.exists(KEYS).success == 0
        assert values(its_kv) == {-1.0}  # nothing was read from the dropped blocks
    pins = ops(emsd, "pin")
    fill(kv, 2.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    fill(kv, 0.0)
    assert cc.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS and values(kv) == {2.0}
    assert ops(emsd, "pin") == pins, "the connection that dropped reads the table under the new id"


def test_evicted_blocks_are_not_found_through_the_table(emsd_factory: Any, monkeypatch: Any) -> None:
    d = emsd_factory(pool={"size": "16MiB", "page_size": "1MiB", "eviction": "lru"})
    cc, kv = connect(d, monkeypatch)
    fill(kv, 2.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    assert cc.exists(KEYS).success == BLOCKS
    for i in range(64):  # 64 x 8 blocks of 64 KiB: twice the pool
        fill(kv, 10.0 + i)
        cc.save(SLOTS, hashes=[10_000 + 8 * i + k for k in range(BLOCKS)], offsets=OFFSETS)
    fill(kv, -1.0)
    assert cc.exists(KEYS).success == 0
    assert cc.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == 0  # evicted, and their chunks reused
    assert values(kv) == {-1.0}


def test_touch_keeps_blocks_read_through_the_table_in_the_lru(emsd_factory: Any, monkeypatch: Any) -> None:
    d = emsd_factory(pool={"size": "16MiB", "page_size": "1MiB", "eviction": "lru"})
    cc, kv = connect(d, monkeypatch)
    fill(kv, 7.0)
    assert cc.save(SLOTS[:TOKENS], hashes=KEYS[:1], offsets=OFFSETS[:1]).success == 1
    for i in range(100):  # 100 x 7 blocks of 64 KiB: three times the pool, the hot block read between
        fill(kv, 0.0)
        assert cc.load(SLOTS[:TOKENS], hashes=KEYS[:1], offsets=OFFSETS[:1]).success == 1, f"evicted at {i}"
        assert bool((kv[0][0][0] == 7.0).all())
        fill(kv, 1.0)
        cc.save(SLOTS[TOKENS:], hashes=[20_000 + 8 * i + k for k in range(BLOCKS - 1)], offsets=OFFSETS[1:])
    assert ops(d, "pin") == 0  # every load read the table


def test_a_killed_daemon_s_table_is_not_trusted(emsd: Any, monkeypatch: Any) -> None:
    cc, kv = connect(emsd, monkeypatch)
    fill(kv, 4.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    client = Ems._client
    emsd.kill9()
    emsd.start()  # warm restart: the same pool, a new table; the old connection's table is stale
    fill(kv, 0.0)
    assert client.index is not None
    req_keys = KEYS
    try:
        got = cc.load(SLOTS, hashes=req_keys, offsets=OFFSETS).success
    except Exception as exc:  # the connection was lost: an error, never stale bytes
        assert "emsd" in str(exc) or "connection" in str(exc), exc
        got = 0
    assert got == 0 or values(kv) == {4.0}
    assert client.broken, "the dead daemon's connection is marked broken"
    assert cc.load(SLOTS, hashes=req_keys, offsets=OFFSETS).success == BLOCKS  # reconnected
    assert values(kv) == {4.0}


def test_clients_cannot_write_the_table(emsd: Any) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(emsd.socket_dir / "emsd.sock"))
    try:
        sock.sendall(b"".join(encode_parts({"v": PROTOCOL_VERSION, "id": 0, "op": int(Op.HELLO),
                                            "idx": True})))
        data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 2)
        try:
            assert len(fds) == 2, "the pool's fd, then the table's"
            size = FrameDecoder().feed(data)[0].header["idx"]
            with pytest.raises(PermissionError):
                mmap.mmap(fds[1], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fds[1], b"\0" * 64, 64)
            table = mmap.mmap(fds[1], size, mmap.MAP_SHARED, mmap.PROT_READ)  # reading is what it is for
            assert table[:8] == b"EMSIDX01"
            table.close()
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        sock.close()
    assert emsd.alive()


@pytest.mark.parametrize("overrides", [
    {"pool": {"shared_index": False}},
    {"pool": {"checksum": True}},
], ids=["off", "checksums"])
def test_where_the_table_is_not_offered_loads_ask_the_daemon(emsd_factory: Any, monkeypatch: Any,
                                                             overrides: dict[str, Any]) -> None:
    d = emsd_factory(**overrides)
    cc, kv = connect(d, monkeypatch)
    assert Ems._client.index is None
    fill(kv, 6.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    fill(kv, 0.0)
    assert cc.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    assert values(kv) == {6.0} and ops(d, "pin") == 1


def test_with_tenants_no_client_gets_the_table(emsd_factory: Any, tmp_path: Any) -> None:
    """The table shows every block's key: with tenants, that is other tenants' keys."""
    f = tmp_path / "tenants.toml"
    f.write_text(f'[[tenant]]\naccess_id = "team-a"\naccess_key = "{KEY}"\n')
    f.chmod(0o600)
    d = emsd_factory(tenants={"file": str(f)})
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({"access_id": "team-a", "access_key": KEY})
    try:
        assert client.index is None and "idx" not in client.info
    finally:
        client.close()


def test_the_sdk_can_be_told_not_to_use_it(emsd: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("EMS_SHARED_INDEX", "0")
    cc, kv = connect(emsd, monkeypatch)
    assert Ems._client.index is None
    assert cc.save(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    assert cc.load(SLOTS, hashes=KEYS, offsets=OFFSETS).success == BLOCKS
    assert ops(emsd, "pin") == 1


def test_a_malformed_touch_is_refused_and_the_daemon_stays_up(emsd: Any) -> None:
    client = DaemonClient(emsd.socket_dir / "emsd.sock")
    client.connect({})
    try:
        touch = TouchRequest(namespace_id(client, "t"), KeyBatch.from_user(KEYS))
        good, (raw,) = touch.encode()
        for fields, payload in ((good, raw[:-1]),
                                ({**good, "ns": touch.ns + 7}, raw),
                                ({**good, "kt": 9}, raw),
                                (good, raw + b"x"),
                                ({**good, "x": -1}, raw),
                                ({**good, "x": "many"}, raw)):
            with pytest.raises(Exception) as info:
                client.call(Op.TOUCH, fields, [payload], timeout=5)
            assert "INVALID" in repr(info.value) or "invalid" in str(info.value).lower(), info.value
        assert CountAnswer.decode(*called(client, Op.TOUCH, touch), BLOCKS).held == 0  # nothing stored
    finally:
        client.close()
    assert emsd.alive()
