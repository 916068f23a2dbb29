"""Chained prefix hashing: the key of each chunk of a token sequence.

Token semantics name KV data by the tokens that produced it. KV data at a
position depends on every token before it, so a chunk's key must cover the
whole prefix, not just the chunk's own tokens. Keys are chained:

    key[-1] = SEED
    key[c]  = blake2b-256(DOMAIN + key[c-1] + tokens[c] as little-endian int64
                          + len(tokens[c]) as little-endian uint64)

Consequences (property-tested in ``tests/unit/test_tokens.py``):

- two token sequences get the same ``key[c]`` exactly when their first
  ``c + 1`` chunks are equal (up to a 256-bit hash collision);
- a trailing partial chunk hashes its length too, so it never equals the key
  of a full chunk, nor of a partial chunk of another length, and it is found
  only for that exact prefix;
- keys are deterministic across processes and machines (no Python
  ``hash()``, no randomisation), so any client computes the same keys.

Keys are 32-byte ``bytes``, stored like vLLM's own 32-byte block hashes. The
domain tag keeps them apart from any other blake2b use of the same bytes.
Cost: one blake2b call per chunk, about a microsecond each; 32k tokens in
chunks of 16 (2048 keys) take about 2 ms.
"""

from __future__ import annotations

import hashlib

import numpy as np

DOMAIN = b"emsd.tokens.v1\x00"
SEED = bytes(32)
KEY_BYTES = 32


def chunk_keys(token_ids: np.ndarray, block_size: int) -> list[bytes]:
    """The chained key of each ``block_size`` chunk of ``token_ids`` (last may be partial).

    ``token_ids``: a 1-D integer array (converted to int64); ``block_size`` > 0.
    Returns ``ceil(len(token_ids) / block_size)`` keys of 32 bytes.
    Raises ``ValueError`` for a non-positive ``block_size`` or a non-1-D array.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    tokens = np.ascontiguousarray(token_ids, dtype="<i8")
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    data = tokens.tobytes()
    n = tokens.shape[0]
    step = 8 * block_size
    full_len = block_size.to_bytes(8, "little")
    blake2b = hashlib.blake2b
    keys: list[bytes] = []
    prev = SEED
    for start in range(0, 8 * n, step):
        chunk = data[start:start + step]
        length = full_len if len(chunk) == step else (len(chunk) // 8).to_bytes(8, "little")
        prev = blake2b(DOMAIN + prev + chunk + length, digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys
