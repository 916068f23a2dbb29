"""The real-engine benchmark (benchmarks/engines) in its quick mode, so that it cannot rot.

Three requests through two engine processes per system: engine A serves a
prompt and generates an answer, engine B the same session's next turn (A's
prompt and answer, then new tokens) and a new prompt. Checked: every
system's outputs equal the cold engine's token for token; with emsd (one
node, and two nodes of a cluster with engine B on the other node) engine B
loads engine A's blocks from emsd, the block of A's answer too; vLLM's own
MooncakeStoreConnector on a Mooncake Store (its venv, .venv-mcvllm) gives the
same outputs and engine B finds A's prompt in it; so do LMCache's own
``LMCacheConnectorV1`` with LMCache's storage server (its venv, .venv-lmvllm,
set up by scripts/test-vllm.sh), with the CPU copy the benchmark gives LMCache
0.5.6 (benchmarks/engines/lmcache_cpu.py). emsd's copy of every block left in
an engine's prefix cache equals the engine's own, byte for byte, with one
request at a time and with two at once, and emsd's engines compute nothing
that a cache holding every block computed before could have supplied. No
timing is asserted: the figures are the benchmark's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.engines.run import QUICK_ANSWER, QUICK_PROMPT

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_quick_run_loads_across_engines_and_nodes_with_equal_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "benchmarks.engines.run", "--quick", "--out", str(out),
                          "--systems", "cold,emsd,emsd-2node,mooncake,lmcache-server",
                          "--plot", str(tmp_path / "p.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "engines.json").read_text())
    systems = res["systems"]
    assert set(systems) == {"cold", "emsd", "emsd-2node", "mooncake", "lmcache-server"}
    assert all("error" not in s for s in systems.values()), {k: s.get("error") for k, s in systems.items()}
    assert systems["cold"]["requests"] == 3
    for name in ("emsd", "emsd-2node", "mooncake", "lmcache-server"):
        assert systems[name]["outputs_equal"] is True, name
    # B's returning request is A's prompt (QUICK_PROMPT tokens), A's answer (48 generated: KV of 47) and
    # 96 new tokens: it finds A's prompt and the whole block of A's answer, a decode block.
    blocks_of_a = (QUICK_PROMPT + QUICK_ANSWER - 1) // 32
    for name in ("emsd", "emsd-2node"):
        assert systems[name]["loaded_blocks"] >= blocks_of_a, systems[name]
        check = systems[name]["saved_check"]  # emsd's copies of the engines' cached blocks, byte for byte
        assert check["blocks"] >= blocks_of_a and check["equal"] == check["blocks"], check
        assert systems[name]["below_ceiling"] == [], systems[name]  # found all any cache could supply
    assert systems["cold"]["below_ceiling"] == ["q1-s0"]  # its engine B holds none of A's blocks
    assert systems["cold"]["loaded_blocks"] == 0
    # Mooncake and LMCache: engine B, a process of its own, computes none of A's prompt tokens (its
    # own prefix cache holds none of them; the cold engine's B computes them all)
    cached = {k: systems[k]["cached_share"] * systems[k]["prompt_tokens"]
              for k in ("cold", "mooncake", "lmcache-server")}
    assert cached["cold"] == 0, cached
    assert cached["mooncake"] >= QUICK_PROMPT and cached["lmcache-server"] >= QUICK_PROMPT, cached
    assert (tmp_path / "p.png").stat().st_size > 0


def test_quick_run_with_requests_at_once_loads_and_stores_the_engines_bytes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "benchmarks.engines.run", "--quick", "--concurrency", "2",
                          "--out", str(out), "--systems", "cold,emsd"],
                         cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "engines.json").read_text())
    assert res["concurrency"] == 2
    emsd = res["systems"]["emsd"]
    assert emsd["requests"] == 3 and emsd["loaded_blocks"] >= (QUICK_PROMPT + QUICK_ANSWER - 1) // 32, emsd
    check = emsd["saved_check"]
    assert check["blocks"] > 0 and check["equal"] == check["blocks"], check
