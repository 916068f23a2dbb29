"""The owner's side of a peer's requests, on the Service alone (no sockets): blocks that arrive
from peers go through ``reserve_arriving``/``commit_arrived``/``abort_arriving`` and leave
through ``pin_to_lend``, as the transports call them (``emsd.transport.owner.BlockOwner``).
Requests are built and read through ``emsd.protocol.peer`` as a ``PeerServer`` reads them."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from emsd.effects import Promote
from emsd.metrics import Metrics
from emsd.pool.checksum import Checksums
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore, Reservation
from emsd.pool.store import Status as SlotStatus
from emsd.protocol.local import PinAnswer, PinRequest
from emsd.protocol.peer import DropRequest, Encoded, GetRequest, HasRequest, PutRequest
from emsd.service import PEER_PROMOTE_BUDGET, Service
from emsd.tenants import Tenant, Tenants
from emsd.transport.frames import Op, Status
from emsd.transport.owner import BlockOwner
from tests.messages import handled, opened

POOL, PAGE = 16 << 20, 4 << 20
BLOCK = 256 << 10
QUOTA = 1 << 20  # four blocks
MINE, THEIRS = "tenant:team-b/kv", "kv"  # team-b's namespace (with the quota), the default tenant's
NEW, FAILED = int(SlotStatus.NEW), int(SlotStatus.FAILED)


def _service(checksums: bool = False) -> tuple[Service, memoryview]:
    store = BlockStore(POOL, PAGE)
    svc = Service(store, "owner", "test", Metrics(), Tenants([Tenant("team-b", "k" * 32, quota=QUOTA)]))
    pool = memoryview(bytearray(POOL))
    if checksums:
        svc.checksums = Checksums(store, pool)
    return svc, pool


def _served(encoded: Encoded) -> tuple[dict[str, Any], bytes]:
    """A request's frame as the server receives it: header and payload."""
    header, parts = encoded
    return header, b"".join(parts)


def _reserve_put(owner: BlockOwner, name: str, keys: list[int]) -> Reservation:
    """The owner's reservation for a peer's PUT of ``keys`` (BLOCK bytes each) to ``name``."""
    sent = PutRequest(name, KeyBatch.from_user(keys), np.full(len(keys), BLOCK, np.uint64))
    req = PutRequest.decode(*_served(sent.encode()))
    return owner.reserve_arriving(owner.namespace_id(req.ns), req.keys, req.lengths, copy=False)


def _put(owner: BlockOwner, pool: memoryview, name: str, keys: list[int], fill: int = 7) -> np.ndarray:
    """A peer's PUT served: reserve, the bytes written, commit; the reservation's statuses."""
    res = _reserve_put(owner, name, keys)
    new = res.status == NEW
    for off in res.offsets[new].tolist():
        pool[off : off + BLOCK] = bytes([fill]) * BLOCK
    owner.commit_arrived(res.handles[new])
    return res.status


def _lent(owner: BlockOwner, name: str, keys: list[int]) -> int:
    """How many leading ``keys`` a peer's GET gets (pinned, then released)."""
    req = GetRequest.decode(*_served(GetRequest(name, KeyBatch.from_user(keys)).encode()))
    pinned = owner.pin_to_lend(owner.namespace_id(req.ns), req.keys)
    owner.release_lent(pinned.handles)
    return pinned.count


def _has(owner: BlockOwner, name: str, keys: list[int]) -> int:
    req = HasRequest.decode(*_served(HasRequest(name, KeyBatch.from_user(keys)).encode()))
    return owner.present_count(owner.namespace_id(req.ns), req.keys)


def test_a_tenant_over_its_quota_saving_through_a_peer_evicts_only_its_own_blocks() -> None:
    svc, pool = _service()
    assert not _put(svc, pool, THEIRS, list(range(100, 106))).any()  # another tenant: 6 blocks
    assert not _put(svc, pool, MINE, [1, 2]).any()  # team-b: half its quota
    status = _put(svc, pool, MINE, [10, 11, 12, 13, 14])  # five more: one over, after evicting 1, 2
    assert status.tolist() == [NEW] * 4 + [FAILED]
    assert _has(svc, MINE, [10, 11, 12, 13, 14]) == 4
    assert _has(svc, MINE, [1]) == 0 and _has(svc, MINE, [2]) == 0  # its own, evicted for room
    assert _has(svc, THEIRS, list(range(100, 106))) == 6  # nobody else's
    assert svc.store.ns_bytes(svc.namespace_id(MINE)) == QUOTA
    assert svc.store.stats().pending == 0


def test_blocks_arriving_side_by_side_cannot_each_fill_the_quota_and_an_abort_ends_the_hold() -> None:
    svc, pool = _service()
    first = _reserve_put(svc, MINE, [1, 2, 3, 4])  # the whole quota, still arriving
    assert first.status.tolist() == [NEW] * 4
    assert _reserve_put(svc, MINE, [5]).status.tolist() == [FAILED]  # held: no room, nothing to evict
    assert svc.abort_arriving(first.handles) == 4
    second = _reserve_put(svc, MINE, [5, 6, 7, 8])  # the hold ended with the abort
    assert second.status.tolist() == [NEW] * 4
    svc.abort_arriving(second.handles)
    assert svc.store.stats().pending == 0 and _has(svc, MINE, [1, 5]) == 0


def test_a_commit_from_a_peer_seals_checksums_that_a_later_pin_verifies() -> None:
    svc, pool = _service(checksums=True)
    assert not _put(svc, pool, THEIRS, [1, 2, 3]).any()
    assert _lent(svc, THEIRS, [1, 2, 3]) == 3  # sealed: every block verifies
    s, ns = opened(svc, THEIRS)  # a local client's PIN sees the same seals
    resp, payload = handled(svc, s, Op.PIN, PinRequest(ns, KeyBatch.from_user([1, 2, 3])))
    assert resp["st"] == Status.OK
    pinned = PinAnswer.decode(resp, payload, 3)
    assert len(pinned.handles) == 3
    svc.store.release(pinned.handles)
    off = int(pinned.offsets[1])
    pool[off] ^= 0xFF  # block 2 changes after its commit
    assert _lent(svc, THEIRS, [1, 2, 3]) == 1  # cut before it
    assert svc.checksums is not None and svc.checksums.mismatches == 1


def test_a_peer_get_plans_a_promotion_from_the_disk_tier_and_has_counts_the_disk() -> None:
    svc, pool = _service()
    _put(svc, pool, THEIRS, [1])
    keys = KeyBatch.from_user([1, 2, 3])
    ns = svc.namespace_id(THEIRS)
    assert svc.peer_promotion(ns, keys) is None  # no disk tier
    asked: list[int] = []
    svc.tiers = SimpleNamespace(  # a disk tier holding keys 2 and 3
        wanted=lambda _ns, _keys, count: asked.append(count) or count < 3,
        exists=lambda _ns, _keys, count: 3)
    promote = svc.peer_promotion(ns, keys)
    assert isinstance(promote, Promote) and asked == [1]
    assert (promote.ns, promote.count, promote.budget, promote.fetch) == (ns, 1, PEER_PROMOTE_BUDGET, False)
    assert promote.keys is keys
    assert _has(svc, THEIRS, [1, 2, 3]) == 3


def test_what_the_owner_serves_peers_is_counted_apart_from_its_own_clients() -> None:
    svc, pool = _service()
    keys = svc.metrics.requests.keys
    assert _put(svc, pool, MINE, [1, 2, 3, 4, 5]).tolist() == [NEW] * 4 + [FAILED]
    assert svc.metrics.requests.bytes["peer_put"] == 4 * BLOCK and svc.metrics.requests.save_failed == 1
    assert _lent(svc, MINE, [1, 2, 9]) == 2
    assert (keys["peer_get", "hit"], keys["peer_get", "miss"]) == (2, 1)
    assert svc.metrics.requests.bytes["peer_get"] == 2 * BLOCK
    assert _has(svc, MINE, [1, 7]) == 1 and (keys["peer_has", "hit"], keys["peer_has", "miss"]) == (1, 1)
    fetched = svc.reserve_arriving(svc.namespace_id(MINE), KeyBatch.from_user([8]), np.full(1, 1, np.uint64),
                                   copy=True)  # a copy this node fetched for its own client
    svc.abort_arriving(fetched.handles)
    assert svc.metrics.requests.bytes["peer_put"] == 4 * BLOCK and ("pin", "hit") not in keys


def test_a_peer_drop_goes_through_the_services_namespace_table() -> None:
    svc, pool = _service()
    _put(svc, pool, THEIRS, [1, 2])
    old = svc.namespace_id(THEIRS)
    req = DropRequest.decode(*_served(DropRequest(THEIRS).encode()))
    assert svc.drop_namespace(req.ns) == 2
    assert svc.retired(old) and svc.namespace_id(THEIRS) != old
    assert _has(svc, THEIRS, [1]) == 0


def test_the_peer_transports_reach_blocks_only_through_their_block_owner() -> None:
    """No store, quota, checksum or tier in the peer transports: what a peer stores or is lent
    passes the Service's checks (a second path around them is how a tenant over its quota once
    evicted other tenants' blocks through another node)."""
    root = Path(__file__).resolve().parents[2] / "emsd" / "transport"
    for module in ("peer.py", "rdma.py", "owner.py"):
        tree = ast.parse((root / module).read_text())
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert not used & {"store", "checksums", "tiers", "fit_quota", "hold_quota", "quota"}, module
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & {"emsd.service", "emsd.tenants", "emsd.pool.checksum",
                               "emsd.tier.stack"}, module
