"""Tenants apart in memory: a client maps only its own tenant's blocks (emsd.pool.tenancy).

A client of one tenant (tests/scan_memory.py, a process of its own) reads
every readable byte of its own address space, its mapping of the pool
included, looking for a marker another tenant saved. Before tenant memory,
every client mapped the whole pool and found every copy. The same scan run
by a client of the marker's own tenant finds its blocks: the scan works.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402
from tenant_sdk import as_tenant  # noqa: E402

from ems import Ems  # noqa: E402

KEY_A = "A" * 43 + "="
KEY_B = "b" * 40 + "/+=="
BLOCK, BLOCKS = 4, 16
SLOTS = list(range(BLOCK * BLOCKS))
SCANNER = Path(__file__).resolve().parents[1] / "scan_memory.py"

pytestmark = pytest.mark.usefixtures("reset_sdk")


def tenants_file(where: Path, quota_b: str = "") -> Path:
    f = where / "tenants.toml"
    f.write_text(f'[[tenant]]\naccess_id = "team-a"\naccess_key = "{KEY_A}"\n\n'
                 f'[[tenant]]\naccess_id = "team-b"\naccess_key = "{KEY_B}"\n'
                 + (f'quota = "{quota_b}"\n' if quota_b else ""))
    f.chmod(0o600)
    return f


class Scanner:
    """A client process of one tenant, connected (its mapping live) until closed."""

    def __init__(self, d: Any, access_id: str, key: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.proc = subprocess.Popen([sys.executable, str(SCANNER), str(d.socket_dir), access_id, key],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self._answer()
        assert ready["saved"] == ready["loaded"] == 16, ready

    def hits(self, marker: bytes) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(marker.hex() + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        assert answer["mapped"] > 64 << 20  # the pool's mapping was read, and more
        return answer["hits"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the scanner exited with {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        """End the client (its mapping goes with it); closing twice is a no-op."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        code = self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        assert code == 0


@pytest.fixture
def scanners() -> Iterator[list[Scanner]]:
    made: list[Scanner] = []
    yield made
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
        with contextlib.suppress(AssertionError):
            s.close()


def marked_kv(marker: bytes, heads: int = 8) -> list[list[torch.Tensor]]:
    """One layer, K and V, ``BLOCKS`` blocks of ``BLOCK`` tokens, every byte from ``marker``."""
    tensors = []
    for _ in range(2):
        t = torch.empty((BLOCKS, BLOCK, heads, 32), dtype=torch.float32)
        raw = t.view(-1).view(torch.uint8)
        raw.copy_(torch.frombuffer(bytearray(marker * (raw.numel() // len(marker))), dtype=torch.uint8))
        tensors.append(t)
    return [tensors]


def save_marked(cc: Any, marker: bytes, first_key: int, rounds: int = 1, heads: int = 8) -> None:
    cc.register_kvcache(marked_kv(marker, heads))
    for r in range(rounds):
        keys = [first_key + r * BLOCKS + i for i in range(BLOCKS)]
        assert cc.save(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS).success == BLOCKS


def in_pool(hits: dict[str, int]) -> int:
    return sum(n for name, n in hits.items() if "memfd:emsd" in name)


def test_a_client_finds_no_byte_of_another_tenants_blocks_in_its_own_memory(
        emsd_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scanners: list[Scanner]) -> None:
    d = emsd_factory(tenants={"file": str(tenants_file(tmp_path))})
    marker = os.urandom(32)
    save_marked(as_tenant(d, "team-a", KEY_A, monkeypatch), marker, 500)

    b = Scanner(d, "team-b", KEY_B)
    scanners.append(b)
    assert b.hits(marker) == {}  # not in its mapping of the pool, nor anywhere else it can read
    a = Scanner(d, "team-a", KEY_A)  # the same scan by the marker's own tenant
    scanners.append(a)
    assert in_pool(a.hits(marker)) >= BLOCKS * 2 * 4096 // 32
    for s in (a, b):
        s.close()
    assert d.alive()


def test_memory_a_tenant_gave_up_is_never_seen_through_its_still_live_mapping(
        emsd_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scanners: list[Scanner]) -> None:
    """team-a's client keeps its mapping while team-b's saves take every page of the pool from
    team-a's blocks: the pages change hands, and team-a's client sees none of team-b's bytes."""
    d = emsd_factory(tenants={"file": str(tenants_file(tmp_path))}, pool={"page_size": "1MiB"})
    save_marked(as_tenant(d, "team-a", KEY_A, monkeypatch), os.urandom(32), 500, rounds=48, heads=64)
    a = Scanner(d, "team-a", KEY_A)
    scanners.append(a)
    marker = os.urandom(32)
    save_marked(as_tenant(d, "team-b", KEY_B, monkeypatch), marker, 10_000, rounds=120, heads=64)
    assert d.metric("emsd_pool_evictions_total", 'reason="page"') > 0  # pages taken from team-a
    assert a.hits(marker) == {}
    b = Scanner(d, "team-b", KEY_B)
    scanners.append(b)
    assert in_pool(b.hits(marker)) > 0
    for s in (a, b):
        s.close()
    assert d.alive()


@pytest.mark.skipif(zk.available() is not None, reason=str(zk.available()))
def test_in_a_cluster_no_node_maps_a_tenants_blocks_into_another_tenants_client(
        cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        scanners: list[Scanner]) -> None:
    """team-a saves through x (forwarded to their owners) and loads through y (read-cache
    copies): team-b's clients of either node find none of it; team-a's of y find it."""
    x, y = cluster(2, tenants={"file": str(tenants_file(tmp_path))})
    marker = os.urandom(32)
    save_marked(as_tenant(x, "team-a", KEY_A, monkeypatch), marker, 500)
    cc = as_tenant(y, "team-a", KEY_A, monkeypatch)
    cc.register_kvcache(marked_kv(b"\0" * 32))
    keys = [500 + i for i in range(BLOCKS)]
    assert cc.load(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    Ems._reset()
    del cc

    for n in (x, y):
        b = Scanner(n, "team-b", KEY_B)
        scanners.append(b)
        assert b.hits(marker) == {}
        b.close()
    a = Scanner(y, "team-a", KEY_A)
    scanners.append(a)
    assert in_pool(a.hits(marker)) >= BLOCKS * 2 * 4096 // 32  # y holds every block: owned or copied
    a.close()
    assert x.alive() and y.alive()


def test_each_tenants_blocks_survive_kill_9_in_its_own_memory(
        emsd_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scanners: list[Scanner]) -> None:
    """Warm restart with tenants: each tenant's memfd comes back from its keeper, its pages are
    mapped where the ledger says, and the blocks load with their bytes; still apart."""
    d = emsd_factory(tenants={"file": str(tenants_file(tmp_path))}, pool={"page_size": "1MiB"})
    marker_a, marker_b = os.urandom(32), os.urandom(32)
    save_marked(as_tenant(d, "team-a", KEY_A, monkeypatch), marker_a, 500, rounds=3, heads=64)
    save_marked(as_tenant(d, "team-b", KEY_B, monkeypatch), marker_b, 500, rounds=3, heads=64)
    Ems._reset()
    d.kill9()
    d.start()
    assert d.metric("emsd_warm_restart_restored_blocks") == 2 * 3 * BLOCKS
    for who, key, marker in (("team-a", KEY_A, marker_a), ("team-b", KEY_B, marker_b)):
        cc = as_tenant(d, who, key, monkeypatch)
        got = marked_kv(b"\0" * 32, 64)
        cc.register_kvcache(got)
        for r in range(3):
            keys = [500 + r * BLOCKS + i for i in range(BLOCKS)]
            assert cc.load(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS).success == BLOCKS
            assert all(bytes(t.view(-1).view(torch.uint8).numpy()) == bytes(marked_kv(marker, 64)[0][0]
                       .view(-1).view(torch.uint8).numpy()) for t in got[0])
    Ems._reset()
    b = Scanner(d, "team-b", KEY_B)
    scanners.append(b)
    assert b.hits(marker_a) == {}
    b.close()


def test_a_tenant_taken_out_of_the_file_loses_its_blocks_at_restart_and_no_one_gets_them(
        emsd_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scanners: list[Scanner]) -> None:
    tenants = tenants_file(tmp_path)
    d = emsd_factory(tenants={"file": str(tenants)}, pool={"page_size": "1MiB"})
    marker = os.urandom(32)
    save_marked(as_tenant(d, "team-b", KEY_B, monkeypatch), marker, 500, rounds=3, heads=64)
    Ems._reset()
    d.terminate()
    tenants.write_text(f'[[tenant]]\naccess_id = "team-a"\naccess_key = "{KEY_A}"\n')
    d.start()
    assert d.metric("emsd_warm_restart_restored_blocks") == 0
    assert "the blocks of 1 tenants are not restored" in d.log()
    keepers = list(Path(d.sections["pool"]["state_dir"]).glob("emsd-*-t????????????????.keeper"))
    assert len(keepers) == 1  # team-a's: team-b's keeper was let go
    a = Scanner(d, "team-a", KEY_A)
    scanners.append(a)
    assert a.hits(marker) == {}
    a.close()
