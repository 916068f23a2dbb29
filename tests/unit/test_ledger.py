"""The ledger and BlockStore.attach: a rebuilt store has the same blocks in the same places."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool import nametable
from emsd.pool.keys import KeyBatch
from emsd.pool.ledger import FORMAT, HEADER, Geometry, Ledger, names_path
from emsd.pool.slab import SlabError
from emsd.pool.store import BlockStore, Status

POOL, PAGE = 4 << 20, 256 << 10


def geometry(store: BlockStore, ino: int = 7) -> Geometry:
    return Geometry(store.capacity, store.page_size, store.slabs.align, 1, ino)


def fresh(path: Path, ino: int = 7) -> tuple[BlockStore, Ledger, str]:
    store = BlockStore(POOL, PAGE)
    ledger, outcome = Ledger.open(path, geometry(store, ino))
    store.attach(ledger, set(ledger.names()))
    return store, ledger, outcome


def save(store: BlockStore, ns: int, keys: list[int | bytes], size: int, commit: bool = True) -> np.ndarray:
    res = store.reserve(ns, KeyBatch.from_user(keys), np.full(len(keys), size, np.uint64))
    new = res.handles[res.status == Status.NEW]
    if commit:
        store.commit(new)
    return new


def placed(store: BlockStore, ns: int, keys: list[int | bytes]) -> list[tuple[int, int]]:
    """(offset, length) of each key that is present, in order."""
    out = []
    for k in keys:
        p = store.pin(ns, KeyBatch.from_user([k]))
        out.extend(zip(p.offsets.tolist(), p.lengths.tolist(), strict=True))
        store.release(p.handles)
    return out


def test_a_store_rebuilt_from_its_ledger_has_the_committed_blocks_where_they_were(tmp_path: Path) -> None:
    store, ledger, outcome = fresh(tmp_path / "ledger")
    assert outcome == "new"
    for ns, name in ((0, "model-a"), (1, "model-b")):
        assert ledger.add_namespace(ns, name)
    save(store, 0, [1, 2, 3, b"x" * 32], 5000)
    save(store, 1, [1, 2], 70_000)
    save(store, 0, [9, 10], 5000, commit=False)  # PENDING at the "crash": never comes back
    store.discard(0, KeyBatch.from_user([2]))
    store.mark_cached(1, KeyBatch.from_user([2]))
    before = {ns: placed(store, ns, [1, 2, 3, b"x" * 32, 9, 10]) for ns in (0, 1)}
    ledger.close()

    again, ledger2, outcome = fresh(tmp_path / "ledger")
    assert outcome == "attached"
    assert ledger2.names() == {0: "model-a", 1: "model-b"}
    after = {ns: placed(again, ns, [1, 2, 3, b"x" * 32, 9, 10]) for ns in (0, 1)}
    assert after == before and len(after[0]) == 3 and len(after[1]) == 2
    assert again.stats().cached == 1 and again.stats().pending == 0
    # The restored allocator hands out only chunks nobody holds.
    new = save(again, 0, list(range(100, 140)), 5000)
    taken = {o for ns in (0, 1) for o, _ in after[ns]}
    fresh_offsets = placed(again, 0, list(range(100, 140)))
    assert len(new) == 40 and not taken & {o for o, _ in fresh_offsets}
    ledger2.close()


def test_forgotten_rows_one_or_many_no_longer_count_and_ids_past_the_rows_are_ignored(tmp_path: Path) -> None:
    store, ledger, _ = fresh(tmp_path / "ledger")
    ids = save(store, 0, [1, 2, 3, 4, 5], 1000)
    assert ledger.committed()[0].tolist() == ids.tolist()
    ledger.forget(ids[1:2])  # one row: a block evicted for one saved
    ledger.forget(ids[3:5])
    ledger.forget(np.array([ledger.rows.size + 5], dtype=np.uint32))  # never written: nothing to do
    ledger.forget(np.array([ledger.rows.size + 5, ledger.rows.size + 9], dtype=np.uint32))
    assert ledger.committed()[0].tolist() == [int(ids[0]), int(ids[2])]
    ledger.close()


_U32 = st.integers(0, (1 << 32) - 1)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, (1 << 64) - 1), st.lists(_U32, min_size=7,
                                                                                               max_size=7),
                               _U32, _U32, st.integers(0, 1), st.integers(0, (1 << 64) - 1)),
                     min_size=1, max_size=6))
def test_a_row_written_alone_is_the_row_the_batch_path_writes(tmp_path_factory: pytest.TempPathFactory,
                                                              rows: list[tuple]) -> None:
    """``record_one`` (the one-block commit's struct writes, from scalars) and ``record`` (the
    vectorised path) leave the same bytes in the mapped rows, whatever the fields, including a
    row past the file's capacity."""
    store = BlockStore(POOL, PAGE)
    files = tmp_path_factory.mktemp("rows")
    alone, _ = Ledger.open(files / "alone", geometry(store))
    batch, _ = Ledger.open(files / "batch", geometry(store))
    for i, w0, rest, offset, length, cached, digest in rows:
        fields = (np.array([w0], np.uint64), np.array([rest], np.uint32), np.array([offset], np.uint32),
                  np.array([length], np.uint32), np.array([cached], np.uint8))
        alone.record_one(i, w0, rest, offset, length, cached, digest)
        batch.record(np.array([i], np.uint32), *fields, np.array([digest], np.uint64))
    for i, *_ in rows:
        assert alone.rows[i].tobytes() == batch.rows[i].tobytes()
    assert set(alone.committed()[0].tolist()) == {r[0] for r in rows}
    alone.close()
    batch.close()


def test_another_pool_file_or_format_or_geometry_is_rebuilt_empty(tmp_path: Path) -> None:
    store, ledger, _ = fresh(tmp_path / "ledger")
    ledger.add_namespace(0, "m")
    save(store, 0, [1, 2], 4096)
    ledger.close()
    _, other, outcome = fresh(tmp_path / "ledger", ino=8)
    assert outcome.startswith("rebuilt: ") and "another pool file" in outcome
    assert other.committed()[0].size == 0
    other.close()
    raw = (tmp_path / "ledger").read_bytes()
    (tmp_path / "ledger").write_bytes(raw[:8] + struct.pack("<I", FORMAT + 1) + raw[12:])
    _, third, outcome = fresh(tmp_path / "ledger", ino=8)
    assert "format" in outcome
    third.close()
    (tmp_path / "ledger").write_bytes(b"garbage" * 10)
    _, fourth, outcome = fresh(tmp_path / "ledger", ino=8)
    assert outcome.startswith("rebuilt: ")
    fourth.close()
    small = BlockStore(POOL // 2, PAGE)
    ledger5, outcome = Ledger.open(tmp_path / "ledger", geometry(small, ino=8))
    assert "geometry" in outcome
    ledger5.close()


def test_rows_that_overlap_or_leave_the_pool_are_refused(tmp_path: Path) -> None:
    store, ledger, _ = fresh(tmp_path / "ledger")
    ledger.add_namespace(0, "m")
    handles = save(store, 0, [1, 2], 4096)
    ledger.rows["offset"][handles[1]] = ledger.rows["offset"][handles[0]]  # two blocks, one chunk
    ledger.close()
    store2 = BlockStore(POOL, PAGE)
    ledger2, outcome = Ledger.open(tmp_path / "ledger", geometry(store2))
    assert outcome == "attached"
    with pytest.raises(SlabError):
        store2.attach(ledger2, {0})
    ledger2.rows["offset"][handles[1]] = POOL  # now outside the pool
    with pytest.raises(SlabError):
        BlockStore(POOL, PAGE).attach(ledger2, {0})
    ledger2.close()


def test_blocks_of_a_namespace_without_a_name_are_not_restored(tmp_path: Path) -> None:
    store, ledger, _ = fresh(tmp_path / "ledger")
    assert not ledger.add_namespace(0, "")  # no name: nothing kept
    save(store, 0, [1], 4096)
    ledger.close()
    again, ledger2, _ = fresh(tmp_path / "ledger")
    assert len(again.index) == 0
    ledger2.close()


def test_namespace_ids_past_4096_and_long_names_survive_a_reopen(tmp_path: Path) -> None:
    """Format 2 kept 4,096 ids of names up to 254 bytes; the names log keeps any."""
    store, ledger, _ = fresh(tmp_path / "ledger")
    names = {0: "m", 4095: "x" * 254, 4096: "past-the-table", 70_000: "n" * 5000, 12: "ü" * 200}
    for ns, name in names.items():
        assert ledger.add_namespace(ns, name)
        save(store, ns, [ns, ns + 1], 4096)
    assert ledger.add_namespace(12, "renamed")  # the latest name of an id wins
    ledger.close()
    again, ledger2, outcome = fresh(tmp_path / "ledger")
    assert outcome == "attached"
    assert ledger2.names() == {**names, 12: "renamed"}
    for ns in names:
        assert again.exists(ns, KeyBatch.from_user([ns, ns + 1])) == 2
    ledger2.close()


def test_a_format_2_ledger_is_upgraded_in_place_and_keeps_its_blocks(tmp_path: Path) -> None:
    """What an older emsd left (names in the ledger's fixed table, no log) is attached, its
    names moved into the log, and the ledger written as format 3."""
    path = tmp_path / "ledger"
    store, ledger, _ = fresh(path)
    save(store, 3, [1, 2, 3], 4096)
    save(store, 9, [4], 60_000)
    ledger.close()
    raw = bytearray(path.read_bytes())  # as format 2 wrote it: names in the table, no epoch
    raw[8:12] = struct.pack("<I", 2)
    raw[64:72] = bytes(8)
    for ns, name in {3: "model-a", 9: "tenant:team-b/model-b"}.items():
        assert nametable.write_name(raw, HEADER, ns, name.encode())
    path.write_bytes(raw)
    names_path(path).unlink()

    again, ledger2, outcome = fresh(path)
    assert outcome == "attached"
    assert ledger2.names() == {3: "model-a", 9: "tenant:team-b/model-b"}
    assert again.exists(3, KeyBatch.from_user([1, 2, 3])) == 3
    assert again.exists(9, KeyBatch.from_user([4])) == 1
    assert struct.unpack_from("<I", path.read_bytes(), 8)[0] == FORMAT == 3
    ledger2.add_namespace(5000, "new")
    ledger2.close()
    _, ledger3, outcome = fresh(path)  # and as format 3 from now on
    assert outcome == "attached"
    assert ledger3.names() == {3: "model-a", 9: "tenant:team-b/model-b", 5000: "new"}
    ledger3.close()


def test_a_format_3_ledger_without_its_names_log_starts_empty_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    store, ledger, _ = fresh(path)
    ledger.add_namespace(0, "m")
    save(store, 0, [1], 4096)
    ledger.close()
    names_path(path).unlink()
    again, ledger2, outcome = fresh(path)
    assert outcome == "rebuilt: no namespace log"
    assert ledger2.names() == {} and len(again.index) == 0
    ledger2.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["save", "pending", "discard", "cache"]),
                          st.integers(0, 40), st.sampled_from([100, 4096, 5000, 60_000])),
                max_size=60))
def test_attach_restores_exactly_the_committed_blocks(tmp_path_factory: pytest.TempPathFactory,
                                                      ops: list[tuple[str, int, int]]) -> None:
    path = tmp_path_factory.mktemp("ledger") / "ledger"
    store, ledger, _ = fresh(path)
    ledger.add_namespace(0, "m")
    for op, key, size in ops:
        if op in ("save", "pending"):
            save(store, 0, [key], size, commit=op == "save")
        elif op == "discard":
            store.discard(0, KeyBatch.from_user([key]))
        else:
            store.mark_cached(0, KeyBatch.from_user([key]))
    before = placed(store, 0, list(range(41)))
    ledger.close()
    again, ledger2, _ = fresh(path)
    assert placed(again, 0, list(range(41))) == before
    assert again.stats().bytes_used == sum(-(-n // again.slabs.align) * again.slabs.align for _, n in before)
    ledger2.close()


def test_the_checksums_of_blocks_committed_one_at_a_time_or_together_come_back_after_a_reopen(
        tmp_path: Path) -> None:
    """A one-block commit writes its row from scalars (``Ledger.record_one``), a batch from arrays:
    both keep the block's checksum, which a store attached to the ledger again has back."""
    store, ledger, _ = fresh(tmp_path / "ledger")
    store.enable_checksums()
    ledger.add_namespace(0, "m")
    res = store.reserve(0, KeyBatch.from_user([1]), np.array([1000], np.uint64))  # one block
    store.seal(res.handles, np.array([0xABCDEF0123456789], np.uint64))
    store.commit(res.handles)
    two = store.reserve(0, KeyBatch.from_user([2, 3]), np.array([1000, 1000], np.uint64))  # a batch
    store.seal(two.handles, np.array([5, 6], np.uint64))
    store.commit(two.handles)
    ledger.close()
    again = BlockStore(POOL, PAGE)
    again.enable_checksums()
    ledger2, _ = Ledger.open(tmp_path / "ledger", geometry(again))
    again.attach(ledger2, set(ledger2.names()))
    for key, digest in ((1, 0xABCDEF0123456789), (2, 5), (3, 6)):
        pinned = again.pin(0, KeyBatch.from_user([key]))
        assert again.sums_of(pinned.handles).tolist() == [digest], key
        again.release(pinned.handles)
    ledger2.close()
