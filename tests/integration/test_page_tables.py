"""Which SDK connections fill their page tables for the pool (``DaemonClient.populate``).

Every connection maps the whole pool. One that copies (it has registered a KV
cache) fills its page tables for it in the background, so that its copies do
not fault on every 4 KiB page; one that only asks (``exists``, as a vLLM
scheduler's connection does) never does: on 4 KiB pages that would cost it
about 0.2 s of CPU and 2 MiB of kernel memory per GiB of pool for nothing.
What is observed is the kernel's own account: the resident size of the pool's
mapping in this process (``/proc/self/smaps``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from ems import CcConfig, Ems, EmsConfig
from ems.common.exception import EmsException

POOL = 64 << 20
BLOCKS, TOKENS = 4, 4


def mapped_bytes(address: int) -> int:
    """Bytes of the mapping that starts at ``address`` present in this process's page tables."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                found = int(first.split("-")[0], 16) == address
            elif found and first == "Rss:":
                return int(line.split()[1]) << 10
    raise AssertionError(f"no mapping at {address:#x}")


def wait_mapped(address: int, at_least: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (got := mapped_bytes(address)) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.fixture(autouse=True)
def _reset() -> Any:
    Ems._reset()
    yield
    Ems._reset()


def test_a_connection_that_only_asks_maps_the_pool_without_filling_its_page_tables(
        emsd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(emsd.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="asks")))
    cc = Ems.get_cc()
    client = Ems._client
    assert client is not None and client.pool_size == POOL
    assert cc.exists([1, 2, 3]).success == 0
    time.sleep(0.3)  # the fill, were one started, maps 64 MiB in a few milliseconds
    assert mapped_bytes(client.pool_addr) < POOL // 16

    kv = [[torch.zeros((BLOCKS, TOKENS, 16, 64)) for _ in range(2)]]
    cc.register_kvcache(kv)  # now it copies: the fill starts
    assert wait_mapped(client.pool_addr, POOL) == POOL
    slots, keys = list(range(BLOCKS * TOKENS)), [10 + k for k in range(BLOCKS)]
    assert cc.save(slots, hashes=keys, offsets=[TOKENS] * BLOCKS).success == BLOCKS
    assert cc.exists(keys).success == BLOCKS


def test_a_new_connection_after_a_restart_fills_its_page_tables_again(
        emsd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(emsd.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="copies")))
    cc = Ems.get_cc()
    cc.register_kvcache([[torch.zeros((BLOCKS, TOKENS, 16, 64)) for _ in range(2)]])
    first = Ems._client
    assert first is not None and wait_mapped(first.pool_addr, POOL) == POOL

    emsd.kill9()
    emsd.start()
    slots, keys = list(range(BLOCKS * TOKENS)), [20 + k for k in range(BLOCKS)]

    def saved() -> bool:
        try:
            return bool(cc.save(slots, hashes=keys, offsets=[TOKENS] * BLOCKS).success == BLOCKS)
        except EmsException:  # the old connection's end, or emsd still starting
            return False

    deadline = time.monotonic() + 30
    while not saved():
        assert time.monotonic() < deadline, "the SDK never reconnected"
        time.sleep(0.2)
    second = Ems._client
    assert second is not None and second is not first
    assert wait_mapped(second.pool_addr, POOL) == POOL


def test_wait_populated_returns_once_the_fill_has_ended(emsd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(emsd.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="waits")))
    cc = Ems.get_cc()
    client = Ems._client
    assert client is not None
    assert client.wait_populated(0)  # nothing started: nothing to wait for
    assert mapped_bytes(client.pool_addr) < POOL // 16
    cc.register_kvcache([[torch.zeros((BLOCKS, TOKENS, 16, 64)) for _ in range(2)]])
    assert client.wait_populated(30)
    assert mapped_bytes(client.pool_addr) == POOL  # at once: no waiting for it here
