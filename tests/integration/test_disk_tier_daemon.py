"""The disk tier against real daemons: blocks evicted from DRAM go to disk and load back,
exists counts them, drop removes them, a reboot (kill -9, page cache dropped, pool files gone)
keeps them, and a disk that fails or fills leaves the daemon serving from DRAM.

The tier's directory is under /var/tmp (a real file system: /dev/shm is DRAM)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ems import CcConfig, Ems, EmsConfig

BLOCKS, TOKENS = 32, 4  # a batch: 32 blocks of 4 tokens, 32 KiB each (2 layers x K, V)
POOL = {"size": "16MiB", "page_size": "1MiB"}


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    base = os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="emsd-disk-it-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def connect(d: Any) -> Any:
        monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
        Ems._reset()
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="disk")))
        return Ems.get_cc()

    yield connect
    Ems._reset()


def _kv(fill: float) -> list[list[torch.Tensor]]:
    return [[torch.full((BLOCKS, TOKENS, 16, 32), fill) for _ in range(2)] for _ in range(2)]


def _keys(batch: int) -> list[int]:
    return [batch * 1000 + k for k in range(BLOCKS)]


def save(cc: Any, batch: int) -> int:
    cc.register_kvcache(_kv(float(batch)))
    return int(cc.save(list(range(BLOCKS * TOKENS)), hashes=_keys(batch), offsets=[TOKENS] * BLOCKS).success)


def load(cc: Any, batch: int) -> tuple[int, bool]:
    """(blocks of ``batch`` loaded, whether every loaded block holds exactly its batch number)."""
    kv = _kv(-1.0)
    cc.register_kvcache(kv)
    got = int(cc.load(list(range(BLOCKS * TOKENS)), hashes=_keys(batch), offsets=[TOKENS] * BLOCKS).success)
    return got, all(bool((t[:got] == float(batch)).all()) for layer in kv for t in layer)


def fill(cc: Any, batches: int) -> None:
    for b in range(1, batches + 1):
        assert save(cc, b) == BLOCKS


def test_blocks_evicted_from_dram_are_on_disk_and_load_back_identical(
        emsd_factory: Any, sdk: Any, disk_dir: Path) -> None:
    d = emsd_factory(pool=POOL, disk={"dir": str(disk_dir), "size": "256MiB", "extent": "4MiB"})
    cc = sdk(d)
    fill(cc, 40)  # 40 MiB of blocks through a 16 MiB pool
    assert d.metric("emsd_disk_direct_io") == 1
    assert d.disk_settled() >= 20 * BLOCKS
    assert cc.exists(_keys(1)).success == BLOCKS  # only on disk: counted
    reads = d.metric("emsd_disk_reads_total")
    for b in (1, 2, 3):
        assert load(cc, b) == (BLOCKS, True), d.log()
    assert d.metric("emsd_disk_reads_total") >= reads + 3 * BLOCKS  # blocks
    assert 3 <= d.metric("emsd_disk_read_seconds_count") <= 3 * BLOCKS  # I/Os: a block or a run
    assert cc.exists(_keys(99)).success == 0
    out = subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(d.socket_dir), "status"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"in {disk_dir}" in out.stdout and "O_DIRECT" in out.stdout, out


def test_drop_removes_the_namespace_from_disk(emsd_factory: Any, sdk: Any, disk_dir: Path) -> None:
    d = emsd_factory(pool=POOL, disk={"dir": str(disk_dir), "size": "256MiB", "extent": "4MiB"})
    cc = sdk(d)
    fill(cc, 30)
    assert d.disk_settled() > 0 and cc.exists(_keys(1)).success == BLOCKS
    cc.clear()
    assert d.metric("emsd_disk_blocks") == 0
    assert cc.exists(_keys(1)).success == 0 and load(cc, 1)[0] == 0


def test_reboot_kill_9_page_cache_dropped_pool_files_gone_loads_what_was_on_disk(
        emsd_factory: Any, sdk: Any, disk_dir: Path) -> None:
    d = emsd_factory(pool=POOL, disk={"dir": str(disk_dir), "size": "256MiB", "extent": "4MiB"})
    cc = sdk(d)
    fill(cc, 40)
    on_disk = d.disk_settled()
    assert on_disk >= 20 * BLOCKS
    Ems._reset()
    d.kill9()
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:  # not root, or a read-only /proc in a container
        pytest.skip(f"cannot drop the page cache here: {exc}")
    state = Path(d.sections["pool"]["state_dir"])
    for f in state.iterdir():  # the pool's shared memory and its ledger: DRAM does not survive
        f.unlink()
    d.start()
    assert "disk tier:" in d.log() and "index attached" in d.log(), d.log()
    cc = sdk(d)
    loaded = 0
    for b in range(1, 41):
        got, exact = load(cc, b)
        assert exact, f"batch {b}: wrong bytes after the reboot"
        loaded += got
    assert loaded >= 0.99 * on_disk, (loaded, on_disk)


def test_a_disk_that_is_full_at_start_leaves_the_daemon_on_dram(
        emsd_factory: Any, sdk: Any, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.strip()}")
    try:
        d = emsd_factory(pool=POOL, disk={"dir": str(small), "size": "64MiB", "extent": "4MiB"})
        code, body = d.http("/readyz")
        assert code == 200 and b"degraded: disk tier off" in body, body
        assert d.metric("emsd_disk_failed") == 1
        assert "disk tier off" in d.log()
        cc = sdk(d)
        assert save(cc, 1) == BLOCKS and load(cc, 1) == (BLOCKS, True)
        Ems._reset()
        assert d.terminate() == 0
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_disk_that_disappears_is_reported_and_dram_keeps_serving(
        emsd_factory: Any, sdk: Any, disk_dir: Path) -> None:
    d = emsd_factory(pool=POOL, disk={"dir": str(disk_dir), "size": "128MiB", "extent": "4MiB"})
    cc = sdk(d)
    fill(cc, 20)
    d.disk_settled()
    assert d.http("/readyz") == (200, b"ready\n")
    (disk_dir / "emsd-disk.data").unlink()
    code, body = d.http("/readyz")
    assert code == 200 and b"degraded: disk tier off" in body and b"removed" in body, body
    assert d.metric("emsd_disk_failed") == 1
    assert cc.exists(_keys(1)).success == 0  # what was only on disk is gone, never half-served
    assert save(cc, 50) == BLOCKS and load(cc, 50) == (BLOCKS, True)
    assert "disk tier failed" in d.log()
    out = subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(d.socket_dir), "status"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "FAILED: " in out.stdout, out


def test_a_read_slower_than_the_load_timeout_is_a_miss_not_a_hang(
        emsd_factory: Any, sdk: Any, disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMSD_FAULTS", "disk.read=delay:1.0:3.0")
    d = emsd_factory(pool=POOL, disk={"dir": str(disk_dir), "size": "256MiB", "extent": "4MiB"})
    cc = sdk(d)
    fill(cc, 30)
    d.disk_settled()
    from ems import CcKvOption

    cc.register_kvcache(_kv(-1.0))
    t0 = time.monotonic()
    res = cc.load(list(range(BLOCKS * TOKENS)), hashes=_keys(1), offsets=[TOKENS] * BLOCKS,
                  option=CcKvOption(timeout=500))
    assert res.success == 0 and time.monotonic() - t0 < 2.5
    assert d.alive() and cc.exists(_keys(1)).success == BLOCKS


def test_a_slow_flush_of_the_index_stalls_no_load(
        emsd_factory: Any, sdk: Any, disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flush of the tier's index (once a second while rows changed) takes 2 s here.
    Saves that push blocks to disk (changing rows: a flush follows) and loads that read blocks
    back from it, one after the other, must not wait for a flush (before, the flush held the
    tier's lock, which a demotion and a load's look at the tier take: a call hung up to 2 s)."""
    monkeypatch.setenv("EMSD_FAULTS", "disk.flush=delay:1.0:2.0")
    d = emsd_factory(pool=POOL, disk={"dir": str(disk_dir), "size": "256MiB", "extent": "4MiB"})
    cc = sdk(d)
    fill(cc, 30)  # the first 14 or so batches only on disk
    from ems import CcKvOption

    end = time.monotonic() + 4.0  # a flush is under way for most of this
    batch, new = 0, 30
    while time.monotonic() < end:
        new += 1
        cc.register_kvcache(_kv(float(new)))  # evicts an older batch to disk: a row to flush
        assert cc.save(list(range(BLOCKS * TOKENS)), hashes=_keys(new), offsets=[TOKENS] * BLOCKS,
                       option=CcKvOption(timeout=1000)).success == BLOCKS
        batch = batch % 30 + 1  # more than DRAM holds: most loads read from disk
        kv = _kv(-1.0)
        cc.register_kvcache(kv)
        res = cc.load(list(range(BLOCKS * TOKENS)), hashes=_keys(batch), offsets=[TOKENS] * BLOCKS,
                      option=CcKvOption(timeout=1000))
        assert res.success == BLOCKS, batch
        assert all(bool((t == float(batch)).all()) for layer in kv for t in layer)
    assert d.alive()
