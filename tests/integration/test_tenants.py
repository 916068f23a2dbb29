"""Tenants: access keys checked, namespaces kept apart on the daemon and on its disk tier, quotas,
and SO_PEERCRED."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from ems import CcConfig, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.namespace import namespace_name
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import CountAnswer, ExistsRequest, NamespaceAnswer, NamespaceRequest
from emsd.transport.frames import PROTOCOL_VERSION, Op, Status
from tests.messages import Message, request

KEY_A = "A" * 43 + "="
KEY_B = "b" * 40 + "/+=="
BLOCK, BLOCKS = 4, 16
SLOTS, KEYS = list(range(BLOCK * BLOCKS)), [500 + i for i in range(BLOCKS)]


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    f = tmp_path / "tenants.toml"
    f.write_text(f'[[tenant]]\naccess_id = "team-a"\naccess_key = "{KEY_A}"\n\n'
                 f'[[tenant]]\naccess_id = "team-b"\naccess_key = "{KEY_B}"\nquota = "1MiB"\n')
    f.chmod(0o600)
    return f


@pytest.fixture
def daemon(emsd_factory: Any, tenants_file: Path) -> Any:
    return emsd_factory(tenants={"file": str(tenants_file)})


@pytest.fixture
def connect(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(daemon.socket_dir))

    def as_tenant(access_id: str | None, key: str | None) -> Any:
        Ems._reset()
        Ems.init(EmsConfig(access_id=access_id, access_key=key,
                           cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
        return Ems.get_cc()

    yield as_tenant
    Ems._reset()


def blocks(value: float) -> list[list[torch.Tensor]]:
    return [[torch.full((BLOCKS, BLOCK, 8, 32), value) for _ in range(2)]]  # 4 KiB a block per tensor


def test_a_wrong_key_an_unknown_tenant_and_no_tenant_are_refused(connect: Any) -> None:
    for access_id, key in (("team-a", KEY_B), ("team-x", KEY_A), (None, None)):
        with pytest.raises(EmsException) as err:
            connect(access_id, key)
        assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "tenant" in err.value.message()
    assert connect("team-a", KEY_A) is not None


def test_tenants_never_see_or_overwrite_each_others_blocks(connect: Any, daemon: Any) -> None:
    cc = connect("team-a", KEY_A)
    cc.register_kvcache(blocks(1.0))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS

    cc = connect("team-b", KEY_B)  # same model, same keys, another tenant
    cc.register_kvcache(blocks(2.0))
    assert cc.exists(KEYS).success == 0
    assert cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == 0
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS

    cc = connect("team-a", KEY_A)
    got = blocks(0.0)
    cc.register_kvcache(got)
    assert cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    assert bool((got[0][0] == 1.0).all())  # team-b's save did not touch team-a's blocks


def test_a_client_that_names_another_tenants_namespace_still_sees_only_its_own(connect: Any,
                                                                                daemon: Any) -> None:
    cc = connect("team-a", KEY_A)
    cc.register_kvcache(blocks(1.0))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    forged = namespace_name("team-a", CcConfig(rank_id=0, device_id=0, model_id="m"), "")
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(daemon.socket_dir / "emsd.sock"))
        assert _call(s, {"op": int(Op.HELLO), "access_id": "team-b", "access_key": KEY_B})[0]["st"] == 0
        ns = NamespaceAnswer.decode(*_sent(s, Op.NAMESPACE, NamespaceRequest(forged))).ns
        exists = ExistsRequest(ns, KeyBatch.from_user(KEYS))
        assert CountAnswer.decode(*_sent(s, Op.EXISTS, exists), BLOCKS).held == 0
        assert NamespaceAnswer.decode(*_sent(s, Op.NAMESPACE, NamespaceRequest("tenant:team-a/x"))).ns != ns


def test_a_quota_evicts_the_tenants_own_blocks_first_and_never_anothers(connect: Any, daemon: Any) -> None:
    cc = connect("team-a", KEY_A)
    cc.register_kvcache(blocks(1.0))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS

    cc = connect("team-b", KEY_B)  # 1 MiB quota; a batch is 16 blocks of 32 KiB = 512 KiB
    cc.register_kvcache([[torch.full((BLOCKS, BLOCK, 64, 32), 2.0) for _ in range(2)]])
    for round_ in range(4):  # 2 MiB saved in all: the oldest of team-b's own go
        keys = [10_000 * (round_ + 1) + i for i in range(BLOCKS)]
        assert cc.save(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    assert cc.exists([40_000 + i for i in range(BLOCKS)]).success == BLOCKS
    assert cc.exists([10_000 + i for i in range(BLOCKS)]).success == 0
    big = [[torch.full((BLOCKS, BLOCK, 512, 32), 3.0) for _ in range(2)]]  # 256 KiB a block: 4 MiB a batch
    cc.register_kvcache(big)
    res = cc.save(SLOTS, hashes=[90_000 + i for i in range(BLOCKS)], offsets=[BLOCK] * BLOCKS)
    assert 0 < res.success < BLOCKS  # what fits the quota, in order
    assert daemon.metric("emsd_pool_evictions_total", 'reason="quota"') > 0

    cc = connect("team-a", KEY_A)
    assert cc.exists(KEYS).success == BLOCKS  # untouched by team-b's quota


def test_a_world_readable_tenants_file_stops_the_daemon(emsd_factory: Any, tenants_file: Path) -> None:
    tenants_file.chmod(0o644)
    d = emsd_factory(start=False, tenants={"file": str(tenants_file)})
    with pytest.raises(RuntimeError, match="exited with 2"):
        d.start()
    assert "readable by the daemon's user only" in d.log()


def test_peers_outside_the_allowed_uids_and_gids_are_refused(emsd_factory: Any, monkeypatch: Any) -> None:
    other = emsd_factory(node={"allowed_uids": [os.getuid() + 4242], "allowed_gids": [os.getgid() + 4242]})
    monkeypatch.setenv("EMS_SOCKET_DIR", str(other.socket_dir))
    Ems._reset()
    with pytest.raises(EmsException) as err:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert "may not use this emsd" in err.value.message()
    mine = emsd_factory(node={"allowed_gids": [os.getgid()]})
    monkeypatch.setenv("EMS_SOCKET_DIR", str(mine.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert Ems.check_health()
    Ems._reset()
    assert other.alive()


def _call(s: socket.socket, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
    """One frame sent on ``s``: the answer's header and payload."""
    head = msgpack.packb({"v": PROTOCOL_VERSION, "id": 7, **header})
    s.sendall(struct.pack("<II", len(head), len(payload)) + head + payload)
    if header["op"] == Op.HELLO:
        data, fds, _, _ = socket.recv_fds(s, 65536, 1)
        for fd in fds:
            os.close(fd)
        return dict(msgpack.unpackb(data[8:])), b""
    hlen, plen = struct.unpack("<II", _exact(s, 8))
    answer = dict(msgpack.unpackb(_exact(s, hlen)))
    body = _exact(s, plen)
    assert answer["st"] in (Status.OK, Status.INVALID_ARGUMENT), answer
    return answer, body


def _sent(s: socket.socket, op: Op, message: Message) -> tuple[dict[str, Any], bytes]:
    """``message`` sent on ``s`` as a request of ``op``: the answer's header and payload."""
    return _call(s, *request(op, message))


def _exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "closed"
        buf += chunk
    return buf


def test_blocks_on_disk_stay_their_tenants(emsd_factory: Any, tenants_file: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's blocks moved to the disk tier load back for it, byte for byte, and another
    tenant with the same model and keys neither finds nor loads them."""
    base = Path(os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp"))
    disk = Path(tempfile.mkdtemp(prefix="emsd-disk-tenants-", dir=base))
    try:
        d = emsd_factory(tenants={"file": str(tenants_file)}, pool={"size": "16MiB", "page_size": "1MiB"},
                         disk={"dir": str(disk), "size": "256MiB", "extent": "4MiB"})
        monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))

        def as_tenant(access_id: str, key: str) -> Any:
            Ems._reset()
            Ems.init(EmsConfig(access_id=access_id, access_key=key,
                               cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
            return Ems.get_cc()

        def kv(value: float) -> list[list[torch.Tensor]]:
            return [[torch.full((BLOCKS, BLOCK, 64, 32), value) for _ in range(2)]]  # 64 KiB a block

        def batch(b: int) -> list[int]:
            return [b * 1000 + i for i in range(BLOCKS)]

        cc = as_tenant("team-a", KEY_A)
        for b in range(1, 41):  # 40 MiB through a 16 MiB pool: the first batches go to disk
            cc.register_kvcache(kv(float(b)))
            assert cc.save(SLOTS, hashes=batch(b), offsets=[BLOCK] * BLOCKS).success == BLOCKS
        assert d.disk_settled() >= BLOCKS
        assert cc.exists(batch(1)).success == BLOCKS  # on disk, counted

        cc = as_tenant("team-b", KEY_B)  # same model, same keys
        got = kv(-1.0)
        cc.register_kvcache(got)
        assert cc.exists(batch(1)).success == 0
        assert cc.load(SLOTS, hashes=batch(1), offsets=[BLOCK] * BLOCKS).success == 0
        assert bool((got[0][0] == -1.0).all()) and d.metric("emsd_disk_reads_total") == 0

        cc = as_tenant("team-a", KEY_A)
        got = kv(0.0)
        cc.register_kvcache(got)
        assert cc.load(SLOTS, hashes=batch(1), offsets=[BLOCK] * BLOCKS).success == BLOCKS
        assert all(bool((t == 1.0).all()) for t in got[0]) and d.metric("emsd_disk_reads_total") > 0
    finally:
        shutil.rmtree(disk, ignore_errors=True)
