"""Client leases (``node.client_lease``): a connection silent past its lease loses its pins,
reservations and grants and is closed; a live client never notices."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_warm_restart import stats  # a fresh connection's STATS

from ems import CcConfig, Ems, EmsConfig
from ems.client import DaemonClient

pytestmark = pytest.mark.usefixtures("reset_sdk")
LEASE = 2
ROOT = Path(__file__).resolve().parents[2]
# A client that keeps its pins (its RELEASEs are dropped) and its granted chunks, then waits.
HOLDER = """
import os, time, torch
os.environ["EMS_SHARED_INDEX"] = "0"  # its load pins through the daemon (the shared index pins nothing)
from ems import CcConfig, Ems, EmsConfig
from ems.client import DaemonClient
from emsd.transport.frames import Op
send = DaemonClient.send_noreply
DaemonClient.send_noreply = lambda self, op, f, p=(): None if op == Op.RELEASE else send(self, op, f, p)
Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="holder")))
cc = Ems.get_cc()
cc.register_kvcache([[torch.ones(16, 4, 8) for _ in range(2)]])
assert cc.save(list(range(64)), hashes=list(range(16)), offsets=[4] * 16).success == 16
assert cc.load(list(range(64)), hashes=list(range(16)), offsets=[4] * 16).success == 16
print("holding", flush=True)
time.sleep(600)
"""


def test_a_client_stopped_with_sigstop_loses_its_pins_and_grants_at_its_lease(emsd_factory: Any) -> None:
    """Main: a stopped client (a hung engine, a frozen container) kept its pins and chunks for ever."""
    d = emsd_factory(node={"client_lease": LEASE}, pool={"grants": True})
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "EMS_SOCKET_DIR": str(d.socket_dir)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        os.kill(holder.pid, signal.SIGSTOP)
        held = stats(d)
        assert held["pinned"] == 16 and held["granted"] > 0, held
        deadline = time.monotonic() + LEASE + 10
        while (st := stats(d))["pinned"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert st["pinned"] == 0, st  # its blocks can be evicted again
        # The chunks it could still write into stay out of use while the process lives on.
        assert st["granted"] == held["granted"], st
        assert d.metric("emsd_clients_expired_total") >= 1
        assert "past node.client_lease" in d.log()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 10
        while (st := stats(d))["granted"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert st["granted"] == 0 and st["pending"] == 0, st
        assert d.alive()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def test_a_live_client_idle_past_its_lease_never_notices(emsd_factory: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    d = emsd_factory(node={"client_lease": LEASE}, pool={"grants": True})
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="idle")))
    cc = Ems.get_cc()
    kv = [[torch.randn(16, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]]
    cc.register_kvcache(kv)
    slots = list(range(64))
    assert cc.save(slots, hashes=list(range(16)), offsets=[4] * 16).success == 16
    deadline = time.monotonic() + LEASE + 10
    while d.metric("emsd_clients_expired_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert d.metric("emsd_clients_expired_total") >= 1  # the idle connection was closed
    out = [[torch.zeros(16, 4, 8) for _ in range(2)]]
    cc.register_kvcache(out)
    assert cc.load(slots, hashes=list(range(16)), offsets=[4] * 16).success == 16  # no error: reconnected
    assert all(torch.equal(a, b) for a, b in zip(out[0], kv[0], strict=True))
    assert cc.save(slots, hashes=list(range(100, 116)), offsets=[4] * 16).success == 16


class Busy:
    """A poll object another thread is polling with: CPython refuses a second poll."""

    def poll(self, timeout: int) -> list[tuple[int, int]]:
        raise RuntimeError("concurrent poll() invocation")


def test_hung_up_checked_from_several_threads_at_once_then_seen_at_the_lease(emsd_factory: Any) -> None:
    """``DaemonClient.hung_up`` keeps one poll object, which refuses two polls at once: checks
    from several threads (the SDK's async calls) must still each answer, False while the
    connection is live, True once the daemon has closed it (here: its lease ran out)."""
    d = emsd_factory(node={"client_lease": LEASE})
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        answers: list[bool] = []
        errors: list[BaseException] = []

        def check(times: int) -> None:
            try:
                answers.extend(client.hung_up() for _ in range(times))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=check, args=(2000,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and answers == [False] * 8000
        # Another thread inside the kept poll object, deterministically: it refuses this one.
        kept, client._hangup_poller = client._hangup_poller, Busy()  # type: ignore[assignment]
        assert client.hung_up() is False
        deadline = time.monotonic() + LEASE + 10
        while not client.hung_up():
            assert time.monotonic() < deadline, "the idle connection was not closed at its lease"
            time.sleep(0.1)
        assert client.broken and d.metric("emsd_clients_expired_total") >= 1
        assert kept.poll(0)  # the kept object sees the hang-up as well
    finally:
        client.close()
