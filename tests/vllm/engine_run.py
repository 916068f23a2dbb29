"""Run one vLLM engine on the tiny model and write its greedy outputs as JSON.

Run as a script in a fresh process (vLLM keeps process-wide state)::

    python tests/vllm/engine_run.py --model DIR --out FILE [--connector JSON]
        --prompts JSON [--max-tokens N] [--sync DIR]

- ``--connector JSON``: ``kv_connector_extra_config`` for ``EmsStoreConnector``
  (``{}`` for the defaults); absent means no connector at all.
- ``--prompts JSON``: a JSON list of batches, each a list of prompt strings;
  the batches run one after another through the same engine (a later batch
  finds what an earlier one saved).
- ``--sync DIR``: before each batch ``i >= 1``, create ``DIR/ready-<i>`` and
  wait (at most 180 s) until ``DIR/go-<i>`` exists, so that a test can act on
  emsd between batches.
- ``--reset-connector``: after the last batch, ``LLM.reset_prefix_cache(
  reset_connector=True)`` (what follows a weight update); its result is
  ``"reset"`` in the output. vLLM refuses the reset while blocks are held,
  here by saves still in flight, which it only sees end during a step: each
  refusal is followed by a one-token generation (steps) and a retry, up to
  20 times.

The output file holds ``{"batches": [[{"text", "token_ids"}, ...], ...],
"batch_seconds": [float, ...], "seconds": float, "reset": bool | None}``. Generation is greedy
(temperature 0, ``ignore_eos``). Environment: ``ENGINE_RUN_EXECUTOR=uni``
(with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) runs scheduler and worker in this
process (fast start); unset, vLLM's default processes are used.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand (debugging hangs)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector", default=None)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--sync", default=None)
    ap.add_argument("--reset-connector", action="store_true")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    kw = {}
    if args.connector is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "EmsStoreConnector",
            "kv_connector_module_path": "ems.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": json.loads(args.connector),
        }
    start = time.monotonic()
    llm = LLM(model=args.model, dtype="float32", block_size=32,
              enforce_eager=True, seed=0, max_model_len=1024, max_num_seqs=8,
              distributed_executor_backend=os.environ.get("ENGINE_RUN_EXECUTOR") or None, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batches = json.loads(args.prompts)
    results, seconds = [], []
    for i, prompts in enumerate(batches):
        if i >= 1 and args.sync:
            Path(args.sync, f"ready-{i}").touch()
            deadline = time.monotonic() + 180
            while not Path(args.sync, f"go-{i}").exists():
                if time.monotonic() > deadline:
                    print(f"engine_run: no go-{i} signal", file=sys.stderr)
                    return 3
                time.sleep(0.05)
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.monotonic() - t0)
        results.append([{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
                        for o in outs])
    reset = reset_prefix_cache(llm, SamplingParams(max_tokens=1)) if args.reset_connector else None
    Path(args.out).write_text(json.dumps({"batches": results, "batch_seconds": seconds,
                                          "seconds": time.monotonic() - start, "reset": reset}))
    del llm
    return 0


def reset_prefix_cache(llm: object, one_token: object) -> bool:
    """``llm.reset_prefix_cache(reset_connector=True)``, retried after engine steps until vLLM
    has no block held (see ``--reset-connector``); its last answer."""
    for _ in range(20):
        if llm.reset_prefix_cache(reset_connector=True):  # type: ignore[attr-defined]
            return True
        llm.generate(["w1"], one_token, use_tqdm=False)  # type: ignore[attr-defined]
        time.sleep(0.1)
    return False


if __name__ == "__main__":
    sys.exit(main())
