"""Attacks on the HTTP endpoint (health, readiness, metrics) of a real daemon (issue 25, item 6).

The endpoint is reachable by anything on the network. A request head must
arrive whole within ``REQUEST_DEADLINE``; at most ``MAX_HTTP_CONNECTIONS`` are
open at once, ``MAX_HTTP_PER_ADDRESS`` from one source address; more are closed
unanswered. Other source addresses are other loopback addresses here
(127.0.0.0/8 all reach the daemon's 127.0.0.1).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import psutil
import pytest

from ems import CcConfig, Ems, EmsConfig
from emsd.http import MAX_HTTP_CONNECTIONS, MAX_HTTP_PER_ADDRESS, REQUEST_DEADLINE

pytestmark = pytest.mark.usefixtures("reset_sdk")


def dial(d: Any, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect((d.metrics_host, d.metrics_port))
    return s


def get(d: Any, path: str, source: str) -> bytes:
    """The status line of ``GET path`` sent from ``source`` (b"" if hung up on)."""
    with dial(d, source) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            return b""
        return data.split(b"\r\n", 1)[0]


def hung_up(s: socket.socket) -> bool:
    """Whether the daemon closed ``s`` (it never answers a head that is not finished)."""
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_client_dripping_header_lines_is_cut_off_at_the_deadline(emsd: Any) -> None:
    """One line every second kept a connection for as long as it dripped (a 5 s timeout per line)."""
    s = dial(emsd)
    try:
        s.sendall(b"GET /healthz HTTP/1.0\r\n")
        start = time.monotonic()
        while not hung_up(s) and time.monotonic() - start < REQUEST_DEADLINE + 6:
            try:
                s.sendall(b"X-Drip: 1\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(1.0)
        held = time.monotonic() - start
    finally:
        s.close()
    assert held < REQUEST_DEADLINE + 2, f"the daemon held a dripping request head for {held:.1f} s"
    assert get(emsd, "/healthz", "127.0.0.1") == b"HTTP/1.0 200 OK"


def test_silent_connections_cost_few_descriptors_and_other_addresses_get_answers(emsd: Any) -> None:
    """300 silent connections from one address held 300 descriptors until their timeouts; now
    all but ``MAX_HTTP_PER_ADDRESS`` are closed at once and the probes of other addresses answer."""
    proc = psutil.Process(emsd.pid)
    before = proc.num_fds()
    silent = [dial(emsd) for _ in range(300)]
    try:
        time.sleep(0.5)
        grown = proc.num_fds() - before
        assert grown <= MAX_HTTP_PER_ADDRESS + 4, f"300 silent connections hold {grown} descriptors"
        assert sum(hung_up(s) for s in silent) >= 300 - MAX_HTTP_PER_ADDRESS
        assert get(emsd, "/healthz", "127.0.0.2") == b"HTTP/1.0 200 OK"
        assert get(emsd, "/readyz", "127.0.0.3") == b"HTTP/1.0 200 OK"
    finally:
        for s in silent:
            s.close()


def test_silent_connections_from_many_addresses_are_capped_in_all(emsd: Any, monkeypatch: Any) -> None:
    """From 40 addresses, at most ``MAX_HTTP_CONNECTIONS`` stay open; SDK clients still connect and
    work; once the attackers leave, the endpoint answers and counts the refusals, logged once."""
    proc = psutil.Process(emsd.pid)
    before = proc.num_fds()
    silent = [dial(emsd, f"127.0.1.{i}") for i in range(1, 41) for _ in range(MAX_HTTP_PER_ADDRESS)]
    try:
        time.sleep(0.5)
        grown = proc.num_fds() - before
        assert grown <= MAX_HTTP_CONNECTIONS + 4, f"{len(silent)} silent connections hold {grown} descriptors"
        import torch

        monkeypatch.setenv("EMS_SOCKET_DIR", str(emsd.socket_dir))
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
        cc = Ems.get_cc()
        kv = [[torch.arange(16 * 4 * 8, dtype=torch.float32).reshape(16, 4, 8)]]
        cc.register_kvcache(kv)
        assert cc.save(list(range(64)), hashes=list(range(16)), offsets=[4] * 16).success == 16
        assert cc.load(list(range(64)), hashes=list(range(16)), offsets=[4] * 16).success == 16
    finally:
        for s in silent:
            s.close()
    deadline = time.monotonic() + REQUEST_DEADLINE + 5  # the admitted ones leave at their deadline
    while get(emsd, "/healthz", "127.0.0.2") != b"HTTP/1.0 200 OK" and time.monotonic() < deadline:
        time.sleep(0.2)
    refused = emsd.metric("emsd_http_connections_refused_total")
    assert refused >= len(silent) - MAX_HTTP_CONNECTIONS, refused
    lines = [line for line in emsd.log().splitlines() if "closed unanswered" in line]
    assert len(lines) == 1, lines
    assert emsd.alive()
