"""Per-block checksums (``pool.checksum``): a block whose bytes changed in the pool is a miss.

The pool is shared memory every client maps writable. The test changes one
byte of a committed block behind the daemon's back (through the pool's memfd, as the keeper hands it out)
and loads: with checksums the load stops before that block and the block is
dropped; without them the changed bytes are served (which shows the test's
corruption really lands in the block).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ems import CcConfig, Ems, EmsConfig
from emsd.pool import keeper

N, TOKENS = 4, 4
KEYS = [11, 12, 13, 14]
SLOTS = list(range(N * TOKENS))


def value(key: int) -> float:
    return float(key * 10 + 1)


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def connect(d: Any) -> Any:
        monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
        Ems._reset()
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="sums")))
        return Ems.get_cc()

    yield connect
    Ems._reset()


def kv() -> list[list[torch.Tensor]]:
    return [[torch.zeros(N, TOKENS, 16, 32) for _ in range(2)]]


def save(cc: Any) -> int:
    cache = kv()
    for i, key in enumerate(KEYS):
        for t in cache[0]:
            t[i].fill_(value(key))
    cc.register_kvcache(cache)
    return int(cc.save(SLOTS, hashes=KEYS, offsets=[TOKENS] * N).success)


def load(cc: Any) -> tuple[int, list[bool]]:
    """(blocks loaded, per loaded block: every byte is its key's value)."""
    cache = [[torch.full((N, TOKENS, 16, 32), -1.0) for _ in range(2)]]
    cc.register_kvcache(cache)
    got = int(cc.load(SLOTS, hashes=KEYS, offsets=[TOKENS] * N).success)
    return got, [all(bool((t[i] == value(KEYS[i])).all()) for t in cache[0]) for i in range(got)]


def corrupt(d: Any, key: int) -> None:
    """Change one byte in the middle of ``key``'s block, found in the pool by its pattern."""
    fd = keeper.fetch(next(Path(d.sections["pool"]["state_dir"]).glob("*.keeper")))
    assert fd is not None, "the keeper holds no pool"
    pattern = struct.pack("<f", value(key)) * (TOKENS * 16 * 32)  # one tensor's part of the block
    try:
        with mmap.mmap(fd, 0) as mm:
            at = mm.find(pattern)
            assert at >= 0, "block not found in the pool"
            mm[at + len(pattern) // 2] ^= 0xFF
    finally:
        os.close(fd)


def test_a_changed_block_is_a_miss_and_dropped_never_served(emsd_factory: Any, sdk: Any) -> None:
    d = emsd_factory(pool={"size": "16MiB", "checksum": True})
    cc = sdk(d)
    assert save(cc) == N
    assert load(cc) == (N, [True] * N)
    corrupt(d, KEYS[2])
    assert load(cc) == (2, [True, True])  # stops before the changed block
    assert d.metric("emsd_pool_evictions_total", 'reason="corrupt"') == 1
    assert load(cc) == (2, [True, True])  # the block is gone: a plain miss now
    assert save(cc) == N  # saved again, it loads again
    assert load(cc) == (N, [True] * N)
    assert d.alive()


def test_without_checksums_the_changed_bytes_are_served(emsd_factory: Any, sdk: Any) -> None:
    d = emsd_factory(pool={"size": "16MiB"})
    cc = sdk(d)
    assert save(cc) == N
    corrupt(d, KEYS[2])
    assert load(cc) == (N, [True, True, False, True])


def test_checksums_survive_a_warm_restart(emsd_factory: Any, sdk: Any) -> None:
    d = emsd_factory(pool={"size": "16MiB", "checksum": True})
    cc = sdk(d)
    assert save(cc) == N
    Ems._reset()
    d.kill9()
    d.start()
    cc = sdk(d)
    assert load(cc) == (N, [True] * N)  # restored with their digests
    corrupt(d, KEYS[1])
    assert load(cc) == (1, [True])
