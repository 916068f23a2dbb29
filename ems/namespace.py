"""The namespace a process's blocks live in: one canonical string per config.

A block key (a hash, or a token-prefix digest) only identifies data inside a
namespace. The namespace carries everything that makes the bytes stored under
the same key differ:

- the tenant (``access_id``; the default tenant when ``None``): tenants never
  see each other's blocks;
- ``model_id`` and ``llm_engine``: different models or engines compute
  different KV data for the same tokens;
- ``kvcache_type`` and the layout signature (tensor shapes, dtypes, block
  size, as the caller chooses to describe them): the same model stored in
  another layout cannot be copied back;
- ``tp_world_size``, ``pp_world_size``, ``rank_in_tp_group``,
  ``rank_in_pp_group``: each rank of a TP group holds a different shard of
  the heads, each PP stage different layers, all under the same block hash;
  a rank must never read another rank's shard.

``rank_id`` and ``device_id`` are deliberately left out. They say where this
process runs (which GPU, which global rank number), not what its blocks
contain: rank 3 of one instance and rank 7 of a second instance of the same
model, with the same TP/PP position, hold identical shards, and sharing those
blocks between instances is the point of a shared cache. Engines also number
global ranks differently, so including them would split the cache for no
reason.

Form: a compact JSON array with a version tag, in fixed field order, e.g.
``["ems-ns-v1",null,"llama-3-8b","vllm","MHA",2,1,0,0,""]``. JSON encodes
strings and ints unambiguously (quotes and escapes delimit every field, and
``null`` is distinct from every string), so different field tuples always give
different names, and the same config gives the same name in every process.
The default tenant is ``null``, which no ``access_id`` can spell.
"""

from __future__ import annotations

import json

from ems.cc_v1.cc_config import CcConfig_v1

NAMESPACE_VERSION = "ems-ns-v1"


def namespace_name(access_id: str | None, cc: CcConfig_v1, layout_signature: str) -> str:
    """The canonical namespace string of (tenant, ``cc``'s shape fields, layout).

    ``access_id``: the tenant, ``None`` for the default tenant. ``cc``: a
    validated ``CcConfig_v1``. ``layout_signature``: any string describing the
    registered layout ("" when the namespace does not depend on it).
    Raises ``TypeError`` for arguments of the wrong type (a programming error:
    user input reaches this function already validated).
    """
    if access_id is not None and not isinstance(access_id, str):
        raise TypeError(f"access_id must be a str or None, got {type(access_id).__name__}")
    if not isinstance(cc, CcConfig_v1):
        raise TypeError(f"cc must be a CcConfig_v1, got {type(cc).__name__}")
    if not isinstance(layout_signature, str):
        raise TypeError(f"layout_signature must be a str, got {type(layout_signature).__name__}")
    fields = [
        NAMESPACE_VERSION,
        access_id,
        cc.model_id,
        cc.llm_engine,
        cc.kvcache_type.value,
        cc.tp_world_size,
        cc.pp_world_size,
        cc.rank_in_tp_group,
        cc.rank_in_pp_group,
        layout_signature,
    ]
    return json.dumps(fields, ensure_ascii=True, separators=(",", ":"))
