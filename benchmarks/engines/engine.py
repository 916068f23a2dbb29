"""One real vLLM engine serving a list of requests, one after another or N at once, timing each.

Run as a script in a fresh process, as a server would run (vLLM keeps
process-wide state), with the .venv-vllm interpreter::

    python benchmarks/engines/engine.py --model DIR --requests FILE --out FILE
        [--connector none|emsd|lmcache|offload|mooncake] [--max-model-len N] [--engine-blocks N]
        [--concurrency N] [--check-saved]

``--requests`` is a JSON list of ``{"id", "parent", "prompt_token_ids",
"max_tokens"}``; a request with a ``parent`` (an earlier request of the same
file) is sent as the parent's prompt, the tokens the engine generated for it,
then its own ``prompt_token_ids``: a chat's next turn after the engine's own
answer. The warm-up requests (ids ``warmup...``) are served first, each alone.
Then, with ``--concurrency 1`` (the default), each request is added to the
engine alone and stepped until it finishes; with ``--concurrency N``, as many
as N are in the engine at once, as N users of a server each sending their next
turn once they have the answer: a request is added as soon as its parent has
finished and fewer than N are in flight, in the file's order (``serve_all``).
A request's time to first token is the wall time from ``add_request`` to the
first step that returns one of its tokens (prefill, with any KV loaded by the
connector, and the first sampled token; with N > 1 also the steps it shares
with the others), its end-to-end time until it finishes. Decoding is greedy
(temperature 0, ``ignore_eos``), so outputs can be compared token for token
between engines.

The output file holds ``{"init_seconds", "serve_seconds", "requests": [{"id",
"ttft", "e2e", "prompt_tokens", "cached_tokens", "token_ids",
"prompt_token_ids"}]}``
(``serve_seconds``: the wall time of serving every request but the warm-ups;
the prompt as sent, the tokens generated); ``cached_tokens`` is
vLLM's ``num_cached_tokens`` (tokens not computed: its own prefix cache plus
what a connector loaded). With ``--check-saved`` (emsd only) it also holds
``saved_check``: emsd's copy of every block still in the engine's prefix cache
compared with the engine's own, byte for byte (``check_saved``).

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
from collections.abc import Callable, Container, Sequence
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


def admissible(pending: Sequence[dict[str, Any]], done: Container[str], in_flight: int,
               limit: int) -> list[dict[str, Any]]:
    """The requests of ``pending`` to add to the engine now, in ``pending``'s order: those
    without a parent or whose parent is ``done`` (a user sends the next turn after reading the
    answer), at most ``limit - in_flight`` of them (none when ``in_flight >= limit``)."""
    room = max(0, limit - in_flight)
    ready = [r for r in pending if r.get("parent") is None or str(r["parent"]) in done]
    return ready[:room]


def serve_all(engine: Any, requests: Sequence[dict[str, Any]], limit: int,
              params_of: Callable[[dict[str, Any]], Any],
              log: Callable[[dict[str, Any]], None] = lambda _: None,
              ) -> tuple[dict[str, dict[str, Any]], float]:
    """Serve ``requests`` with at most ``limit`` in the engine at once, each added as soon as
    ``admissible`` allows (``limit`` 1: one after another, each alone). Returns (request id ->
    its timings and tokens, the wall seconds from the first ``add_request`` to the last
    finish). A request's TTFT runs from its ``add_request`` to the first step that returns one
    of its tokens, so with ``limit`` > 1 it includes the steps it shared with the others.
    ``RuntimeError`` if a request waits for a parent that is not among ``requests``."""
    pending = list(requests)
    started: dict[str, tuple[float, list[int]]] = {}
    first: dict[str, float] = {}
    done: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    while pending or started:
        for r in admissible(pending, done, len(started), limit):
            pending.remove(r)
            rid, prompt = str(r["id"]), prompt_of(r, done)
            started[rid] = (time.perf_counter(), prompt)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params_of(r))
        if not started:
            raise RuntimeError(f"request {pending[0]['id']} waits for {pending[0]['parent']}, "
                               "which is not served before it")
        for out in engine.step():
            rid = out.request_id
            if rid not in started:
                continue
            now = time.perf_counter()
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = now
            if out.finished:
                t0, prompt = started.pop(rid)
                done[rid] = {"id": rid, "ttft": first.get(rid, now) - t0, "e2e": now - t0,
                             "prompt_tokens": len(prompt), "cached_tokens": int(out.num_cached_tokens or 0),
                             "token_ids": list(out.outputs[0].token_ids), "prompt_token_ids": prompt}
                log(done[rid])
        if not engine.has_unfinished_requests() and started:
            raise RuntimeError(f"requests {sorted(started)} did not finish")
    return done, time.perf_counter() - t_start


def check_saved(llm: Any) -> dict[str, int]:
    """Compare the bytes emsd holds for every full block still in the engine's own prefix cache
    with the engine's block, byte for byte: each is loaded through the connector's own SDK
    client into vLLM's null block (never read by attention), then compared in every layer.
    Returns ``{"blocks", "equal", "missing"}`` (blocks compared, equal ones, ones emsd does
    not hold: evicted, or a save dropped). Waits for the saves in flight first. Uses vLLM
    0.32's engine internals (the in-process engine core's block pool, the worker's connector).

    Exact where every block in the prefix cache was either saved by this engine or loaded
    from emsd. A block this engine computed although emsd held another engine's copy (one
    after a miss, where a small pool evicted a block before it) may differ in its last bits,
    the same tokens computed in another batch: the benchmark checks only where its pools hold
    the whole trace."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.core.kv_cache_utils import get_block_hash

    from ems.integrations.vllm import block_key

    worker = get_kv_transfer_group()._worker
    worker.drain()
    cc = worker.link.cc() if worker.link is not None else None
    if cc is None:
        raise RuntimeError("check_saved: the connector has no emsd link")
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    spare = pool.null_block.block_id
    pieces = [v for layer in worker._kv for v in layer]
    counts = {"blocks": 0, "equal": 0, "missing": 0}
    for block in pool.blocks:
        if block.block_hash is None or block.block_id == spare:
            continue
        for v in pieces:
            v[spare].zero_()
        if cc.load([spare], hashes=[block_key(get_block_hash(block.block_hash))], offsets=[1]).success != 1:
            counts["missing"] += 1
            continue
        counts["blocks"] += 1
        counts["equal"] += all(torch.equal(v[spare], v[block.block_id]) for v in pieces)
    return counts


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
    ap.add_argument("--check-saved", action="store_true",
                    help="after serving, compare emsd's copy of each block in the engine's prefix cache with "
                         "the engine's own, byte for byte (--connector emsd)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in the engine at once (1: one after another, each alone)")
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
        kw |= {"max_num_seqs": max(4, args.concurrency), "max_num_batched_tokens": args.max_model_len}
    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size, enforce_eager=True, seed=0,
              max_model_len=args.max_model_len, **kw)
    engine = llm.llm_engine
    init_seconds = time.perf_counter() - start
    requests = json.loads(Path(args.requests).read_text())

    def params_of(r: dict[str, Any]) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True)

    def log(got: dict[str, Any]) -> None:
        print(f"engine.py: {got['id']}: {got['prompt_tokens']} tokens, ttft {got['ttft']:.3f} s, "
              f"cached {got['cached_tokens']}", file=sys.stderr, flush=True)

    # the warm-up prompts (ids "warmup...", first in the file) alone, then the rest
    warm = [r for r in requests if str(r["id"]).startswith("warmup")]
    done, _ = serve_all(engine, warm, 1, params_of, log)
    served, serve_seconds = serve_all(engine, [r for r in requests if r not in warm], args.concurrency,
                                      params_of, log)
    result: dict[str, Any] = {"init_seconds": init_seconds, "serve_seconds": serve_seconds,
                              "requests": list((done | served).values())}
    if args.check_saved:
        result["saved_check"] = check_saved(llm)
        print(f"engine.py: saved blocks checked: {result['saved_check']}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(result))
    if args.connector == "lmcache":
        leave_lmcache()
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
