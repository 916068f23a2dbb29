"""Start-up at any pool size: the daemon serves at once and faults the pool in behind it.

A slow prefault is made with the ``pool.prefault`` fault site (a delay per
64 MiB chunk), so that the test sees the daemon serve hits and saves while
the prefault is still running, whatever the machine's speed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from ems import CcConfig, Ems, EmsConfig

pytestmark = pytest.mark.usefixtures("reset_sdk")
POOL = 512 << 20


def prefaulted(d: Any) -> tuple[float, float]:
    return (d.metric("emsd_pool_prefault_bytes", 'state="done"'),
            d.metric("emsd_pool_prefault_bytes", 'state="total"'))


def status(d: Any) -> str:
    out = subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(d.socket_dir), "status"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_daemon_serves_while_the_pool_is_still_prefaulting(emsd_factory: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Main prefaulted before it was ready: a 12 GiB pool took 29 s before the first hit."""
    monkeypatch.setenv("EMSD_FAULTS", "pool.prefault=delay:1.0:0.8")  # 32 chunks on 4 threads: >= 6 s
    d = emsd_factory(pool={"size": POOL, "page_size": "16MiB", "prefault": True})
    done, total = prefaulted(d)
    assert total == POOL and done < total, (done, total)  # ready, and the prefault still running
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    kv = [[torch.randn(16, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]]
    cc.register_kvcache(kv)
    slots, hashes = list(range(64)), list(range(16))
    assert cc.save(slots, hashes=hashes, offsets=[4] * 16).success == 16
    out = [[torch.zeros(16, 4, 8) for _ in range(2)]]
    cc.register_kvcache(out)
    assert cc.load(slots, hashes=hashes, offsets=[4] * 16).success == 16
    assert all(torch.equal(a, b) for a, b in zip(out[0], kv[0], strict=True))
    assert prefaulted(d)[0] < total  # all of that while the prefault ran
    assert "running" in status(d)
    deadline = time.monotonic() + 30
    while prefaulted(d)[0] < total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert prefaulted(d) == (total, total)
    assert "prefault    0.50 of 0.50 GiB (100%)" in status(d) and "done" in status(d)
    assert "prefaulted 512 of 512 MiB" in d.log()
    cc.register_kvcache(out)
    assert cc.load(slots, hashes=hashes, offsets=[4] * 16).success == 16  # the blocks are still there


def test_without_prefault_nothing_runs_in_the_background(emsd_factory: Any) -> None:
    d = emsd_factory(pool={"size": POOL, "page_size": "16MiB", "prefault": False})
    assert prefaulted(d) == (0.0, 0.0) and "prefault" not in status(d)
