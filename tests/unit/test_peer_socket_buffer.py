"""``cluster.peer_socket_buffer``: read from the config, and set (or left alone) on peer sockets."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from emsd.config import ConfigError, config_from_dict
from emsd.transport.peer import SOCKET_BUFFER, _tune


def _kernel_max(direction: str) -> int:
    return int(Path(f"/proc/sys/net/core/{direction}mem_max").read_text())


def _buffers(sock: socket.socket) -> tuple[int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


def test_default_is_256_kib_and_sizes_are_read() -> None:
    assert config_from_dict({}).cluster.peer_socket_buffer == SOCKET_BUFFER == 256 << 10
    assert config_from_dict({"cluster": {"peer_socket_buffer": "1MiB"}}).cluster.peer_socket_buffer == 1 << 20
    assert config_from_dict({"cluster": {"peer_socket_buffer": 0}}).cluster.peer_socket_buffer == 0


@pytest.mark.parametrize("bad", [-1, 100, "2GiB", "lots", True, 1.5])
def test_bad_sizes_name_the_key(bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"cluster": {"peer_socket_buffer": bad}})
    assert err.value.key == "cluster.peer_socket_buffer"


@pytest.mark.parametrize("size", [64 << 10, 256 << 10])
def test_tune_asks_the_kernel_for_the_size(size: int) -> None:
    with socket.socket() as sock:
        _tune(sock, size)
        # Linux doubles what is asked (bookkeeping overhead) and caps it at net.core.[wr]mem_max.
        assert _buffers(sock) == (2 * min(size, _kernel_max("w")), 2 * min(size, _kernel_max("r")))


def test_tune_with_zero_leaves_the_buffers_to_the_kernel() -> None:
    with socket.socket() as untouched, socket.socket() as tuned:
        _tune(tuned, 0)
        assert _buffers(tuned) == _buffers(untouched)
        assert tuned.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # the rest of _tune still applies
