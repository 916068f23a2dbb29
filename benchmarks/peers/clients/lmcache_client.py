"""LMCache's standalone lmcache_server over loopback TCP, spoken to as LMCache's own
LMCServerConnector does (lmcache.v1.protocol messages; ``recv_into`` the destination).

The protocol has no batch call and a PUT is not acknowledged, so: a batch is
pipelined (all requests sent, then all answers read), and every put call ends
with an EXIST round trip on the same connection, which the server answers only
after it has stored everything sent before it; without it a put would time only
the client's send.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

_EMPTY = torch.Size([0, 0, 0, 0])


class LmcacheClient:
    def __init__(self, port: int, volume: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = np.ones(2 * volume, dtype=np.uint8)
        self.view = memoryview(self.buffer)
        self.half = volume
        self.size = 0

    def prepare(self, size: int, n: int) -> None:
        self.size = size

    def _meta(self, cmd: ClientCommand, key: int, length: int = 0) -> bytes:
        # Keys repeat from cell to cell (key % 1e6 is the block index): the server has no
        # delete, so an overwrite is what keeps its memory at one cell's volume. The
        # worker stamps each cell's values, so a stale answer still fails the check.
        k = CacheEngineKey("bench", 1, 0, key % 1_000_000, torch.uint8)
        shape = torch.Size([length, 0, 0, 0]) if length else _EMPTY
        return ClientMetaMessage(cmd, k, length, MemoryFormat(1), torch.uint8, shape).serialize()

    def _answer(self) -> ServerMetaMessage:
        n = ServerMetaMessage.packlength()
        head = bytearray(n)
        self._recv_into(memoryview(head), n)
        return ServerMetaMessage.deserialize(bytes(head))

    def _recv_into(self, view: memoryview, n: int) -> None:
        got = 0
        while got < n:
            r = self.sock.recv_into(view[got:], n - got)
            if r == 0:
                raise ConnectionError("lmcache_server closed the connection")
            got += r

    def put(self, keys: list[int], first: int) -> None:
        size = self.size
        for j, k in enumerate(keys):
            self.sock.sendall(self._meta(ClientCommand.PUT, k, size))
            self.sock.sendall(self.view[(first + j) * size : (first + j + 1) * size])
        self.sock.sendall(self._meta(ClientCommand.EXIST, keys[-1]))
        if self._answer().code != ServerReturnCode.SUCCESS:
            raise RuntimeError(f"lmcache_server does not hold {keys[-1]} after PUT")

    def get(self, keys: list[int], first: int) -> None:
        size = self.size
        self.sock.sendall(b"".join(self._meta(ClientCommand.GET, k) for k in keys))
        for j, k in enumerate(keys):
            meta = self._answer()
            if meta.code != ServerReturnCode.SUCCESS or meta.length != size:
                raise RuntimeError(f"lmcache GET {k}: code {meta.code}, {meta.length} bytes")
            at = self.half + (first + j) * size
            self._recv_into(self.view[at : at + size], size)

    def drop(self, keys: list[int]) -> None:
        pass  # the server has no delete (see _meta)

    def close(self) -> None:
        self.sock.close()


def open_client(options: dict[str, Any]) -> LmcacheClient:
    return LmcacheClient(int(options["port"]), int(options["volume"]))
