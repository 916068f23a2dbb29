"""``ContextCaching.clear`` (DROP) against a real daemon: nothing of the namespace is found
afterwards, by this connection or another, and a restart does not bring it back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ems import CcConfig, Ems, EmsConfig
from ems.client import DaemonClient
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import CountAnswer, ExistsRequest, PinAnswer, PinRequest
from emsd.transport.frames import Op
from tests.messages import called, namespace_id

BLOCKS, TOKENS = 8, 4
SLOTS = list(range(BLOCKS * TOKENS))
KEYS = [500 + k for k in range(BLOCKS)]


def connect(d: Any, monkeypatch: pytest.MonkeyPatch, fill: float) -> tuple[Any, list[list[torch.Tensor]]]:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="drop")))
    cc = Ems.get_cc()
    kv = [[torch.full((BLOCKS, TOKENS, 4, 16), fill) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(kv)
    return cc, kv


def raw_session(d: Any, name: str) -> tuple[DaemonClient, int]:
    """A second connection, as another engine process, with the namespace open."""
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    return client, namespace_id(client, name)


def raw_exists(client: DaemonClient, ns: int) -> int:
    exists = ExistsRequest(ns, KeyBatch.from_user(KEYS))
    return CountAnswer.decode(*called(client, Op.EXISTS, exists), BLOCKS).held


def test_clear_hides_the_namespace_from_every_connection_and_saves_store_afresh(
        emsd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cc, kv = connect(emsd, monkeypatch, 1.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[TOKENS] * BLOCKS).success == BLOCKS
    other, ns = raw_session(emsd, cc._namespace)
    assert raw_exists(other, ns) == BLOCKS

    assert cc.clear() == BLOCKS
    assert cc.exists(KEYS).success == 0 and raw_exists(other, ns) == 0
    for layer in kv:
        for t in layer:
            t.fill_(-1.0)
    assert cc.load(SLOTS, hashes=KEYS, offsets=[TOKENS] * BLOCKS).success == 0
    assert all(bool((t == -1.0).all()) for layer in kv for t in layer)  # a miss writes nothing

    for layer in kv:
        for t in layer:
            t.fill_(2.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[TOKENS] * BLOCKS).success == BLOCKS  # stored afresh
    assert raw_exists(other, ns) == BLOCKS  # the old id now names the new namespace
    for layer in kv:
        for t in layer:
            t.zero_()
    assert cc.load(SLOTS, hashes=KEYS, offsets=[TOKENS] * BLOCKS).success == BLOCKS
    assert all(bool((t == 2.0).all()) for layer in kv for t in layer)
    assert emsd.metric("emsd_pool_evictions_total", 'reason="dropped"') == BLOCKS
    other.close()
    Ems._reset()


def test_blocks_pinned_through_a_clear_do_not_come_back_after_kill_9_and_restart(
        emsd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cc, _ = connect(emsd, monkeypatch, 3.0)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[TOKENS] * BLOCKS).success == BLOCKS
    reader, ns = raw_session(emsd, cc._namespace)
    pinned = PinAnswer.decode(*called(reader, Op.PIN, PinRequest(ns, KeyBatch.from_user(KEYS))), BLOCKS)
    assert len(pinned.handles) == BLOCKS  # a load in flight holds them
    assert cc.clear() == 0  # nothing could be evicted yet; all of it is hidden
    assert cc.exists(KEYS).success == 0
    Ems._reset()
    reader.close()
    emsd.kill9()
    emsd.start()
    assert "warm restart: attached" in emsd.log()
    assert "blocks of dropped namespaces evicted" in emsd.log(), emsd.log()
    cc, _ = connect(emsd, monkeypatch, 0.0)
    assert cc.exists(KEYS).success == 0
    Ems._reset()
