"""Attacks on the peer port before authentication, against real clustered daemons.

Anything on the network can reach a node's peer port (the Helm chart binds it
to 0.0.0.0). Before a connection has proved the cluster secret the daemon
reads only frames of the AUTH exchange (``AUTH_FRAME_LIMIT`` bytes), keeps at
most ``MAX_UNAUTHENTICATED`` such connections (``MAX_UNAUTHENTICATED_PER_ADDRESS``
from one address) and closes each after ``AUTH_TIMEOUT``: a stranger's length
prefix no longer makes it allocate the frame it announces.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402
from memory import private_rss  # noqa: E402

from ems import CcConfig, Ems, EmsConfig  # noqa: E402
from emsd.transport.frames import MAX_HEADER, MAX_PAYLOAD, PREFIX  # noqa: E402
from emsd.transport.peer import MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_ADDRESS  # noqa: E402

pytestmark = [pytest.mark.skipif(zk.available() is not None, reason=str(zk.available())),
              pytest.mark.usefixtures("reset_sdk")]
ATTACKERS = 100


@pytest.fixture
def pair(zookeeper: zk.ZooKeeperServer, emsd_factory: Any, tmp_path: Path) -> Iterator[tuple[Any, Any, int]]:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(secret, 0o600)
    port = zk.free_port()
    a = emsd_factory(cluster={"name": "p", "zookeeper": zookeeper.hosts, "secret_file": str(secret),
                              "peer_listen": f"127.0.0.1:{zk.free_port()}", "session_timeout": 4})
    b = emsd_factory(cluster={"name": "p", "zookeeper": zookeeper.hosts, "secret_file": str(secret),
                              "peer_listen": f"127.0.0.1:{port}", "session_timeout": 4})
    yield a, b, port


def test_length_prefixes_before_authentication_allocate_nothing(pair: tuple[Any, Any, int],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, port = pair
    before = private_rss(b.pid)
    attackers = []
    try:
        for _ in range(ATTACKERS):  # each announces a 64 KiB header and an 8 MiB payload, then waits
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(PREFIX.pack(MAX_HEADER, MAX_PAYLOAD))
            attackers.append(s)
        time.sleep(1.0)
        grown = private_rss(b.pid) - before
        assert b.alive() and a.alive()
        # main allocated header + payload for each one it read: 100s of MiB here
        assert grown < 48 << 20, f"the daemon grew by {grown >> 20} MiB for {ATTACKERS} length prefixes"
        # the daemon does not wait for the announced bytes: every attacker is hung up on promptly
        open_ones = 0
        for s in attackers:
            s.settimeout(3)
            try:
                while s.recv(1 << 16):
                    pass
            except (TimeoutError, OSError) as exc:
                open_ones += not isinstance(exc, ConnectionResetError)
        assert open_ones == 0, f"{open_ones} of {ATTACKERS} connections still open"
    finally:
        for s in attackers:
            s.close()
    cluster_still_works(a, b, monkeypatch)


def cluster_still_works(a: Any, b: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks saved through node ``a`` load again, equal, through node ``b``."""
    import torch

    Ems._reset()
    monkeypatch.setenv("EMS_SOCKET_DIR", str(a.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    kv = [[torch.arange(16 * 4 * 8, dtype=torch.float32).reshape(16, 4, 8) + i for i in range(2)]]
    cc.register_kvcache(kv)
    slots = list(range(16 * 4))
    hashes = list(range(1000, 1016))
    assert cc.save(slots, hashes=hashes, offsets=[4] * 16).success == 16
    Ems._reset()
    monkeypatch.setenv("EMS_SOCKET_DIR", str(b.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    out = [[torch.zeros(16, 4, 8) for _ in range(2)]]
    cc.register_kvcache(out)
    assert cc.load(slots, hashes=hashes, offsets=[4] * 16).success == 16
    assert all(torch.equal(x, y) for x, y in zip(out[0], kv[0], strict=True))


def test_silent_connections_past_the_cap_are_closed_at_once(pair: tuple[Any, Any, int]) -> None:
    _, b, port = pair
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5)
              for _ in range(MAX_UNAUTHENTICATED + 40)]
    try:
        refused = 0
        for s in silent:  # an admitted one gets a CHALLENGE and then waits; a refused one EOF at once
            s.settimeout(0.5)
            try:
                refused += s.recv(1 << 16) == b""
            except ConnectionResetError:
                refused += 1
            except TimeoutError:
                pass
        # one address may hold at most MAX_UNAUTHENTICATED_PER_ADDRESS unauthenticated connections
        assert refused >= len(silent) - MAX_UNAUTHENTICATED_PER_ADDRESS
        assert b.alive()
    finally:
        for s in silent:
            s.close()
