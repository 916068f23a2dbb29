"""DiskTier (emsd.tier.disk) over real files in a real directory: demote, read back, restart,
corruption, room, quotas, drops and failure. /tmp must be a file system with O_DIRECT (not tmpfs)
for the direct path; elsewhere the tier falls back to buffered I/O and these still hold."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.keys import KeyBatch
from emsd.tier.disk import DATA_FILE, DiskTier, worth_demoting
from emsd.tier.engine import aligned, runs

EXTENT = 1 << 20
BLOCK = 64 << 10


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on a real file system (/var/tmp: tmpfs would refuse O_DIRECT)."""
    base = os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="emsd-disk-test-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _pool(blocks: list[bytes]) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
    """A page-aligned 'pool' holding ``blocks`` back to back in 64 KiB chunks."""
    mm = aligned(len(blocks) * BLOCK)
    for i, b in enumerate(blocks):
        mm[i * BLOCK : i * BLOCK + len(b)] = b
    return (mm, np.arange(len(blocks), dtype=np.uint64) * BLOCK,
            np.array([len(b) for b in blocks], dtype=np.uint64))


def _bytes(i: int, n: int = BLOCK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def _read(tier: DiskTier, name: str, keys: KeyBatch) -> list[bytes | None]:
    out: list[bytes | None] = []
    for e in tier.checkout(name, keys):
        if e is None:
            out.append(None)
            continue
        buf = aligned(max(e.length, 4096))
        ok = tier.read(e, memoryview(buf)[: e.length], 0)
        out.append(bytes(buf[: e.length]) if ok else None)
        buf.close()
    return out


def test_demoted_blocks_read_back_identical_also_after_a_restart(disk_dir: Path) -> None:
    blocks = [_bytes(i) for i in range(6)] + [_bytes(99, 5000)]  # one not a multiple of 4 KiB
    keys = KeyBatch.from_user(list(range(7)))
    tier = DiskTier(disk_dir, 8 * EXTENT, extent=EXTENT)
    assert tier.outcome == "new"
    pool, offs, lens = _pool(blocks)
    assert tier.demote("ns", keys, memoryview(pool), offs, lens) == 7
    assert tier.wait_idle(30)
    assert tier.present("ns", keys).all() and not tier.present("other", keys).any()
    assert _read(tier, "ns", keys) == blocks
    tier.close()
    tier = DiskTier(disk_dir, 8 * EXTENT, extent=EXTENT)
    assert tier.outcome == "attached" and tier.restored == 7
    assert _read(tier, "ns", keys) == blocks
    tier.close()


def test_bytes_changed_on_disk_are_a_miss_and_the_block_goes(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT)
    keys = KeyBatch.from_user([1, 2])
    pool, offs, lens = _pool([_bytes(1), _bytes(2)])
    tier.demote("ns", keys, memoryview(pool), offs, lens)
    assert tier.wait_idle(30)
    victim = tier.checkout("ns", keys.take(slice(0, 1)))[0]
    assert victim is not None
    tier.checkin(victim)
    with open(disk_dir / DATA_FILE, "r+b") as f:  # a torn or stale slot, as after a power loss
        f.seek(victim.offset + 100)
        f.write(b"\xff" * 8)
    assert _read(tier, "ns", keys) == [None, _bytes(2)]
    assert tier.corrupt == 1 and tier.present("ns", keys).tolist() == [False, True]
    tier.close()


def test_a_full_queue_drops_demotions_and_never_waits(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 4 * EXTENT, queue_bytes=2 * BLOCK, writers=1, extent=EXTENT)
    keys = KeyBatch.from_user(list(range(8)))
    pool, offs, lens = _pool([_bytes(i) for i in range(8)])
    queued = tier.demote("ns", keys, memoryview(pool), offs, lens)
    assert queued < 8 and tier.dropped["queue"] == 8 - queued
    assert tier.wait_idle(30)
    tier.close()


def test_a_full_tier_evicts_its_least_recent_blocks(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 2 * EXTENT, extent=EXTENT)  # room for 32 blocks of 64 KiB
    for start in range(0, 48, 8):
        keys = KeyBatch.from_user(list(range(start, start + 8)))
        pool, offs, lens = _pool([_bytes(i) for i in range(start, start + 8)])
        tier.demote("ns", keys, memoryview(pool), offs, lens)
        assert tier.wait_idle(30)
    present = tier.present("ns", KeyBatch.from_user(list(range(48))))
    assert present.sum() == 32 and present[16:].all() and tier.evicted == 16
    tier.close()


def test_a_tenant_stays_within_its_quota_on_disk(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT,
                    quota=lambda name: 4 * BLOCK if name.startswith("a/") else None,
                    tenant=lambda name: name.split("/")[0])
    keys = KeyBatch.from_user(list(range(10)))
    pool, offs, lens = _pool([_bytes(i) for i in range(10)])
    tier.demote("a/x", keys, memoryview(pool), offs, lens)
    tier.demote("b/x", keys, memoryview(pool), offs, lens)
    assert tier.wait_idle(30)
    assert tier.present("a/x", keys).sum() == 4 and tier.tenant_bytes("a") == 4 * BLOCK
    assert tier.present("b/x", keys).all()
    tier.close()


def test_drop_removes_a_namespace_also_across_a_restart(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT)
    keys = KeyBatch.from_user([1, 2, 3])
    pool, offs, lens = _pool([_bytes(i) for i in range(3)])
    tier.demote("a", keys, memoryview(pool), offs, lens)
    tier.demote("b", keys, memoryview(pool), offs, lens)
    assert tier.wait_idle(30)
    assert tier.drop("a") == 3 and not tier.present("a", keys).any()
    tier.close()
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT)
    assert not tier.present("a", keys).any() and tier.present("b", keys).all()
    tier.close()


def test_an_io_error_fails_the_tier_and_it_serves_nothing(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT)
    keys = KeyBatch.from_user([1, 2])
    pool, offs, lens = _pool([_bytes(1), _bytes(2)])
    ro = os.open(disk_dir / DATA_FILE, os.O_RDONLY)
    os.close(tier.data.fd)
    tier.data.fd = ro  # writes now fail with EBADF, as a device gone read-only would
    tier.demote("ns", keys.take(slice(0, 1)), memoryview(pool), offs[:1], lens[:1])
    assert tier.wait_idle(30)
    assert tier.failed and tier.check() == tier.failed
    assert tier.demote("ns", keys, memoryview(pool), offs, lens) == 0
    assert not tier.present("ns", keys).any() and tier.checkout("ns", keys) == [None, None]
    tier.close()


def test_direct_io_on_a_real_file_system_and_right_bytes_on_tmpfs(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 2 * EXTENT, extent=EXTENT)
    assert tier.data.direct, tier.data.reason  # /var/tmp here is ext4
    tier.close()
    shm = Path(tempfile.mkdtemp(prefix="emsd-disk-test-", dir="/dev/shm"))
    try:
        tier = DiskTier(shm, 2 * EXTENT, extent=EXTENT)
        # tmpfs takes O_DIRECT from Linux 6.6 on; before, the tier falls back to buffered I/O
        assert tier.data.direct or "O_DIRECT" in tier.data.reason
        keys = KeyBatch.from_user([7])
        pool, offs, lens = _pool([_bytes(7)])
        tier.demote("ns", keys, memoryview(pool), offs, lens)
        assert tier.wait_idle(30) and _read(tier, "ns", keys) == [_bytes(7)]
        tier.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_removed_data_file_is_noticed(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 2 * EXTENT, extent=EXTENT)
    assert tier.check() == ""
    (disk_dir / DATA_FILE).unlink()
    assert "removed" in tier.check()
    tier.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lru", "page", "quota", "dropped", "corrupt", "moved"]),
                          st.booleans())))
def test_only_owned_blocks_evicted_for_room_are_demoted(cases: list[tuple[str, bool]]) -> None:
    for reason, cached in cases:
        assert worth_demoting(reason, cached) == (reason in ("lru", "page") and not cached)


def test_adjacent_blocks_read_in_one_run_and_a_bad_one_is_a_miss_alone(disk_dir: Path) -> None:
    tier = DiskTier(disk_dir, 4 * EXTENT, writers=1, extent=EXTENT)
    blocks = [_bytes(i) for i in range(8)]
    keys = KeyBatch.from_user(list(range(8)))
    pool, offs, lens = _pool(blocks)
    tier.demote("ns", keys, memoryview(pool), offs, lens)
    assert tier.wait_idle(30)
    entries = tier.checkout("ns", keys)
    assert all(e is not None for e in entries)
    at = [e.offset for e in entries if e is not None]
    assert at == [at[0] + i * BLOCK for i in range(8)]  # demoted in order: slots in order
    spans = runs(at, [BLOCK] * 8, [i * BLOCK for i in range(8)], tier.data.direct)
    assert spans == ([list(range(8))] if tier.data.direct else [[i] for i in range(8)])
    for e in entries:
        assert e is not None
        tier.checkin(e)
    with open(disk_dir / DATA_FILE, "r+b") as f:  # block 5's bytes go bad on disk
        f.seek(at[5] + 7)
        f.write(b"\x00" * 8)
    entries = tier.checkout("ns", keys)
    dest = aligned(8 * BLOCK)
    view = memoryview(dest)
    ok = tier.read_run([e for e in entries if e is not None],
                       [view[i * BLOCK : (i + 1) * BLOCK] for i in range(8)], [i * BLOCK for i in range(8)])
    assert ok == [i != 5 for i in range(8)]
    assert [bytes(view[i * BLOCK : (i + 1) * BLOCK]) for i in range(8) if i != 5] == blocks[:5] + blocks[6:]
    assert tier.corrupt == 1 and tier.present("ns", keys).tolist() == [i != 5 for i in range(8)]
    assert all(tier._index.pins[e.id] == 0 for e in entries if e is not None)  # every READING ended
    assert tier.stats().blocks == 7 and tier.space.bytes_used == 7 * BLOCK  # the bad block's slot freed
    view.release()
    dest.close()
    tier.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.one_of(st.integers(0, (1 << 64) - 1), st.binary(min_size=1, max_size=32)),
                min_size=1, max_size=12, unique=True))
def test_keys_on_disk_gives_back_the_keys_demoted(keys: list[int | bytes]) -> None:
    """What a drain reads back: every demoted key, int or bytes, in its canonical form."""
    base = os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="emsd-disk-test-", dir=base))
    try:
        tier = DiskTier(path, 8 * EXTENT, extent=EXTENT)
        batch = KeyBatch.from_user(keys)
        pool, offs, lens = _pool([_bytes(i, 4096) for i in range(len(keys))])
        assert tier.demote("ns", batch, memoryview(pool), offs, lens) == len(keys)
        assert tier.wait_idle(30)
        got = tier.keys_on_disk()
        assert list(got) == ["ns"]
        def canonical(b: KeyBatch) -> list[tuple[list[int], int]]:
            return sorted(zip(b.words.tolist(), b.tags.tolist(), strict=True))

        assert canonical(got["ns"]) == canonical(batch)
        tier.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _held_writes(tier: DiskTier) -> threading.Event:
    """Hold ``tier``'s writer threads until the returned event is set (demotions stay queued)."""
    go = threading.Event()
    write = tier._write

    def held(*args: Any) -> None:
        go.wait(30)
        write(*args)

    tier._write = held  # type: ignore[method-assign,assignment]
    return go


def test_a_block_queued_for_writing_is_found_copied_and_dropped_with_its_namespace(disk_dir: Path) -> None:
    """Until its write ends a demoted block is present and copied from its staging buffer; a
    drop meanwhile removes it, and its write is skipped."""
    tier = DiskTier(disk_dir, 8 * EXTENT, extent=EXTENT)
    go = _held_writes(tier)
    blocks = [_bytes(i) for i in range(3)]
    pool, offs, lens = _pool(blocks)
    keys = KeyBatch.from_user([1, 2, 3])
    assert tier.demote("ns", keys, memoryview(pool), offs, lens) == 3
    assert tier.present("ns", keys).all() and tier.queued == 3
    assert tier.staged_lengths("ns", keys) == [BLOCK] * 3
    assert sorted(tier.keys_on_disk()["ns"].words[:, 0].tolist()) == [1, 2, 3]
    dests = [memoryview(bytearray(BLOCK)) for _ in range(2)]
    assert tier.copy_staged("ns", keys.take(slice(0, 2)), dests) == [True, True]
    assert [bytes(d) for d in dests] == blocks[:2]
    wrong_size = [memoryview(bytearray(10))]
    assert tier.copy_staged("ns", keys.take(slice(0, 1)), wrong_size) == [False]
    assert tier.drop("ns") == 3
    assert not tier.present("ns", keys).any()
    go.set()
    assert tier.wait_idle(30)
    assert not tier.present("ns", keys).any() and tier.stats().blocks == 0  # the writes were skipped
    assert tier.demote("ns", keys, memoryview(pool), offs, lens) == 3  # queued afresh, then written
    assert tier.wait_idle(30)
    assert tier.staged_lengths("ns", keys) == [None] * 3 and _read(tier, "ns", keys) == blocks
    tier.close()


def test_discard_removes_those_blocks_only_queued_or_written_and_across_a_restart(disk_dir: Path) -> None:
    """A handoff's forgetting of blocks that now live on another node: written blocks go (also
    after a restart), a queued one's write is skipped, other keys and namespaces stay."""
    tier = DiskTier(disk_dir, 8 * EXTENT, extent=EXTENT)
    blocks = [_bytes(i) for i in range(4)]
    pool, offs, lens = _pool(blocks)
    keys = KeyBatch.from_user([1, 2, 3, 4])
    tier.demote("ns", keys.take(slice(0, 3)), memoryview(pool), offs[:3], lens[:3])
    tier.demote("other", keys, memoryview(pool), offs, lens)
    assert tier.wait_idle(30)
    go = _held_writes(tier)
    assert tier.demote("ns", keys.take(slice(3, 4)), memoryview(pool), offs[3:], lens[3:]) == 1  # queued
    assert tier.discard("ns", KeyBatch.from_user([2, 4, 99])) == 2
    assert tier.discard("nobody", keys) == 0
    assert tier.present("ns", keys).tolist() == [True, False, True, False]
    go.set()
    assert tier.wait_idle(30)
    assert tier.present("ns", keys).tolist() == [True, False, True, False]  # 4's write was skipped
    tier.close()
    tier = DiskTier(disk_dir, 8 * EXTENT, extent=EXTENT)
    assert tier.present("ns", keys).tolist() == [True, False, True, False]
    assert tier.present("other", keys).all() and _read(tier, "ns", keys.take(slice(0, 1))) == blocks[:1]
    tier.close()


def test_a_tenant_at_its_quota_evicts_its_own_least_recent_block(disk_dir: Path) -> None:
    """The quota's eviction takes the tenant's oldest unused block, never another tenant's
    older ones, and only as many as the new block needs."""
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT,
                    quota=lambda name: 4 * BLOCK if name.startswith("a/") else None,
                    tenant=lambda name: name.split("/")[0])
    keys = KeyBatch.from_user(list(range(5)))
    pool, offs, lens = _pool([_bytes(i) for i in range(5)])
    assert tier.demote("b/x", keys, memoryview(pool), offs, lens) == 5  # older than all of a's
    assert tier.wait_idle(30)
    for i in range(4):
        one = slice(i, i + 1)
        assert tier.demote("a/x", keys.take(one), memoryview(pool), offs[one], lens[one]) == 1
        assert tier.wait_idle(30)
    assert _read(tier, "a/x", keys.take(slice(0, 1))) == [_bytes(0)]  # 0 is used: 1 is a's oldest now
    assert tier.demote("a/x", keys.take(slice(4, 5)), memoryview(pool), offs[4:], lens[4:]) == 1
    assert tier.wait_idle(30)
    assert tier.present("a/x", keys).tolist() == [True, False, True, True, True]
    assert tier.present("b/x", keys).all() and tier.tenant_bytes("a") == 4 * BLOCK
    assert tier.stats().evicted == 1
    tier.close()


def _held_disk_writes(tier: DiskTier) -> threading.Event:
    """Hold the data file's writes until the returned event is set: the blocks taken by a
    writer are then indexed, not yet READY, and still queued (being written)."""
    go = threading.Event()
    write = tier.data.write

    def held(offset: int, buf: memoryview) -> None:
        go.wait(30)
        write(offset, buf)

    tier.data.write = held  # type: ignore[method-assign]
    return go


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["demote", "discard", "drop", "read", "hold"]),
                          st.sampled_from(["a/x", "a/y", "b/x"]), st.lists(st.integers(0, 11), max_size=6)),
                min_size=1, max_size=12))
def test_keys_on_disk_are_the_keys_present_in_every_state(steps: list[tuple[str, str, list[int]]]) -> None:
    """Whatever was demoted, discarded, dropped, read, evicted for a tenant's quota, or held
    mid-write: ``keys_on_disk`` names each key ``present`` finds, once, and no other; a drop
    removes every block ``present`` found of its namespace, and says how many; and each
    tenant's LRU order is the index's."""
    base = os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="emsd-disk-test-", dir=base))
    tier = DiskTier(path, 8 * EXTENT, extent=EXTENT,
                    quota=lambda name: 6 * 4096 if name.startswith("a/") else None,
                    tenant=lambda name: name.split("/")[0])
    go: threading.Event | None = None
    pool, offs, lens = _pool([_bytes(i, 4096) for i in range(12)])
    try:
        for op, name, picks in steps:
            keys = KeyBatch.from_user(sorted(set(picks)))
            sel = np.array(sorted(set(picks)), dtype=np.int64)
            if op == "demote":
                tier.demote(name, keys, memoryview(pool), offs[sel], lens[sel])
            elif op == "discard":
                tier.discard(name, keys)
            elif op == "drop":
                held = int(tier.present(name, KeyBatch.from_user(list(range(12)))).sum())
                assert tier.drop(name) == held
                assert not tier.present(name, KeyBatch.from_user(list(range(12)))).any()
            elif op == "read" and go is None:
                _read(tier, name, keys)
            elif op == "hold" and go is None:
                go = _held_disk_writes(tier)
            if go is None:
                assert tier.wait_idle(30)
            everything = KeyBatch.from_user(list(range(12)))
            with tier._lock:  # one snapshot: a held step's writers may evict meanwhile (the quota)
                listed = tier.keys_on_disk()
                for ns in ("a/x", "a/y", "b/x"):
                    got = listed.get(ns, KeyBatch.from_user([]))
                    named = sorted(got.words[:, 0].tolist())
                    assert len(named) == len(set(named))
                    assert named == np.flatnonzero(tier.present(ns, everything)).tolist()
                every = list(tier._lru.oldest(0))  # every indexed entry, oldest first
                assert sorted(every) == tier._index.live_ids().tolist()
                for t, lst in tier._tenant_list.items():  # each tenant's: the same order, its own only
                    ns_of = tier._index.ns_of(np.array(every, dtype=np.uint32)).tolist()
                    assert list(tier._by_tenant.oldest(lst)) == [
                        i for i, ns in zip(every, ns_of, strict=True) if tier._tenant_of(ns) == t]
    finally:
        if go is not None:
            go.set()
        tier.wait_idle(30)
        tier.close()
        shutil.rmtree(path, ignore_errors=True)


def test_a_drop_counts_and_removes_blocks_being_written_once(disk_dir: Path) -> None:
    """Blocks a writer has taken (indexed, not READY, still queued) go with their namespace,
    counted once each; their writes end without putting them back. Other namespaces stay."""
    tier = DiskTier(disk_dir, 8 * EXTENT, extent=EXTENT, writers=4)
    blocks = [_bytes(i) for i in range(3)]
    pool, offs, lens = _pool(blocks)
    keys = KeyBatch.from_user([1, 2, 3])
    assert tier.demote("other", keys, memoryview(pool), offs, lens) == 3
    assert tier.wait_idle(30)
    go = _held_disk_writes(tier)
    assert tier.demote("ns", keys, memoryview(pool), offs, lens) == 3
    deadline = time.monotonic() + 30
    while len(tier._index) < 6 and time.monotonic() < deadline:  # the writers took all three
        time.sleep(0.01)
    assert len(tier._index) == 6 and tier.present("ns", keys).all()
    assert tier.drop("ns") == 3
    assert not tier.present("ns", keys).any()
    go.set()
    assert tier.wait_idle(30)
    assert not tier.present("ns", keys).any() and "ns" not in tier.keys_on_disk()
    assert tier.stats().blocks == 3 and _read(tier, "other", keys) == blocks
    tier.close()


def test_a_restart_restores_each_tenants_bytes_and_its_own_eviction_order(disk_dir: Path) -> None:
    """Re-indexed from the ledger's rows (read as columns): every block, each tenant's bytes,
    and a quota's eviction after the restart takes that tenant's blocks only."""
    def open_tier() -> DiskTier:
        return DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT,
                        quota=lambda name: 3 * BLOCK if name.startswith("a/") else None,
                        tenant=lambda name: name.split("/")[0])

    tier = open_tier()
    keys = KeyBatch.from_user([7, b"k", 2**64 - 1])
    blocks = [_bytes(i) for i in range(3)]
    pool, offs, lens = _pool(blocks)
    assert tier.demote("a/x", keys, memoryview(pool), offs, lens) == 3
    assert tier.demote("b/y", keys, memoryview(pool), offs, lens) == 3
    assert tier.wait_idle(30)
    tier.close()
    tier = open_tier()
    assert tier.restored == 6
    assert (tier.tenant_bytes("a"), tier.tenant_bytes("b")) == (3 * BLOCK, 3 * BLOCK)
    assert _read(tier, "a/x", keys) == blocks and _read(tier, "b/y", keys) == blocks
    more, *_ = _pool([_bytes(9)])
    assert tier.demote("a/x", KeyBatch.from_user([9]), memoryview(more), offs[:1], lens[:1]) == 1
    assert tier.wait_idle(30)
    assert tier.present("a/x", KeyBatch.from_user([9])).all() and tier.present("b/y", keys).all()
    assert int(tier.present("a/x", keys).sum()) == 2 and tier.tenant_bytes("a") == 3 * BLOCK
    tier.close()


def test_a_restart_keeps_the_first_of_rows_that_clash_and_forgets_the_others(disk_dir: Path) -> None:
    """Ledger rows that cannot all hold (a second row of a key, a row on a slot another row
    holds, a row of a namespace with no name): the restart keeps each block's first row,
    forgets the rest for good, and the blocks it kept read back right and can be evicted."""
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT)
    keys = KeyBatch.from_user([1, 2, 3])
    blocks = [_bytes(i) for i in range(3)]
    pool, offs, lens = _pool(blocks)
    assert tier.demote("ns", keys, memoryview(pool), offs, lens) == 3
    assert tier.wait_idle(30)
    ids, rows = tier.ledger.committed()
    first = rows[0]
    other = KeyBatch.from_user([99])
    free_slot = 3 * EXTENT  # an extent nothing uses
    tier.ledger.record(40, first["words"], first["tag"], first["ns"], free_slot, BLOCK, first["sum"])
    tier.ledger.record(41, other.words[0].astype("<u8"), other.tags[0], first["ns"], rows[1]["offset"],
                       BLOCK, first["sum"])
    tier.ledger.record(42, other.words[0].astype("<u8"), other.tags[0], 77, free_slot + BLOCK, BLOCK,
                       first["sum"])
    tier.ledger.flush()
    tier.close()
    for _ in range(2):  # and again: the forgotten rows stay forgotten
        tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT)
        assert tier.restored == 3 and tier.space.bytes_used == 3 * BLOCK
        assert sorted(tier.ledger.committed()[0].tolist()) == sorted(ids.tolist())
        assert _read(tier, "ns", keys) == blocks and not tier.present("ns", other).any()
        tier.close()
    tier = DiskTier(disk_dir, 4 * EXTENT, extent=EXTENT)
    fresh = [_bytes(10 + i) for i in range(64)]
    more, moffs, mlens = _pool(fresh)
    assert tier.demote("ns", KeyBatch.from_user(list(range(100, 164))), memoryview(more), moffs, mlens) == 64
    assert tier.wait_idle(30)
    stats = tier.stats()  # 4 MiB of 64 KiB slots: 64 blocks, the oldest evicted for room
    assert stats.blocks == 64 and stats.evicted == 3 and not tier.present("ns", keys).any()
    tier.close()
