"""A stated model of time to first token (TTFT): recompute of missed tokens + load of hit tokens.

There is no GPU here, so prefill time is modelled, not measured:

- Model: Llama-3-8B. 8.03e9 parameters, 32 layers, d_model 4096, grouped-query
  attention with 8 KV heads of 128: KV bytes per token in bf16 =
  2 (K and V) x 32 x 8 x 128 x 2 B = 131,072 B (128 KiB).
- Prefill FLOPs for ``n`` new tokens after ``c`` tokens already in the KV cache:
  ``2 * P * n`` (the weights) + ``4 * L * d * (n * c + n * (n - 1) / 2)`` (scores
  QK^T and the weighted sum AV, 2 * d FLOPs each per (query, key) pair and layer,
  causal: token at position p attends to p keys).
- GPU: NVIDIA A100-SXM4-80GB, 312e12 dense bf16 FLOP/s, at a stated model FLOPs
  utilisation (MFU) of 50% for prefill.

Load time of hit tokens is measured in the same run (``LoadCost``: a fixed cost
per request, the SDK's round trips, plus bytes / bandwidth, the bandwidth
measured by loading Llama-3-8B-sized blocks from a real daemon into host
tensors). In a real deployment the last hop is host -> GPU over PCIe or
NVLink, which this machine cannot measure; the host copy stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelCost:
    name: str = "Llama-3-8B"
    params: float = 8.03e9
    layers: int = 32
    d_model: int = 4096
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2
    gpu: str = "A100-SXM4-80GB (312 TFLOP/s bf16 dense)"
    peak_flops: float = 312e12
    mfu: float = 0.5

    def prefill_flops(self, new: np.ndarray | int, cached: np.ndarray | int) -> np.ndarray:
        """FLOPs to prefill ``new`` tokens after ``cached`` tokens whose KV is present."""
        n = np.asarray(new, dtype=np.float64)
        c = np.asarray(cached, dtype=np.float64)
        return 2 * self.params * n + 4 * self.layers * self.d_model * (n * c + n * (n - 1) / 2)

    def prefill_s(self, new: np.ndarray | int, cached: np.ndarray | int) -> np.ndarray:
        return self.prefill_flops(new, cached) / (self.peak_flops * self.mfu)


@dataclass(frozen=True)
class LoadCost:
    """Measured: ``fixed_s`` per request with hits, plus ``bytes / bandwidth``."""

    fixed_s: float
    bandwidth: float  # bytes per second

    def load_s(self, tokens: np.ndarray | int, kv_bytes_per_token: int) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        return np.where(t > 0, self.fixed_s + t * kv_bytes_per_token / self.bandwidth, 0.0)


def ttft(model: ModelCost, load: LoadCost, prompt: np.ndarray | int,
         hit: np.ndarray | int) -> np.ndarray:
    """Modelled TTFT of prompts of ``prompt`` tokens whose first ``hit`` tokens are loaded."""
    p = np.asarray(prompt, dtype=np.float64)
    h = np.asarray(hit, dtype=np.float64)
    return load.load_s(h, model.kv_bytes_per_token) + model.prefill_s(p - h, h)


def ttft_curve(model: ModelCost, load: LoadCost, contexts: np.ndarray,
               new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(without a cache, with every token but the last ``new_tokens`` loaded) per context length."""
    contexts = np.asarray(contexts, dtype=np.float64)
    without = model.prefill_s(contexts, 0)
    with_cache = ttft(model, load, contexts, np.maximum(contexts - new_tokens, 0))
    return without, with_cache
