"""One real vLLM engine serving a list of requests one after another, timing each.

Run as a script in a fresh process, as a server would run (vLLM keeps
process-wide state), with the .venv-vllm interpreter::

    python benchmarks/engines/engine.py --model DIR --requests FILE --out FILE
        [--connector none|emsd|lmcache|offload|mooncake] [--max-model-len N] [--engine-blocks N]

``--requests`` is a JSON list of ``{"id", "parent", "prompt_token_ids",
"max_tokens"}``; a request with a ``parent`` (an earlier request of the same
file) is sent as the parent's prompt, the tokens the engine generated for it,
then its own ``prompt_token_ids``: a chat's next turn after the engine's own
answer. Each request is added to the engine alone and stepped until it finishes:
its time to first token is the wall time from ``add_request`` to the first
step that returns one of its tokens (prefill, with any KV loaded by the
connector, and the first sampled token), its end-to-end time until it
finishes. Decoding is greedy (temperature 0, ``ignore_eos``), so outputs can
be compared token for token between engines.

The output file holds ``{"init_seconds", "requests": [{"id", "ttft", "e2e",
"prompt_tokens", "cached_tokens", "token_ids", "prompt_token_ids"}]}`` (the
prompt as sent, the tokens generated); ``cached_tokens`` is
vLLM's ``num_cached_tokens`` (tokens not computed: its own prefix cache plus
what a connector loaded).

Connectors: ``emsd`` is ``EmsStoreConnector`` (``EMS_SOCKET_DIR`` from the
environment), ``lmcache`` is vLLM's ``LMCacheConnectorV1`` configured by
``LMCACHE_*`` variables from the environment (its local CPU backend, or its
remote server with ``LMCACHE_REMOTE_URL``), with the CPU copy of
``lmcache_cpu`` (LMCache 0.5.6 has none of its own), ``mooncake`` is vLLM's own
``MooncakeStoreConnector`` (venv ``.venv-mcvllm``, scripts/setup-mooncake-vllm.sh),
configured by the file ``MOONCAKE_CONFIG_PATH`` names (master address, metadata
server, protocol, mode, segment and buffer sizes) and by
``MOONCAKE_REQUESTER_LOCAL_HOSTNAME`` and ``MOONCAKE_PREFERRED_SEGMENT``: all
three as ``benchmarks.engines.mooncake_store.MooncakeStore.env`` gives them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def transfer_config(connector: str) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for a connector name (None for ``none``)."""
    if connector == "none":
        return None
    if connector == "emsd":
        return {"kv_connector": "EmsStoreConnector", "kv_connector_module_path": "ems.integrations.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {}}
    if connector == "lmcache":
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if connector == "offload":  # vLLM's own offloading of KV blocks to CPU memory
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}
    if connector == "mooncake":  # vLLM's MooncakeStoreConnector: the store reads MOONCAKE_CONFIG_PATH
        if not os.environ.get("MOONCAKE_CONFIG_PATH"):
            raise SystemExit("engine.py: --connector mooncake needs MOONCAKE_CONFIG_PATH "
                             "(benchmarks.engines.mooncake_store.MooncakeStore.env)")
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {}}
    raise SystemExit(f"engine.py: unknown connector {connector!r} (none, emsd, lmcache, offload, mooncake)")


def serve(engine: Any, rid: str, prompt_ids: list[int], params: Any) -> dict[str, Any]:
    """Add one request, step the engine until it finishes; its timings and tokens."""
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt_ids}, params)
    ttft = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
    e2e = time.perf_counter() - t0
    if final is None:
        raise RuntimeError(f"request {rid} did not finish")
    return {"id": rid, "ttft": ttft if ttft is not None else e2e, "e2e": e2e,
            "prompt_tokens": len(prompt_ids), "cached_tokens": int(final.num_cached_tokens or 0),
            "token_ids": list(final.outputs[0].token_ids), "prompt_token_ids": prompt_ids}


def prompt_of(request: dict[str, Any], served: dict[str, dict[str, Any]]) -> list[int]:
    """The token ids to send for ``request``: its parent's prompt and answer (from ``served``,
    id -> result), then its own tokens. ``KeyError`` for a parent not served before it."""
    own = [int(t) for t in request["prompt_token_ids"]]
    parent = request.get("parent")
    if parent is None:
        return own
    done = served[str(parent)]
    return list(done["prompt_token_ids"]) + list(done["token_ids"]) + own


def leave_lmcache() -> None:
    """Close LMCache's engine (``LMCacheEngineBuilder.destroy``: its storage manager and its
    connection to a server), then exit: LMCache keeps threads that are not daemons, and the
    process would never end on its own."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(ENGINE_NAME)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector", default="none")
    ap.add_argument("--max-model-len", type=int, default=9216)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--scheduler-defaults", action="store_true",
                    help="leave max_num_batched_tokens and max_num_seqs at vLLM's defaults")
    ap.add_argument("--engine-blocks", type=int, default=0,
                    help="KV blocks of the engine's own cache (0: what VLLM_CPU_KVCACHE_SPACE gives)")
    args = ap.parse_args()

    if args.connector == "lmcache":
        from benchmarks.engines import lmcache_cpu

        lmcache_cpu.install()  # before vLLM imports LMCache
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    kw: dict[str, Any] = {}
    tc = transfer_config(args.connector)
    if tc is not None:
        kw["kv_transfer_config"] = tc
    if args.engine_blocks:
        kw["num_gpu_blocks_override"] = args.engine_blocks
    if not args.scheduler_defaults:  # one step prefills a whole prompt
        kw |= {"max_num_seqs": 4, "max_num_batched_tokens": args.max_model_len}
    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size, enforce_eager=True, seed=0,
              max_model_len=args.max_model_len, **kw)
    engine = llm.llm_engine
    init_seconds = time.perf_counter() - start
    requests = json.loads(Path(args.requests).read_text())
    done: dict[str, dict[str, Any]] = {}
    for r in requests:
        params = SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True)
        got = done[str(r["id"])] = serve(engine, str(r["id"]), prompt_of(r, done), params)
        print(f"engine.py: {r['id']}: {got['prompt_tokens']} tokens, ttft {got['ttft']:.3f} s, "
              f"cached {got['cached_tokens']}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps({"init_seconds": init_seconds, "requests": list(done.values())}))
    if args.connector == "lmcache":
        leave_lmcache()
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
