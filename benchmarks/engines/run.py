"""Real vLLM engines on a multi-turn trace: time to first token and throughput, measured.

    .venv-vllm/bin/python -m benchmarks.engines.run [--quick] [--systems cold,emsd,...]
        [--sessions N] [--seed S] [--out DIR] [--plot docs/engines_ttft.png]

Each system serves the same trace (``benchmarks/engines/trace.py``) with two
engine processes one after the other: engine A the first half of the trace,
engine B (a fresh process) the second half, taking over sessions A started.
Every engine first serves one warm-up prompt of its own (not counted): the
first prefill of a vLLM CPU engine pays one-off costs (page faults on its KV
cache, kernel set-up) of about a second, which would otherwise fall on
whichever request happens to come first.

Fair comparisons. Two effects made an engine with a connector look faster or
slower than one without, before the connector did anything (measured here,
3,000-token prompts, 2026-11-25):
- an engine process's first prefill takes 1-1.7 s longer than the next ones
  (one-off set-up), whichever engine it is: every engine here serves a
  warm-up prompt of its own first, which is not counted;
- a pool that is not prefaulted (``pool.prefault = false``) makes the first
  saves into it pay for its page faults: up to +1.4 s on a 3,000-token
  prompt, 0.1-0.3 s on the next few; the daemons here run with the default
  (prefaulted), as a deployment does.
With both out of the way, an engine with ``EmsStoreConnector`` and nothing to
find runs within the noise of one without it (``cost`` in the results).

Systems:
- ``cold``: no connector (vLLM's own prefix cache only, as in every system);
- ``emsd``: ``EmsStoreConnector``, both engines on one emsd node;
- ``emsd-2node``: two emsd nodes of a cluster (ZooKeeper on loopback), engine
  A on one, engine B on the other: B's hits are blocks A saved on the other node;
- ``lmcache``: vLLM's ``LMCacheConnectorV1`` with LMCache's local CPU backend
  (in the engine process: engine B cannot see what A stored). It runs in the
  venv ``.venv-lmvllm`` (``scripts/setup-lmcache-vllm.sh``); where it cannot
  run, the error is reported instead of figures;
- ``offload``: vLLM's own ``OffloadingConnector`` (KV blocks offloaded to CPU
  memory in the engine process), where it runs.

Reported per system: time to first token (p50, p90) of all requests and of
returning sessions, throughput (prompt and generated tokens a second of
serving, the two engines' serving time added), the share of prompt tokens
not computed (``cached``: vLLM's prefix cache plus what the connector
loaded), for emsd its daemons' load hit rate, and whether every output
equals the cold engine's (greedy decoding). ``--lengths`` adds the prompt
length sweep (one prompt per length: cold, then loaded by a second engine),
``--capacities`` the emsd pool size sweep. Results go to ``DIR/engines.json``
and, with ``--plot``, a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks.engines.trace import EngineRequest, distinct_blocks, engine_trace, to_vocab
from benchmarks.workload import daemons

ROOT = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("engine.py")
LMCACHE_VENV = ROOT / ".venv-lmvllm"
BLOCK = 32  # vLLM block size, tokens
# Each engine's own KV cache: 10,240 tokens, room for one long prompt and little else, as on a
# GPU busy with other users' requests, whose prefix cache rarely still holds a session that
# comes back minutes later. ``--engine-blocks 0`` gives vLLM's default (1 GiB here: 32,768 tokens).
ENGINE_BLOCKS = 320
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32
MODEL = {"num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 16384}


# Log lines that mean a connector did not work although the engine served every request.
CONNECTOR_FAILURES = {
    "No supported cpu connector found": "LMCache 0.5.6 moves KV between its buffers and the engine's "
    "only on cuda, xpu, musa and hpu devices (lmcache/v1/gpu_connector: CreateGPUConnector); on a CPU "
    "engine its worker starts without a cache engine and stores and finds nothing",
}


def write_model(path: Path) -> Path:
    """The bench model (random weights, 8 layers, hidden 1024, 8 KV heads), written once."""
    if (path / "model.safetensors").exists():
        return path
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from tiny_model import write_tiny_llama

    return write_tiny_llama(path, **MODEL)


def quick_trace() -> list[EngineRequest]:
    """Three requests for CI: engine A serves a prompt, engine B the same session's next turn
    (found only through an external cache) and a new prompt."""
    first, other = to_vocab(range(10_000, 11_024)), to_vocab(range(20_000, 20_512))
    return [EngineRequest("q0-s0", "A", 0, False, first),
            EngineRequest("q1-s0", "B", 0, True, first + to_vocab(range(30_000, 30_096))),
            EngineRequest("q2-s1", "B", 1, False, other)]


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by linear interpolation; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def warmup_request(engine: str) -> dict[str, Any]:
    """A prompt of the engine's own (never seen again) served first and not counted."""
    seed = 7 if engine == "A" else 11
    return {"id": f"warmup-{engine}", "prompt_token_ids": to_vocab(range(seed * 1000, seed * 1000 + 512)),
            "max_tokens": 2}


@dataclass(frozen=True)
class Bench:
    """What every engine of a run shares: the model, tokens generated a request, own KV blocks."""

    model: Path
    answer_tokens: int = 8
    engine_blocks: int = ENGINE_BLOCKS


def run_engine(work: Path, name: str, bench: Bench, requests: list[dict[str, Any]], connector: str,
               env: dict[str, str], python: str) -> dict[str, Any]:
    """One engine process over ``requests``; its output JSON (raises with the log's tail on failure)."""
    req_file, out, log = work / f"{name}-requests.json", work / f"{name}.json", work / f"{name}.log"
    req_file.write_text(json.dumps(requests))
    cmd = [python, str(ENGINE), "--model", str(bench.model), "--requests", str(req_file), "--out", str(out),
           "--connector", connector, "--engine-blocks", str(bench.engine_blocks)]
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_LOGGING_LEVEL": "INFO", "PYTHONPATH": str(ROOT), **env}
    busy0 = busy_cpu_seconds()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env)
    own = psutil.Process(proc.pid)
    own_cpu = 0.0
    try:
        code, own_cpu = watch(proc, own, log, connector)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        lines = log.read_text(errors="replace").splitlines()
        why = next((ln.split("]: ", 1)[-1] for ln in reversed(lines)
                    if "Error" in ln or "Exception" in ln), "")
        raise RuntimeError(f"engine {name} ({connector}) exited {code}: {why}\n" + "\n".join(lines[-25:]))
    text = log.read_text(errors="replace")
    result = dict(json.loads(out.read_text()))
    result["connector_totals"] = connector_totals(text)
    result["other_cpu_seconds"] = max(0.0, busy_cpu_seconds() - busy0 - own_cpu)
    return result


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (every core, user and system)."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


def watch(proc: subprocess.Popen[bytes], own: psutil.Process, log: Path, connector: str,
          limit: float = 3600.0) -> tuple[int, float]:
    """Wait for the engine's exit; (exit code, CPU seconds it used, as last seen). Raise as soon
    as its log shows that its connector cannot work (``CONNECTOR_FAILURES``), or after ``limit`` s."""
    deadline = time.monotonic() + limit
    cpu = 0.0
    while (code := proc.poll()) is None:
        try:
            t = own.cpu_times()
            cpu = t.user + t.system
        except psutil.Error:
            pass
        text = log.read_text(errors="replace")
        for mark, why in CONNECTOR_FAILURES.items():
            if mark in text:
                raise RuntimeError(f"{connector}: {why} (engine log: {mark!r})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine ({connector}) still running after {limit:.0f} s")
        time.sleep(0.5)
    return code, cpu


def connector_totals(log: str) -> dict[str, int]:
    """The counters EmsStoreConnector logs when its engine shuts down (empty without it)."""
    mark = "EmsStoreConnector worker totals: "
    for line in reversed(log.splitlines()):
        if mark in line:
            return {k: int(v) for k, v in json.loads(line.split(mark, 1)[1]).items()}
    return {}


def summarise(trace: list[EngineRequest], served: dict[str, dict[str, Any]],
              baseline: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """TTFT percentiles, throughput, cached share and output equality of one system's run."""
    rows = [served[r.id] for r in trace]
    returning = [served[r.id]["ttft"] for r in trace if r.returning]
    tokens = sum(x["prompt_tokens"] + len(x["token_ids"]) for x in rows)
    seconds = sum(x["e2e"] for x in rows)
    equal = None if baseline is None else all(served[k]["token_ids"] == baseline[k]["token_ids"]
                                              for k in baseline)
    return {"ttft_p50": percentile([x["ttft"] for x in rows], 0.5),
            "ttft_p90": percentile([x["ttft"] for x in rows], 0.9),
            "returning_ttft_p50": percentile(returning, 0.5),
            "returning_ttft_p90": percentile(returning, 0.9),
            "throughput_tok_s": tokens / seconds if seconds else float("nan"),
            "cached_share": sum(x["cached_tokens"] for x in rows) / sum(x["prompt_tokens"] for x in rows),
            "outputs_equal": equal, "requests": len(rows)}


class Emsd:
    """emsd daemons for one system (1 node, or 2 of a cluster on a ZooKeeper of their own)."""

    def __init__(self, nodes: int, pool: int) -> None:
        # a short directory of its own: socket paths must stay under the 108 bytes of a Unix address
        self.work = Path(tempfile.mkdtemp(prefix="emsd-engines-"))
        work = self.work
        page = 4 * BLOCK * KV_BYTES_PER_TOKEN  # slab pages of 4 KV blocks
        try:
            self.dep = daemons.start(work, nodes, pool, "prefix", grants=True, page=page, name="engines",
                                     prefault=True)  # the daemon's default; see "Fair comparisons" above
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise

    def env(self, i: int) -> dict[str, str]:
        return {"EMS_SOCKET_DIR": str(self.dep.nodes[i % len(self.dep.nodes)].sock)}

    def stop(self) -> None:
        self.dep.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def serve_trace(work: Path, bench: Bench, trace: list[EngineRequest], system: str,
                pool: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Engines A then B of ``system`` over the trace; (request id -> result, extras)."""
    work.mkdir(parents=True, exist_ok=True)
    nodes = {"emsd": 1, "emsd-2node": 2}.get(system, 0)
    emsd = Emsd(nodes, pool) if nodes else None
    connector = "emsd" if nodes else (system if system in ("lmcache", "offload") else "none")
    python = sys.executable
    if system == "lmcache":
        python = str(LMCACHE_VENV / "bin" / "python")
        if not Path(python).exists():
            raise RuntimeError(f"{python} is missing: run scripts/setup-lmcache-vllm.sh")
    env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(max(1, pool >> 30)),
           "LMCACHE_CHUNK_SIZE": str(BLOCK * 8)} if system == "lmcache" else {}
    served: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {"init_seconds": [], "loaded_blocks": 0, "other_cpu_seconds": 0.0}
    try:
        for i, engine in enumerate(("A", "B")):
            reqs = [warmup_request(engine)] + [r.as_json(bench.answer_tokens) for r in trace
                                               if r.engine == engine]
            out = run_engine(work, f"{system}-{engine}", bench, reqs, connector,
                             {**env, **(emsd.env(i) if emsd else {})}, python)
            extras["init_seconds"].append(out["init_seconds"])
            extras["loaded_blocks"] += out["connector_totals"].get("loaded_blocks", 0)
            extras["other_cpu_seconds"] += out["other_cpu_seconds"]
            served |= {x["id"]: x for x in out["requests"] if not x["id"].startswith("warmup")}
            print(f"[engines] {system}: engine {engine} served {len(reqs) - 1} requests", flush=True)
        if emsd is not None:  # share of the trace's prompt tokens that emsd supplied
            extras["emsd_hit_rate"] = extras["loaded_blocks"] * BLOCK / sum(len(r.prompt) for r in trace)
    finally:
        if emsd is not None:
            emsd.stop()
    return served, extras


def length_sweep(work: Path, bench: Bench, lengths: list[int], systems: list[str],
                 pool: int) -> dict[str, Any]:
    """TTFT of one prompt per length: the cold engine's, and a second engine's after a first
    engine saved it (emsd, lmcache)."""
    out: dict[str, Any] = {"lengths": lengths}
    prompts = [to_vocab(range(n * 3, n * 4)) for n in lengths]
    trace = [EngineRequest(f"len{n}", "A", i, False, p) for i, (n, p) in enumerate(zip(lengths, prompts,
                                                                                       strict=True))]
    trace += [EngineRequest(f"len{n}-again", "B", i, True, p) for i, (n, p) in enumerate(zip(lengths, prompts,
                                                                                             strict=True))]
    for system in systems:
        try:
            served, _ = serve_trace(work / f"len-{system}", bench, trace, system, pool)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            out[system] = {"error": str(e)}
            continue
        out[system] = {"first": [served[f"len{n}"]["ttft"] for n in lengths],
                       "again": [served[f"len{n}-again"]["ttft"] for n in lengths]}
    return out


def connector_cost(work: Path, bench: Bench, lengths: list[int], pool: int) -> dict[str, Any]:
    """With nothing to find: the same new prompts through an engine without a connector and
    one with EmsStoreConnector on an empty emsd (after each engine's warm-up)."""
    prompts = [to_vocab(range(n * 5 + 1, n * 6 + 1)) for n in lengths]
    trace = [EngineRequest(f"new{n}", "A", i, False, p) for i, (n, p) in enumerate(zip(lengths, prompts,
                                                                                       strict=True))]
    res: dict[str, Any] = {"lengths": lengths}
    for system in ("cold", "emsd"):
        served, _ = serve_trace(work / f"cost-{system}", bench, trace, system, pool)
        res[system] = [served[r.id]["ttft"] for r in trace]
    res["ratio"] = [e / c for e, c in zip(res["emsd"], res["cold"], strict=True)]
    return res


def fmt(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


def report(results: dict[str, Any]) -> str:
    """Markdown tables of a run."""
    lines = ["| system | TTFT p50 s | TTFT p90 s | returning p50 s | returning p90 s | tokens/s | cached | "
             "from emsd | outputs equal | CPU s outside the engines |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in results["systems"].items():
        if "error" in s:
            lines.append(f"| {name} | error: {s['error'].splitlines()[0][:160]} | | | | | | | | |")
            continue
        lines.append(f"| {name} | {fmt(s['ttft_p50'])} | {fmt(s['ttft_p90'])} "
                     f"| {fmt(s['returning_ttft_p50'])} | {fmt(s['returning_ttft_p90'])} "
                     f"| {s['throughput_tok_s']:.0f} | {s['cached_share']:.2f} "
                     f"| {fmt(s.get('emsd_hit_rate'))} | {s['outputs_equal']} "
                     f"| {s['other_cpu_seconds']:.0f} |")
    cold = results["systems"].get("cold")
    if cold and "error" not in cold:
        for name, s in results["systems"].items():
            if name != "cold" and "error" not in s:
                lines.append(f"\n{name} against cold: returning TTFT p50 "
                             f"{s['returning_ttft_p50'] / cold['returning_ttft_p50']:.3f}x, throughput "
                             f"{s['throughput_tok_s'] / cold['throughput_tok_s']:.2f}x")
    if "cost" in results:
        c = results["cost"]
        lines.append("\nWith nothing to find (TTFT s, cold engine / with EmsStoreConnector, ratio): "
                     + ", ".join(f"{n}: {a:.3f} / {b:.3f} ({r:.3f}x)"
                                 for n, a, b, r in zip(c["lengths"], c["cold"], c["emsd"], c["ratio"],
                                                       strict=True)))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """TTFT against prompt length (cold, loaded by emsd, LMCache) and against emsd capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sweep = results.get("lengths", {})
    ax = axes[0]
    for system, style in (("cold", "o-"), ("emsd", "s-"), ("lmcache", "^-")):
        s = sweep.get(system)
        if not s or "error" in s:
            continue
        if system == "cold":
            ax.plot(sweep["lengths"], s["first"], style, label="cold (no connector)")
        else:
            ax.plot(sweep["lengths"], s["again"], style, label=f"{system}: a second engine loads it")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s")
    ax.set_yscale("log")
    ax.set_title("TTFT against prompt length")
    ax.legend()
    cap = results.get("capacities", {})
    ax = axes[1]
    if cap:
        ax.plot([100 * f for f in cap["fractions"]], cap["returning_ttft_p50"], "s-",
                label="emsd, returning p50")
        ax.axhline(cap["cold_returning_ttft_p50"], color="gray", ls="--", label="cold, returning p50")
        ax.set_xlabel("emsd pool, % of the trace's distinct KV blocks")
        ax.set_ylabel("time to first token, s")
        ax.set_title("TTFT against cache capacity")
        ax.legend()
    fig.suptitle(f"vLLM (CPU) on a multi-turn trace, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few short requests (CI)")
    ap.add_argument("--systems", default="cold,emsd,emsd-2node,lmcache,offload")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--lengths", default="1024,2048,4096,8192", help="'' skips the length sweep")
    ap.add_argument("--capacities", default="0.1,0.25,0.5,1.0",
                    help="emsd pool sizes as shares of the trace's distinct KV blocks ('' skips the sweep)")
    ap.add_argument("--engine-blocks", type=int, default=ENGINE_BLOCKS,
                    help="KV blocks of each engine's own cache (0: vLLM's default)")
    ap.add_argument("--out", default="benchmarks/engines/out")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(write_model(work / "model"), args.answer_tokens, args.engine_blocks)
    systems = [s for s in args.systems.split(",") if s]
    if args.quick:
        trace = quick_trace()
        args.lengths, args.capacities = "", ""
    else:
        trace = engine_trace(args.sessions, args.seed)
    kv_bytes = distinct_blocks(trace, BLOCK) * BLOCK * KV_BYTES_PER_TOKEN  # all the trace could reuse
    pool = max(256 << 20, 2 * kv_bytes)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "trace": {
        "requests": len(trace), "prompt_tokens": sum(len(r.prompt) for r in trace),
        "returning": sum(r.returning for r in trace), "kv_bytes": kv_bytes}, "systems": {}}
    print(f"[engines] trace: {results['trace']}", flush=True)
    baseline = None
    for system in systems:
        t0 = time.monotonic()
        try:
            served, extras = serve_trace(work / system, bench, trace, system, pool)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            results["systems"][system] = {"error": str(e)}
            print(f"[engines] {system}: failed: {e}", flush=True)
            continue
        if system == "cold":
            baseline = served
        results["systems"][system] = summarise(trace, served, baseline) | extras
        print(f"[engines] {system}: {time.monotonic() - t0:.0f} s, {results['systems'][system]}", flush=True)
    if not args.quick:
        results["cost"] = connector_cost(work, bench, [1024, 2048, 4096], pool)
    if args.lengths:
        results["lengths"] = length_sweep(work, bench, [int(x) for x in args.lengths.split(",")],
                                          [s for s in ("cold", "emsd", "lmcache") if s in systems], 1 << 30)
    if args.capacities and "emsd" in systems and "cold" in results["systems"]:
        fracs = [float(x) for x in args.capacities.split(",")]
        rows = []
        for f in fracs:
            served, _ = serve_trace(work / f"cap-{f}", bench, trace, "emsd", max(32 << 20, int(f * kv_bytes)))
            rows.append(summarise(trace, served, baseline)["returning_ttft_p50"])
        results["capacities"] = {"fractions": fracs, "returning_ttft_p50": rows,
                                 "cold_returning_ttft_p50": results["systems"]["cold"]["returning_ttft_p50"]}
    (work / "engines.json").write_text(json.dumps(results, indent=1))
    print(report(results))
    if args.plot:
        plot(results, Path(args.plot))
        print(f"[engines] plot: {args.plot}")
    bad = [s for s, r in results["systems"].items() if r.get("outputs_equal") is False]
    if bad:
        sys.exit(f"[engines] outputs differ from the cold engine's: {', '.join(bad)}")


if __name__ == "__main__":
    main()
