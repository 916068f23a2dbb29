"""Engine object keys to emsd keys, and engine settings to SDK ``model_id`` names.

Pure functions, no engine imports. emsd keys are ``bytes`` of at most 32
bytes (the SDK's limit), so every engine key becomes a 32-byte digest:

- a string of exactly 64 hex digits (SGLang's page hashes, a SHA-256 of the
  page's tokens chained with the previous page's hash) is taken as the 32
  bytes it spells: no second hash, and the stored key can be read back as the
  engine's;
- any other string (LMCache's ``CacheEngineKey.to_string()``, which spells
  model, world size, worker id, chunk hash, dtype and tags) is hashed with
  BLAKE2b to 32 bytes. Two different strings colliding is as unlikely as a
  SHA-256 collision of the engine's own chain.

The SDK's ``model_id`` alphabet is ``[0-9a-z._@-]`` with 1-512 characters;
``model_name`` reduces a model path or name to it, and ``model_id`` appends
a fingerprint of everything that changes the bytes of a stored value, so two
deployments share values exactly when they would write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

KEY_BYTES = 32
MAX_MODEL_NAME = 400  # leaves room for the fingerprint inside the SDK's 512
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_NOT_NAME = re.compile(r"[^0-9a-z._@-]+")


def digest_key(key: str) -> bytes:
    """The 32-byte emsd key of an engine key string (see the module docstring).

    Raises ``TypeError`` for a non-string key (an engine bug, never user input).
    """
    if not isinstance(key, str):
        raise TypeError(f"engine keys are str, got {type(key).__name__} {key!r}")
    if _HEX64.fullmatch(key):
        return bytes.fromhex(key)
    return hashlib.blake2b(key.encode("utf-8"), digest_size=KEY_BYTES).digest()


def model_name(name: str | None, default: str = "model") -> str:
    """``name`` reduced to ``[0-9a-z._@-]``: lower case, last path component, other runs as ``-``.

    ``/models/Llama-3-8B/`` gives ``llama-3-8b``; an empty result gives ``default``.
    """
    text = (name or "").strip().rstrip("/").rsplit("/", 1)[-1].lower()
    text = _NOT_NAME.sub("-", text).strip("-.")[:MAX_MODEL_NAME]
    return text or default


def fingerprint(fields: dict[str, Any]) -> str:
    """16 hex digits over ``fields`` (JSON with sorted keys; values via ``str`` if needed)."""
    text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def model_id(name: str | None, engine: str, fields: dict[str, Any]) -> str:
    """``<model>.<engine>-<fingerprint of fields>``: a valid SDK ``model_id``."""
    return f"{model_name(name)}.{engine}-{fingerprint(fields)}"
