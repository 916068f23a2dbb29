"""Warm restart: a daemon killed with -9 in the middle of saves and loads comes back with its blocks.

The pool and its ledger are files in the state directory (here the test's
socket directory); a restarted daemon maps them again and re-indexes what
was committed. Every block a writer process saved carries its batch number
in every byte, so a half-written or misplaced block cannot pass for a good one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ems import CcConfig, Ems, EmsConfig
from ems.client import DaemonClient
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import (
    CommitAnswer,
    CommitRequest,
    CountAnswer,
    ExistsRequest,
    ReserveAnswer,
    ReserveRequest,
)
from emsd.transport.frames import Op
from tests.messages import called, namespace_id

BLOCKS, TOKENS = 32, 4
WRITER = textwrap.dedent("""
    import sys, torch
    from ems import Ems, EmsConfig, CcConfig, EmsException
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="warm")))
    cc = Ems.get_cc()
    kv = [[torch.zeros(32, 4, 16, 32) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    slots = list(range(32 * 4))
    print("ready", flush=True)
    batch = 0
    while True:
        batch += 1
        for layer in kv:
            for t in layer:
                t.fill_(float(batch))
        try:
            cc.save(slots, hashes=[batch * 1000 + k for k in range(32)], offsets=[4] * 32)
            cc.load(slots, hashes=[1000 + k for k in range(32)], offsets=[4] * 32)
        except EmsException:
            sys.exit(0)  # the daemon is gone
""")


def stats(d: Any) -> dict[str, Any]:
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        return client.call(Op.STATS, {}, timeout=5)[0]
    finally:
        client.close()


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def connect(d: Any) -> Any:
        monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
        Ems._reset()
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="warm")))
        cc = Ems.get_cc()
        cc.register_kvcache([[torch.zeros(BLOCKS, TOKENS, 16, 32) for _ in range(2)] for _ in range(2)])
        return cc

    yield connect
    Ems._reset()


def saves(d: Any) -> float:
    """Saves the daemon has committed: by COMMIT, or by PUT into granted chunks."""
    return sum(d.metric("emsd_ops_total", f'op="{op}",result="ok"') for op in ("commit", "put"))


def batch_in_pool(cc: Any, batch: int) -> tuple[int, bool]:
    """(blocks of ``batch`` that load, whether each of them holds exactly its batch number)."""
    kv = [[torch.full((BLOCKS, TOKENS, 16, 32), -1.0) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    res = cc.load(list(range(BLOCKS * TOKENS)), hashes=[batch * 1000 + k for k in range(BLOCKS)],
                  offsets=[TOKENS] * BLOCKS)
    loaded = [t[: res.success] for layer in kv for t in layer]
    return res.success, all(bool((t == float(batch)).all()) for t in loaded)


def test_kill_9_mid_saves_and_loads_then_restart_serves_every_committed_block(
        emsd_factory: Any, sdk: Any) -> None:
    d = emsd_factory(pool={"size": "128MiB", "page_size": "8MiB"})
    env = {**os.environ, "EMS_SOCKET_DIR": str(d.socket_dir)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while saves(d) < 20:  # saves and loads under way
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.01)
    committed_before = saves(d)
    d.kill9()
    writer.communicate(timeout=30)

    d.start()
    assert "warm restart: attached" in d.log(), d.log()
    st = stats(d)
    assert st["pending"] == 0 and st["pinned"] == 0  # nothing half-written or held survives
    cc = sdk(d)
    complete = 0
    for batch in range(1, int(committed_before) + 3):
        got, exact = batch_in_pool(cc, batch)
        assert exact, f"batch {batch}: wrong bytes after the restart"
        complete += got == BLOCKS
    assert complete >= committed_before - 1  # every committed save (the last may have been cut)
    assert st["entries"] >= complete * BLOCKS


def test_a_clean_restart_keeps_everything_and_an_incompatible_ledger_starts_empty(
        emsd_factory: Any, sdk: Any) -> None:
    d = emsd_factory(pool={"size": "64MiB", "page_size": "8MiB"})
    cc = sdk(d)
    kv = [[torch.full((BLOCKS, TOKENS, 16, 32), 7.0) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    assert cc.save(list(range(BLOCKS * TOKENS)), hashes=[7000 + k for k in range(BLOCKS)],
                   offsets=[TOKENS] * BLOCKS).success == BLOCKS
    Ems._reset()
    assert d.terminate() == 0
    d.start()
    assert "warm restart: attached; 32 blocks restored" in d.log(), d.log()
    assert batch_in_pool(sdk(d), 7) == (BLOCKS, True)
    Ems._reset()
    assert d.terminate() == 0

    ledger = next(Path(d.sections["pool"]["state_dir"]).glob("*.ledger"))
    raw = bytearray(ledger.read_bytes())
    raw[8] ^= 0xFF  # another format version
    ledger.write_bytes(bytes(raw))
    d.start()
    assert "warm restart: rebuilt: ledger format" in d.log(), d.log()
    assert batch_in_pool(sdk(d), 7)[0] == 0  # never served from a ledger it cannot read
    Ems._reset()

    d.sections["pool"]["warm_restart"] = False
    assert d.terminate() == 0
    d.start()
    assert batch_in_pool(sdk(d), 7)[0] == 0 and stats(d)["entries"] == 0


def test_the_sdk_reconnects_on_its_own_after_a_restart_and_fails_fast_meanwhile(
        emsd_factory: Any, sdk: Any) -> None:
    from ems import EmsErrorCode, EmsException

    d = emsd_factory(pool={"size": "64MiB", "page_size": "8MiB"})
    cc = sdk(d)
    kv = [[torch.full((BLOCKS, TOKENS, 16, 32), 3.0) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    slots, keys = list(range(BLOCKS * TOKENS)), [3000 + k for k in range(BLOCKS)]
    assert cc.save(slots, hashes=keys, offsets=[TOKENS] * BLOCKS).success == BLOCKS
    d.kill9()
    for _ in range(3):  # the daemon is away: every call fails at once, none hangs
        t0 = time.monotonic()
        with pytest.raises(EmsException) as err:
            cc.exists(keys)
        assert err.value.status_code() == EmsErrorCode.EMS_IO_ERROR and time.monotonic() - t0 < 1.5
    d.start()
    deadline = time.monotonic() + 10
    while True:  # no Ems.init() from the caller: the SDK reconnects by itself
        try:
            assert cc.exists(keys).success == BLOCKS
            break
        except EmsException:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert batch_in_pool(cc, 3) == (BLOCKS, True)
    assert cc.save(slots, hashes=[k + 1 for k in keys], offsets=[TOKENS] * BLOCKS).success == BLOCKS


def test_a_second_daemon_on_the_same_pool_files_is_refused_and_leaves_them_alone(
        emsd_factory: Any, sdk: Any) -> None:
    a = emsd_factory()
    cc = sdk(a)
    kv = [[torch.full((BLOCKS, TOKENS, 16, 32), 7.0) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    assert cc.save(list(range(BLOCKS * TOKENS)), hashes=[7000 + k for k in range(BLOCKS)],
                   offsets=[TOKENS] * BLOCKS).success == BLOCKS
    for size in (a.sections["pool"]["size"], "128MiB"):  # the same pool, and one of another size
        twin = emsd_factory(start=False, node={"id": a.sections["node"]["id"]},
                            pool={"state_dir": a.sections["pool"]["state_dir"], "size": size})
        twin.start(wait=False)
        assert twin.proc.wait(60) == 2, twin.log()
        assert "another emsd" in twin.log()
    assert a.alive()
    assert batch_in_pool(cc, 7) == (BLOCKS, True)


def test_a_namespace_past_the_4096th_and_a_long_name_survive_kill_9(emsd_factory: Any, sdk: Any) -> None:
    """The ledger's names log (format 3) keeps any namespace id and name: before it, ids past
    4,095 and names over 254 bytes lost their blocks at a restart."""
    d = emsd_factory(tenants={"max_namespaces": 8192})
    clients = [DaemonClient(d.socket_dir / "emsd.sock") for _ in range(5)]
    for c in clients:
        c.connect({})
    for i in range(4100):  # 1,024 a connection at most (an error answer raises)
        namespace_id(clients[i // 1000], f"filler-{i}")
    ns = namespace_id(clients[4], "L" * 3000)
    cc = sdk(d)  # the SDK's namespace gets an id past 4,096
    kv = [[torch.full((BLOCKS, TOKENS, 16, 32), 5.0) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    assert cc.save(list(range(BLOCKS * TOKENS)), hashes=[5000 + k for k in range(BLOCKS)],
                   offsets=[TOKENS] * BLOCKS).success == BLOCKS
    reserve = ReserveRequest(ns, KeyBatch.from_user([7]), np.full(1, 4096, np.uint64))
    handles = ReserveAnswer.decode(*called(clients[4], Op.RESERVE, reserve), 1).handles
    assert CommitAnswer.decode(*called(clients[4], Op.COMMIT, CommitRequest(handles)), 1).committed == 1
    for c in clients:
        c.close()
    assert stats(d)["namespaces"] >= 4102

    d.kill9()
    d.start()
    assert stats(d)["restored"] == BLOCKS + 1
    assert batch_in_pool(sdk(d), 5) == (BLOCKS, True)
    again = DaemonClient(d.socket_dir / "emsd.sock")
    again.connect({})
    try:
        exists = ExistsRequest(namespace_id(again, "L" * 3000), KeyBatch.from_user([7]), lo=True)
        assert CountAnswer.decode(*called(again, Op.EXISTS, exists), 1).held == 1
    finally:
        again.close()
