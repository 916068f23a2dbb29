"""The compact index: exact keys, namespaces, probing, growth and removal."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import emsd.pool.index as index_mod
from emsd.pool.index import EMPTY, FREE, READY, BlockIndex, first_occurrences, nstag_of
from emsd.pool.keys import KeyBatch

# Keys that look alike: equal ints and bytes, trailing zeros, shared 8-byte prefixes.
ALIKE: list[int | bytes] = [
    0, 5, 2**64 - 1, -1 + 2**64 - 2, b"", b"\x05", b"\x05\x00", b"\x00" * 8, b"\x00" * 9,
    b"prefix-a", b"prefix-a1", b"prefix-a2", b"prefix-a1" + b"\x00" * 23, b"x" * 32, b"x" * 31,
]
KEYS = st.one_of(
    st.sampled_from(ALIKE),
    st.integers(0, 40),
    st.binary(max_size=32),
    st.builds(lambda i: b"block-%08d" % i, st.integers(0, 40)),
)


def batch(keys: list[int | bytes]) -> KeyBatch:
    return KeyBatch.from_user(keys)


def insert(idx: BlockIndex, ns: int, keys: list[int | bytes], stamp: int = 1) -> np.ndarray:
    n = len(keys)
    ids, _ = idx.insert(ns, batch(keys), np.arange(n, dtype=np.uint32),
                        np.full(n, 7, dtype=np.uint32), READY, stamp)
    return ids


@pytest.fixture
def weak_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hash with four values: every key collides, probing gets long."""

    def weak(words: np.ndarray, nstag: np.ndarray) -> np.ndarray:
        return (words[:, 0] & np.uint64(3)) << np.uint64(62)

    monkeypatch.setattr(index_mod, "hash_keys", weak)


def test_lookup_finds_inserted_keys_and_misses_others() -> None:
    idx = BlockIndex()
    ids = insert(idx, 0, [1, 2, b"abc"])
    assert idx.lookup(0, batch([2, b"abc", 3, 1])).tolist() == [ids[1], ids[2], -1, ids[0]]
    assert len(idx) == 3


def test_int_and_bytes_that_look_alike_are_different_keys() -> None:
    idx = BlockIndex()
    ids = insert(idx, 0, [5, b"\x05", b"\x05\x00", b"a", b"a\x00"])
    assert len(set(ids.tolist())) == 5
    assert idx.lookup(0, batch([5, b"\x05", b"\x05\x00", b"a", b"a\x00"])).tolist() == ids.tolist()


def test_same_key_in_two_namespaces_is_two_entries() -> None:
    idx = BlockIndex()
    a, b = insert(idx, 0, [42])[0], insert(idx, 1, [42])[0]
    assert a != b
    assert idx.lookup(0, batch([42])).tolist() == [a]
    assert idx.lookup(1, batch([42])).tolist() == [b]
    assert idx.lookup(2, batch([42])).tolist() == [-1]
    assert idx.ns_of(np.array([a, b])).tolist() == [0, 1]


def test_duplicates_in_a_batch_make_one_entry() -> None:
    idx = BlockIndex()
    n = 4
    ids, created = idx.insert(0, batch([9, 8, 9, 9]), np.arange(n, dtype=np.uint32),
                              np.zeros(n, dtype=np.uint32), READY, 1)
    assert created.tolist() == [True, True, False, False]
    assert ids[0] == ids[2] == ids[3] and ids[0] != ids[1]
    assert idx.offset[ids[0]] == 0  # the first occurrence's fields
    assert len(idx) == 2


def test_insert_keeps_an_existing_entry() -> None:
    idx = BlockIndex()
    first = insert(idx, 0, [1], stamp=5)
    again = insert(idx, 0, [1, 2], stamp=9)
    assert again[0] == first[0] and idx.last_used[first[0]] == 5


def test_remove_frees_the_entry_and_its_id_is_reused() -> None:
    idx = BlockIndex()
    ids = insert(idx, 0, [1, 2, 3])
    idx.remove(ids[1:2])
    assert idx.lookup(0, batch([1, 2, 3])).tolist() == [ids[0], -1, ids[2]]
    assert idx.state[ids[1]] == FREE
    assert insert(idx, 0, [4])[0] == ids[1]
    with pytest.raises(ValueError, match="not live"):
        idx.remove(ids[1:2] + 100)


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.integers(0, 1 << 40), min_size=1, max_size=40, unique=True),
       gone=st.data())
def test_one_key_inserts_take_and_fill_ids_as_a_batch_insert_does(keys: list[int],
                                                                   gone: st.DataObject) -> None:
    """``insert_new`` of one key (a scalar path) takes the id a batch would (freed ids, most
    recent first) and writes the same entry."""
    one, many = BlockIndex(), BlockIndex()
    first = insert(one, 1, keys)
    assert insert(many, 1, keys).tolist() == first.tolist()
    drop = gone.draw(st.lists(st.sampled_from(first.tolist()), unique=True))
    for idx in (one, many):
        idx.remove(np.array(drop, dtype=np.uint32))
    new = [(1 << 41) + k for k in keys[: len(drop) + 2]]
    singles = [int(one.insert_new(1, batch([k]), np.array([7]), np.array([64]), READY, 3)[0]) for k in new]
    assert singles == [int(many._take_ids(1)[0]) for _ in new]  # the batch path's choice of ids
    for k, i in zip(new, singles, strict=True):
        assert one.lookup(1, batch([k])).tolist() == [i]
        entry = (int(one.offset[i]), int(one.length[i]), int(one.state[i]), int(one.last_used[i]))
        assert entry == (7, 64, READY, 3)


def test_growth_keeps_every_entry() -> None:
    idx = BlockIndex()
    keys = list(range(5000))
    ids = np.concatenate([insert(idx, 3, keys[i : i + 700]) for i in range(0, 5000, 700)])
    assert idx.capacity >= 5002 and idx.home_size >= 2 * 5000
    assert (idx.lookup(3, batch(keys)) == ids).all()
    assert idx.keys_of(ids[:3]).words[:, 0].tolist() == [0, 1, 2]


def test_find_with_prefix_resolves_the_keys_up_to_the_first_miss() -> None:
    idx = BlockIndex()
    ids = insert(idx, 0, [1, 2, 3, 5])
    got = idx.find(0, batch([1, 2, 3, 4, 5]), prefix=True)
    assert got[:4].tolist() == [ids[0], ids[1], ids[2], EMPTY]


def test_namespace_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="namespace"):
        nstag_of(1 << 24, np.zeros(1, dtype=np.uint8))


def test_long_collision_chains_stay_exact(weak_hash: None) -> None:
    idx = BlockIndex()
    keys: list[int | bytes] = [*range(300), *(b"k%d" % i for i in range(300))]
    ids = insert(idx, 0, keys)
    assert (idx.lookup(0, batch(keys)) == ids).all()
    assert (idx.lookup(0, batch(list(range(300, 600)))) == -1).all()
    assert idx.find(0, batch([*range(10), 999, 5]), prefix=True)[:11].tolist() == [
        *ids[:10].tolist(), EMPTY]
    idx.remove(ids[::2])
    assert (idx.lookup(0, batch(keys[1::2])) == ids[1::2]).all()
    assert (idx.lookup(0, batch(keys[::2])) == -1).all()


def test_keys_crowding_the_end_of_the_table_grow_its_tail(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "hash_keys",
                        lambda w, n: np.full(len(n), 2**64 - 1, dtype=np.uint64))
    idx = BlockIndex()
    keys = list(range(200))
    ids = np.concatenate([insert(idx, 0, keys[:150]), insert(idx, 0, keys[150:])])
    assert (idx.lookup(0, batch(keys)) == ids).all()
    assert idx.lookup(0, batch([500])).tolist() == [-1]
    idx.remove(ids[:100])
    assert (idx.lookup(0, batch(keys[100:])) == ids[100:]).all()


@given(st.lists(KEYS, max_size=40))
@settings(max_examples=100, deadline=None)
def test_first_occurrences_marks_each_distinct_key_once(keys: list[int | bytes]) -> None:
    mask = first_occurrences(batch(keys)) if keys else np.zeros(0, dtype=bool)
    seen: set[tuple[str, int | bytes]] = set()
    expected = []
    for k in keys:
        norm = ("i", k % 2**64) if isinstance(k, int) else ("b", k)
        expected.append(norm not in seen)
        seen.add(norm)
    assert mask.tolist() == expected


class IndexModel(RuleBasedStateMachine):
    """Random inserts, removes and lookups against a dict."""

    weak = False

    def __init__(self) -> None:
        super().__init__()
        self.idx = BlockIndex()
        self.model: dict[tuple[int, str, int | bytes], int] = {}
        self.held: dict[int, tuple[int, int]] = {}  # detached id -> (offset, length) it kept

    @staticmethod
    def norm(ns: int, k: int | bytes) -> tuple[int, str, int | bytes]:
        return (ns, "i", k % 2**64) if isinstance(k, int) else (ns, "b", k)

    @rule(ns=st.integers(0, 2), keys=st.lists(KEYS, min_size=1, max_size=30))
    def insert(self, ns: int, keys: list[int | bytes]) -> None:
        ids = insert(self.idx, ns, keys)
        for k, i in zip(keys, ids.tolist(), strict=True):
            assert self.model.setdefault(self.norm(ns, k), i) == i

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if not self.model:
            return
        gone = data.draw(st.lists(st.sampled_from(sorted(self.model, key=repr)), unique=True,
                                  max_size=20))
        self.idx.remove(np.array([self.model.pop(g) for g in gone], dtype=np.uint32))

    @rule(data=st.data())
    def detach(self, data: st.DataObject) -> None:
        """A detached entry's key is gone (and may come back as a new entry); its id and
        fields stay until it is released, and no insert takes the id meanwhile."""
        if not self.model:
            return
        i = self.model.pop(data.draw(st.sampled_from(sorted(self.model, key=repr))))
        self.idx.detach(i)
        self.held[i] = (int(self.idx.offset[i]), int(self.idx.length[i]))
        with pytest.raises(ValueError):
            self.idx.remove(np.array([i], dtype=np.uint32))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.held:
            return
        i = data.draw(st.sampled_from(sorted(self.held)))
        assert (int(self.idx.offset[i]), int(self.idx.length[i])) == self.held.pop(i)
        self.idx.release(i)
        with pytest.raises(ValueError):
            self.idx.release(i)

    @rule(ns=st.integers(0, 2), keys=st.lists(KEYS, min_size=1, max_size=60),
          prefix=st.booleans())
    def lookup(self, ns: int, keys: list[int | bytes], prefix: bool) -> None:
        expected = [self.model.get(self.norm(ns, k), EMPTY) for k in keys]
        got = self.idx.find(ns, batch(keys), prefix=prefix).tolist()
        if prefix:
            stop = expected.index(EMPTY) + 1 if EMPTY in expected else len(keys)
            got, expected = got[:stop], expected[:stop]
        assert got == expected

    @invariant()
    def counts_match(self) -> None:
        assert len(self.idx) == len(self.model)
        assert sorted(self.idx.live_ids().tolist()) == sorted(self.model.values())
        assert not set(self.held) & set(self.model.values())  # a held id is never handed out
        assert 2 * len(self.idx) <= self.idx.home_size


IndexModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestIndexModel = IndexModel.TestCase


class WeakHashIndexModel(IndexModel):
    def __init__(self) -> None:
        self._saved = index_mod.hash_keys
        index_mod.hash_keys = lambda w, n: (w[:, 0] & np.uint64(3)) << np.uint64(62)
        super().__init__()

    def teardown(self) -> None:
        index_mod.hash_keys = self._saved


WeakHashIndexModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                                deadline=None)
TestWeakHashIndexModel = WeakHashIndexModel.TestCase
