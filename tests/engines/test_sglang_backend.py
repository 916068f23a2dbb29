"""EmsdHiCacheStorage built by SGLang's own storage factory, on a fake host pool, against a real emsd.

Runs where SGLang's HiCache modules import (``scripts/test-engines.sh``
builds that venv); skipped elsewhere. SGLang's real host pools import its
multimodal stack (torchvision, CUDA kernels), so ``FakeHostPool`` copies
the geometry and the methods the backend and the cache controller use from
``MHATokenToKVPoolHost`` (SGLang 0.5.23, ``layer_first`` and
``page_first`` layouts), and ``FakeMLAHostPool`` those of
``MLATokenToKVPoolHost``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="SGLang tests need torch (scripts/setup-engines.sh)")
pytest.importorskip("sglang.srt.mem_cache.storage",
                    reason="SGLang is not installed here (scripts/setup-engines.sh installs it)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from ems.integrations.sglang import EmsdHiCacheStorage  # noqa: E402

PAGE = 4


class FakeHostPool:
    """The parts of SGLang's ``MHATokenToKVPoolHost`` a storage backend touches."""

    def __init__(self, layout: str, pages: int = 8, layers: int = 3, heads: int = 2, head_dim: int = 8,
                 seed: int = 0) -> None:
        self.layout, self.page_size, self.size = layout, PAGE, pages * PAGE
        self.layer_num, self.head_num, self.head_dim, self.dtype = layers, heads, head_dim, torch.bfloat16
        self.device = "cpu"
        dims = ((2, layers, self.size, heads, head_dim) if layout == "layer_first"
                else (2, self.size, layers, heads, head_dim))
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(dims, generator=gen).to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        else:
            page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + self.page_size] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """SGLang's pointer arithmetic for these two layouts, unchanged."""
        assert len(indices) % self.page_size == 0
        ptr_list = []
        base = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        item = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (base + indices[index] * self.head_num * self.head_dim * item
                             + layer_id * self.size * self.head_num * self.head_dim * item)
                    ptr_list += [k_ptr, k_ptr + v_offset]
            element_size = item * self.page_size * self.head_num * self.head_dim
        else:
            for index in range(0, len(indices), self.page_size):
                k_ptr = base + indices[index] * self.layer_num * self.head_num * self.head_dim * item
                ptr_list += [k_ptr, k_ptr + v_offset]
            element_size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptr_list, [element_size] * len(ptr_list)

    def page_bytes(self, index: int) -> bytes:
        return self.get_data_page(index).contiguous().view(torch.uint8).numpy().tobytes()


class FakeMLAHostPool:
    """The parts of SGLang's ``MLATokenToKVPoolHost`` a storage backend touches (SGLang
    0.5.23, ``pool_host/mla.py``): one latent row per token and layer (``kv_lora_rank +
    qk_rope_head_dim`` wide), no K/V split; ``layer_first`` and ``page_first``, one
    logical page per physical page (no decode context parallelism)."""

    def __init__(self, layout: str, pages: int = 8, layers: int = 3, kv_cache_dim: int = 24,
                 seed: int = 0) -> None:
        self.layout, self.page_size, self.size = layout, PAGE, pages * PAGE
        self.layer_num, self.kv_cache_dim, self.dtype = layers, kv_cache_dim, torch.bfloat16
        self.device = "cpu"
        dims = ((layers, self.size, 1, kv_cache_dim) if layout == "layer_first"
                else (self.size, layers, 1, kv_cache_dim))
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(dims, generator=gen).to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index:index + self.page_size, :, :]
        else:
            page = self.kv_buffer[index:index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
                self.layer_num, self.page_size, 1, self.kv_cache_dim)
        else:
            self.kv_buffer[index:index + self.page_size] = data_page.reshape(
                self.page_size, self.layer_num, 1, self.kv_cache_dim)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """SGLang's pointer arithmetic for these two layouts, unchanged."""
        assert len(indices) % self.page_size == 0
        ptr_list = []
        base = self.kv_buffer.data_ptr()
        starts = indices.tolist()[:: self.page_size]
        item = self.dtype.itemsize
        if self.layout == "layer_first":
            for index in starts:
                for layer_id in range(self.layer_num):
                    ptr_list.append(base + index * self.kv_cache_dim * item
                                    + layer_id * self.size * self.kv_cache_dim * item)
            element_size = item * self.page_size * self.kv_cache_dim
        else:
            for index in starts:
                ptr_list.append(base + index * self.layer_num * self.kv_cache_dim * item)
            element_size = self.layer_num * item * self.page_size * self.kv_cache_dim
        return ptr_list, [element_size] * len(ptr_list)

    def page_bytes(self, index: int) -> bytes:
        return self.get_data_page(index).contiguous().view(torch.uint8).numpy().tobytes()


def storage_config(interface_v1: bool, tp_rank: int = 0, mla: bool = False, **extra: Any) -> Any:
    extra_config = {"backend_name": "emsd", "module_path": "ems.integrations.sglang",
                    "class_name": "EmsdHiCacheStorage", "interface_v1": int(interface_v1),
                    "emsd_retry_interval_s": 0.2, "emsd_timeout_ms": 2000, **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="org/Tiny-Model",
                                extra_config=extra_config)


def backend_for(pool: Any, interface_v1: bool = True, tp_rank: int = 0) -> Any:
    """As SGLang's cache controller attaches a storage backend (an MLA model for an MLA pool)."""
    config = storage_config(interface_v1, tp_rank, mla=isinstance(pool, FakeMLAHostPool))
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def hashes(n: int, tag: str = "p") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def indices(pages: list[int]) -> Any:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_dynamic_factory_builds_the_emsd_backend(ems_env: Any) -> None:
    backend = backend_for(FakeHostPool("page_first"))
    assert isinstance(backend, EmsdHiCacheStorage)
    assert backend.interface_v1 and backend.zero_copy is not None
    assert all(ns.startswith("tiny-model.sglang-") for ns in backend.namespaces.values())


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_zero_copy_pages_round_trip_between_two_pools(ems_env: Any, layout: str) -> None:
    writer_pool, reader_pool = FakeHostPool(layout, seed=1), FakeHostPool(layout, seed=2)
    writer, reader = backend_for(writer_pool), backend_for(reader_pool)
    keys = hashes(3)
    assert writer.batch_set_v1(keys, indices([5, 1, 6])) == [True, True, True]
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, indices([0, 2, 3])) == [True, True, True]
    for src, dst in ((5, 0), (1, 2), (6, 3)):
        assert reader_pool.page_bytes(dst * PAGE) == writer_pool.page_bytes(src * PAGE)
    untouched = FakeHostPool(layout, seed=2)
    assert reader_pool.page_bytes(7 * PAGE) == untouched.page_bytes(7 * PAGE)


def test_batch_exists_and_loads_stop_at_the_first_missing_page(ems_env: Any) -> None:
    pool = FakeHostPool("layer_first", seed=3)
    backend = backend_for(pool)
    keys = hashes(5)
    backend.batch_set_v1(keys[:2] + keys[3:4], indices([0, 1, 3]))  # keys[2] never stored
    assert backend.batch_exists(keys) == 2
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    assert backend.batch_get_v1(keys, indices([4, 5, 6, 7, 2])) == [True, True, False, False, False]


def test_tp_ranks_keep_their_own_shards(ems_env: Any) -> None:
    rank0, rank1 = backend_for(FakeHostPool("page_first"), tp_rank=0), backend_for(
        FakeHostPool("page_first"), tp_rank=1)
    keys = hashes(1)
    rank0.batch_set_v1(keys, indices([0]))
    assert rank0.batch_exists(keys) == 1 and rank1.batch_exists(keys) == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_pages_round_trip_and_every_tp_rank_reads_the_one_copy(ems_env: Any, layout: str) -> None:
    # MLA's latent cache is the same on every TP rank: stored once, read by all (as SGLang's
    # file backend does), unlike MHA's per-rank head shards (test above).
    writer_pool, reader_pool = FakeMLAHostPool(layout, seed=1), FakeMLAHostPool(layout, seed=2)
    writer, reader = backend_for(writer_pool, tp_rank=0), backend_for(reader_pool, tp_rank=1)
    assert writer.zero_copy is not None and reader.namespaces == writer.namespaces
    keys = hashes(3, tag="mla")
    assert writer.batch_set_v1(keys, indices([5, 1, 6])) == [True, True, True]
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, indices([0, 2, 3])) == [True, True, True]
    for src, dst in ((5, 0), (1, 2), (6, 3)):
        assert reader_pool.page_bytes(dst * PAGE) == writer_pool.page_bytes(src * PAGE)
    assert reader_pool.page_bytes(7 * PAGE) == FakeMLAHostPool(layout, seed=2).page_bytes(7 * PAGE)
    mha = backend_for(FakeHostPool(layout), tp_rank=0)
    assert mha.batch_exists(keys) == 0  # another geometry, another namespace


def test_mla_flat_pages_round_trip(ems_env: Any) -> None:
    pool = FakeMLAHostPool("layer_first", seed=4)
    writer, reader = backend_for(pool, interface_v1=False), backend_for(pool, interface_v1=False, tp_rank=1)
    keys = hashes(2, tag="mla-flat")
    assert writer.batch_set(keys, [pool.get_data_page(p * PAGE) for p in (0, 1)])
    got = reader.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None for g in got)
    for p, page in enumerate(got):
        assert torch.equal(page, pool.get_data_page(p * PAGE))


def test_flat_pages_round_trip_through_get_and_set(ems_env: Any) -> None:
    pool = FakeHostPool("layer_first", seed=4)
    backend = backend_for(pool, interface_v1=False)
    keys = hashes(3, tag="flat")
    assert backend.batch_set(keys, [pool.get_data_page(p * PAGE) for p in (0, 1, 2)])
    assert backend.batch_exists(keys + hashes(1, tag="absent")) == 3
    targets = [pool.get_dummy_flat_data_page() for _ in range(4)]
    got = backend.batch_get(keys + hashes(1, tag="absent"), targets)
    assert [g is not None for g in got] == [True, True, True, False]
    for p, page in enumerate(got[:3]):
        assert torch.equal(page, pool.get_data_page(p * PAGE))
    one = backend.get(keys[1])  # no target: a new flat page
    assert one is not None and torch.equal(one, pool.get_data_page(PAGE))
    assert backend.set(hashes(1, tag="single")[0], pool.get_data_page(3 * PAGE))


def test_flat_and_zero_copy_formats_never_mix(ems_env: Any) -> None:
    pool = FakeHostPool("layer_first")
    v1, flat = backend_for(pool), backend_for(pool, interface_v1=False)
    keys = hashes(1, tag="mix")
    flat.set(keys[0], pool.get_data_page(0))
    assert flat.exists(keys[0]) and not v1.exists(keys[0])


def test_emsd_killed_mid_use_gives_misses_never_errors(ems_env: Any) -> None:
    pool = FakeHostPool("page_first", seed=5)
    backend = backend_for(pool)
    flat = backend_for(pool, interface_v1=False)
    keys = hashes(2, tag="kill")
    assert backend.batch_set_v1(keys, indices([0, 1])) == [True, True]
    ems_env.kill9()
    before = pool.page_bytes(4 * PAGE)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, indices([4, 5])) == [False, False]
    assert pool.page_bytes(4 * PAGE) == before
    assert backend.batch_set_v1(hashes(1, tag="late"), indices([2])) == [False]
    assert flat.get(keys[0]) is None and flat.set(keys[0], pool.get_data_page(0)) is False
    assert flat.batch_get(keys) == [None, None] and not flat.exists(keys[0])


def test_clear_drops_every_stored_page_and_fails_soft_without_emsd(ems_env: Any) -> None:
    # SGLang's /clear_hicache_storage_backend, e.g. after a weight update: nothing stored
    # before may be served after, in either format.
    pool = FakeHostPool("page_first", seed=6)
    v1, flat = backend_for(pool), backend_for(pool, interface_v1=False)
    keys = hashes(2, tag="clear")
    assert v1.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert flat.batch_set(keys, [pool.get_data_page(0), pool.get_data_page(PAGE)])
    assert v1.clear() is True
    assert v1.batch_exists(keys) == 0 and flat.batch_exists(keys) == 0
    assert v1.batch_get_v1(keys, indices([4, 5])) == [False, False]
    assert v1.batch_set_v1(keys, indices([2, 3])) == [True, True]  # stored afresh
    ems_env.kill9()
    assert v1.clear() is False  # no exception reaches SGLang
    assert v1.batch_exists(keys) == 0


def test_unknown_emsd_option_is_refused_by_name(ems_env: Any) -> None:
    with pytest.raises(ValueError, match="emsd_timeout"):
        StorageBackendFactory.create_backend("dynamic", storage_config(True, emsd_timeout=1), None)
