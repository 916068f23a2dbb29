"""Attacks of one tenant on the others, against a real daemon with a tenants file (issue 25).

Raw protocol clients (``ems.client.DaemonClient``) play a hostile tenant
that never commits, grants itself chunks, opens namespace after namespace
or reads STATS and /metrics for other tenants' names, next to a victim
tenant whose committed blocks are checked byte for byte afterwards.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ems.client import DaemonClient
from emsd.transport.frames import Op

KEY_A = "A" * 43 + "="  # the attacker, team-a: a 4 MiB quota
KEY_B = "b" * 40 + "/+=="  # the victim, team-b: no quota
BLOCK = 512 << 10
QUOTA = 4 << 20
POOL = 64 << 20


def fill(key: int) -> bytes:
    """The victim's block for ``key``: bytes derived from the key, to prove nothing changed them."""
    seed = int.from_bytes(hashlib.blake2b(struct.pack("<Q", key), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


class Tenant:
    """One raw connection of a tenant, with one namespace opened."""

    def __init__(self, sock: Path, access_id: str | None, key: str | None, name: str | None = "m") -> None:
        self.client = DaemonClient(sock)
        self.client.connect({} if access_id is None else {"access_id": access_id, "access_key": key})
        self.ns = -1 if name is None else self.open(name)

    def open(self, name: str) -> int:
        return int(self.call(Op.NAMESPACE, {"name": name})[0]["ns"])

    def call(self, op: Op, fields: dict[str, Any], *payload: bytes) -> tuple[dict[str, Any], bytes]:
        return self.client.call(op, fields, list(payload), timeout=10)

    def reserve(self, keys: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """RESERVE ``keys`` of BLOCK bytes: (offsets, handles, status) per key."""
        n = len(keys)
        _, p = self.call(Op.RESERVE, {"ns": self.ns, "n": n, "kt": 0}, struct.pack(f"<{n}Q", *keys),
                         struct.pack(f"<{n}Q", *[BLOCK] * n))
        return (np.frombuffer(p, "<u8", n), np.frombuffer(p, "<u4", n, 8 * n),
                np.frombuffer(p, np.uint8, n, 12 * n))

    def save(self, keys: list[int]) -> int:
        """Reserve, write ``fill(key)``, commit; how many blocks were stored."""
        offsets, handles, status = self.reserve(keys)
        pool = self.client.pool_array
        assert pool is not None
        new = [(k, o, h) for k, o, h, st in zip(keys, offsets.tolist(), handles.tolist(), status.tolist(),
                                                strict=True) if st == 0]
        for key, off, _ in new:
            pool[off : off + BLOCK] = np.frombuffer(fill(key), np.uint8)
        hs = [h for _, _, h in new]
        self.call(Op.COMMIT, {"c": len(hs), "a": 0}, struct.pack(f"<{len(hs)}I", *hs))
        return len(new)

    def intact(self, keys: list[int]) -> int:
        """How many of ``keys`` are present with their exact bytes (pinned, compared, released)."""
        good = 0
        pool = self.client.pool_array
        assert pool is not None
        for key in keys:
            h, p = self.call(Op.PIN, {"ns": self.ns, "n": 1, "kt": 0}, struct.pack("<Q", key))
            if h["count"] == 1:
                off, length, handle = struct.unpack("<QQI", p)
                good += length == BLOCK and bytes(pool[off : off + length]) == fill(key)
                self.call(Op.RELEASE, {}, struct.pack("<I", handle))
        return good

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    f = tmp_path / "tenants.toml"
    f.write_text(f'[[tenant]]\naccess_id = "team-a"\naccess_key = "{KEY_A}"\nquota = {QUOTA}\n\n'
                 f'[[tenant]]\naccess_id = "team-b"\naccess_key = "{KEY_B}"\n')
    f.chmod(0o600)
    return f


@pytest.fixture
def daemon(emsd_factory: Any, tenants_file: Path) -> Any:
    return emsd_factory(tenants={"file": str(tenants_file), "allow_default": True})


@pytest.fixture
def opened() -> Iterator[list[Tenant]]:
    """Connections a test opens (closed at the end)."""
    conns: list[Tenant] = []
    yield conns
    for c in conns:
        c.close()


def connect(daemon: Any, opened: list[Tenant], access_id: str | None, key: str | None,
            name: str | None = "m") -> Tenant:
    t = Tenant(daemon.socket_dir / "emsd.sock", access_id, key, name)
    opened.append(t)
    return t


# -- item 3: uncommitted reservations and grants count against the quota ---------------------


def test_uncommitted_reservations_cannot_take_the_pool_past_the_quota(
        daemon: Any, opened: list[Tenant]) -> None:
    """The attack: a 4 MiB-quota tenant reserves 128 x 512 KiB on four connections and never
    commits. Before the fix it took the whole 64 MiB pool, evicting the victim's blocks."""
    victim = connect(daemon, opened, "team-b", KEY_B)
    kept = list(range(40))  # 20 MiB
    assert victim.save(kept) == len(kept)
    reserved = 0
    for c in range(4):
        attacker = connect(daemon, opened, "team-a", KEY_A)
        for batch in range(4):
            keys = [10_000 * c + 8 * batch + i for i in range(8)]
            reserved += int((attacker.reserve(keys)[2] == 0).sum())
    assert reserved * BLOCK <= QUOTA  # pending bytes count against the quota
    assert victim.intact(kept) == len(kept)  # no block of the victim lost or changed
    more = list(range(100, 140))  # another 20 MiB: the pool has room for the victim's saves
    assert victim.save(more) == len(more)
    assert victim.intact(kept + more) == len(kept + more)
    assert daemon.metric("emsd_pool_evictions_total", 'reason="lru"') == 0
    assert daemon.alive()


def test_grants_count_against_the_quota_and_come_back_on_close(daemon: Any, opened: list[Tenant]) -> None:
    """Granted chunks held uncommitted fill the quota: a RESERVE past it fails; when the
    connections close, the tenant's whole quota is its own again."""
    holders = [connect(daemon, opened, "team-a", KEY_A) for _ in range(8)]
    granted = 0
    for h in holders:
        granted += int(h.call(Op.GRANT, {"size": BLOCK, "k": 64})[0]["k"])
    assert 0 < granted * BLOCK <= QUOTA
    _, _, status = holders[0].reserve(list(range(8)))  # 4 MiB more: over the quota
    assert int((status == 0).sum()) * BLOCK + granted * BLOCK <= QUOTA
    for h in holders:
        h.close()
    opened.clear()
    fresh = connect(daemon, opened, "team-a", KEY_A)
    assert fresh.save(list(range(100, 108))) == QUOTA // BLOCK  # all 4 MiB: nothing left counted
    assert daemon.alive()


def test_commits_move_bytes_from_uncommitted_to_committed_without_leaking(
        daemon: Any, opened: list[Tenant]) -> None:
    """Reserve/commit and reserve/abort cycles leave no uncommitted bytes behind: the tenant
    keeps saving up to its quota (its own old blocks evicted), never past it."""
    a = connect(daemon, opened, "team-a", KEY_A)
    for round_ in range(6):  # 6 x 4 MiB through a 4 MiB quota
        _, handles, status = a.reserve([1000 + 8 * round_ + i for i in range(4)])
        hs = handles[status == 0].tolist()
        assert len(hs) == 4
        a.call(Op.COMMIT, {"c": 0, "a": len(hs)}, struct.pack(f"<{len(hs)}I", *hs))  # abort
        assert a.save([8 * round_ + i for i in range(8)]) == 8  # the whole quota: nothing left held
    assert a.intact(list(range(40, 48))) == 8  # the last round is all there
    assert daemon.metric("emsd_pool_evictions_total", 'reason="quota"') > 0


def test_one_connection_holds_at_most_its_share_uncommitted(emsd_factory: Any, opened: list[Tenant]) -> None:
    """Without tenants (no quota), one connection that reserves the whole pool without
    committing gets pool.connection_uncommitted (default half the pool); another client's
    committed blocks stay."""
    d = emsd_factory()
    victim = connect(d, opened, None, None)
    kept = list(range(40))  # 20 MiB
    assert victim.save(kept) == len(kept)
    hog = connect(d, opened, None, None, name="hog")
    got = sum(int((hog.reserve([10_000 + 8 * b + i for i in range(8)])[2] == 0).sum()) for b in range(16))
    assert got * BLOCK == POOL // 2
    assert victim.intact(kept) == len(kept)
    assert d.alive()


# -- item 8: other tenants' namespace names do not leak ----------------------------------------


SECRET = "secret-model-7b-finetune-for-customer-x"


def test_stats_and_metrics_do_not_show_a_tenant_the_names_of_anothers(
        daemon: Any, opened: list[Tenant]) -> None:
    owner = connect(daemon, opened, "team-a", KEY_A, name=SECRET)
    assert owner.save([1, 2]) == 2
    snoop = connect(daemon, opened, "team-b", KEY_B, name="mine")
    seen = snoop.call(Op.STATS, {})[0]
    assert seen["namespace_names"] == ["tenant:team-b/mine"] and seen["namespaces"] == 1
    default = connect(daemon, opened, None, None, name="plain")  # allow_default: a tenant like the others
    assert default.call(Op.STATS, {})[0]["namespace_names"] == ["plain"]
    assert owner.call(Op.STATS, {})[0]["namespace_names"] == [f"tenant:team-a/{SECRET}"]  # its own
    status, body = daemon.http("/metrics")
    assert status == 200 and SECRET.encode() not in body
    assert daemon.metric("emsd_pool_tenant_bytes", 'tenant="team-a"') == 2 * BLOCK
    assert daemon.alive()


def test_namespace_labels_are_the_operators_choice(emsd_factory: Any, opened: list[Tenant]) -> None:
    d = emsd_factory(metrics={"namespace_labels": True})
    c = connect(d, opened, None, None, name=SECRET)
    assert c.save([1]) == 1
    assert d.metric("emsd_pool_namespace_bytes", f'namespace="{SECRET}"') == BLOCK
    assert c.call(Op.STATS, {})[0]["namespace_names"] == [SECRET]  # no tenants file: everything


# -- item 9: namespaces are capped per tenant and unused ones are freed -----------------------


def long_name(i: int) -> str:
    return f"{i:06d}-" + "n" * 4089  # 4 KiB: longer than format-2 ledgers kept


@pytest.fixture
def capped(emsd_factory: Any, tenants_file: Path) -> Any:
    return emsd_factory(tenants={"file": str(tenants_file), "allow_default": True, "max_namespaces": 64})


def refused(t: Tenant, name: str) -> bool:
    from ems import EmsErrorCode, EmsException

    try:
        t.open(name)
    except EmsException as exc:
        assert exc.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "tenants.max_namespaces" in exc.message()
        return True
    return False


def test_namespace_flood_is_capped_per_tenant_and_unused_ones_are_freed(
        capped: Any, opened: list[Tenant]) -> None:
    """The attack: connections of one tenant open namespace after namespace with 4 KiB names,
    reconnecting for more. The tenant gets at most tenants.max_namespaces at once; ids of
    unused ones are reused, so the daemon's table stays bounded; the warning is said once;
    another tenant opens and saves as before."""
    victim = connect(capped, opened, "team-b", KEY_B)
    kept = list(range(8))
    assert victim.save(kept) == len(kept)
    ids: set[int] = set()
    for round_ in range(5):
        flood = connect(capped, opened, "team-a", KEY_A, name=long_name(100_000 * round_))
        ids.add(flood.ns)
        for i in range(1, 64):
            ids.add(flood.open(long_name(100_000 * round_ + i)))
        assert refused(flood, long_name(100_000 * round_ + 64))  # 64 open: at the cap
        other = connect(capped, opened, "team-a", KEY_A, name=None)
        assert refused(other, "m")  # the cap is the tenant's, not the connection's
        other.close()
        opened.remove(other)
        flood.close()
        opened.remove(flood)
    assert len(ids) <= 64 + 1  # 5 x 64 names opened, the ids of unused namespaces reused
    more = victim.open("still-mine")  # the other tenant is not capped by team-a's flood
    assert more >= 0 and victim.save(list(range(100, 104))) == 4
    assert victim.intact(kept) == len(kept)
    assert capped.log().count("will not survive a restart") <= 2  # once a minute, not per name
    assert capped.alive()


def test_a_namespace_with_blocks_is_not_freed_and_survives_a_warm_restart(
        capped: Any, opened: list[Tenant]) -> None:
    """Freed ids are reused by other names; the blocks of a namespace that holds some stay
    with their name, also across a warm restart."""
    keeper = connect(capped, opened, "team-a", KEY_A, name="keep")
    assert keeper.save([1, 2, 3]) == 3
    keeper.close()
    opened.remove(keeper)
    for round_ in range(3):  # fill the cap with unused names, again and again
        c = connect(capped, opened, "team-a", KEY_A, name=f"r{round_}-0")
        for i in range(1, 64):
            if refused(c, f"r{round_}-{i}"):
                break
        c.close()
        opened.remove(c)
    long = connect(capped, opened, "team-a", KEY_A, name=long_name(7))  # takes a freed id of r1-*
    assert long.save([1, 2, 3]) == 3  # a 4 KiB name: kept by the ledger's names log
    capped.terminate()
    capped.start()
    assert "warm restart: attached; 6 blocks restored" in capped.log()
    assert "dropped namespaces evicted" not in capped.log()
    for name in ("keep", long_name(7)):
        assert connect(capped, opened, "team-a", KEY_A, name=name).intact([1, 2, 3]) == 3
    for name in ("r2-5", "r1-0", "r1-1"):  # names whose ids were freed and reused
        assert connect(capped, opened, "team-a", KEY_A, name=name).intact([1, 2, 3]) == 0
