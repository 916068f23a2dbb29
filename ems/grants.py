"""Chunks the daemon has granted one connection for its next saves: a save in one round trip.

A save whose blocks all have one size, with that many granted chunks of the
size at hand, copies its blocks straight into them and sends one PUT (keys,
places, sizes), which the daemon commits at once: RESERVE and its round trip
are skipped. After every save the SDK asks the daemon to top the chunks of
that size up to the number the save used (GRANT, sent without waiting; its
answer is taken by a later save of that size once it is in, or by the save
that finds too few chunks at hand, which waits for it), so a stream of saves
of one shape, what an engine sends, keeps finding chunks ready. The daemon
handles a GRANT right after answering the PUT before it, while the SDK
prepares the next save: that save must not wait for it while it has chunks.

What it costs: granted chunks hold pool memory while unused (the daemon bounds
it: a connection at most 1/64 of the pool, ``emsd.service.GRANT_SESSION_SHARE``;
a save's worth beyond that is not granted and those saves keep RESERVE), and
a key that turns out to be
stored already was copied for nothing (its chunk comes back for the next
save). Namespaces that several writers fill with the same keys (MLA, one copy
for every TP rank) therefore save with RESERVE, which copies only new
blocks; ``ContextCaching`` decides.

Thread-safe. The lock is never held while waiting for the daemon: an answer
that arrives after its wait gave up is handed back here from whichever thread
reads the socket.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ems.common.exception import EmsErrorCode, EmsException
from emsd.protocol.local import GrantAnswer, GrantRequest
from emsd.transport.frames import FrameError, Op

if TYPE_CHECKING:
    from ems.client import DaemonClient, Pending

_NONE = np.zeros(0, dtype=np.uint64)
REFILL_BYTES = 4 << 20  # small blocks: a GRANT asks for at least this many bytes of chunks,
REFILL_SHARE = 1024  # and at most this share of the pool (a small pool does not lose its space to it)
IDLE_AFTER_NONE = 16  # after a GRANT that got no chunk, saves of that size that do not ask again
NEVER = -1  # a size the daemon refuses to grant (larger than its pages): never asked again


class Grants:
    """The granted chunks of one ``DaemonClient`` connection, by block size."""

    def __init__(self, client: DaemonClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._free: dict[int, np.ndarray] = {}  # block bytes -> offsets (uint64) granted, unused
        self._asked: dict[int, Pending] = {}  # block bytes -> a GRANT not collected yet
        self._idle: dict[int, int] = {}  # block bytes -> saves to let pass before asking again

    def take(self, size: int, n: int, timeout: float | None) -> np.ndarray | None:
        """``n`` granted chunks for blocks of ``size`` bytes (uint64 offsets), now the
        caller's, or None if there are fewer (nothing is taken then). Collects the
        answer of a GRANT in flight for ``size`` first when it is in, or, when fewer than
        ``n`` chunks are at hand, waiting for it up to ``timeout``: a save that has its
        chunks never waits for the daemon to finish granting the next ones (the GRANT is
        handled after the PUT it followed is answered, while the SDK prepares this save)."""
        with self._lock:
            pending = self._asked.get(size)
            if pending is not None and (pending.answered or self._free.get(size, _NONE).size < n):
                del self._asked[size]
            else:
                pending = None
        if pending is not None:
            try:
                header, payload = self._client.wait(pending, timeout)
            except EmsException as exc:  # not answered in time (its late answer comes back) or refused
                if exc.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT:  # a size it never grants
                    with self._lock:
                        self._idle[size] = NEVER
            else:
                got = _offsets(header, payload)
                if got.size == 0:  # none to spare (this connection's share is held, or the pool's)
                    with self._lock:
                        self._idle[size] = IDLE_AFTER_NONE
                self.give_back(size, got)
        with self._lock:
            free = self._free.get(size, _NONE)
            if free.size < n:
                return None
            self._free[size] = free[: free.size - n]
            return free[free.size - n :]

    def give_back(self, size: int, offsets: np.ndarray) -> None:
        """Chunks for blocks of ``size`` bytes that are free to use again."""
        if offsets.size:
            with self._lock:
                free = self._free.get(size, _NONE)
                self._free[size] = np.concatenate([free, offsets]) if free.size else offsets

    def ask(self, size: int, n: int) -> None:
        """After a save of ``n`` blocks of ``size`` bytes: ask the daemon (without waiting)
        for more chunks of ``size`` when fewer than the next such save needs, or than half
        of ``refill(size, n)``, are at hand, enough to hold ``refill(size, n)``; unless a
        GRANT is in flight. A request that cannot be sent (connection lost) is not an
        error here: the next save notices."""
        if not self._client.info.get("grants"):  # a daemon with pool.grants off (or too old)
            return
        want = refill(size, n, self._client.pool_size)
        with self._lock:
            have = self._free.get(size, _NONE).size
            if size in self._asked or have >= max(n, want // 2):
                return
            idle = self._idle.get(size, 0)
            if idle:
                self._idle[size] = idle - 1 if idle != NEVER else NEVER
                return
            try:
                self._asked[size] = self._client.submit(
                    Op.GRANT, *GrantRequest(size, want - have, max(n - have, 1)).encode(),
                    late=self._late(size))
            except EmsException:
                pass

    def _late(self, size: int) -> Any:
        def late(header: dict[str, Any], payload: bytes) -> None:
            self.give_back(size, _offsets(header, payload))

        return late


def refill(size: int, n: int, pool_size: int) -> int:
    """How many chunks of ``size`` bytes to hold after a save of ``n`` blocks: one such
    save's worth, and for small blocks at least ``REFILL_BYTES`` of them (at most
    1/``REFILL_SHARE`` of the pool), so that one GRANT serves many small saves."""
    return max(n, min(REFILL_BYTES, pool_size // REFILL_SHARE) // size)


def _offsets(header: dict[str, Any], payload: bytes) -> np.ndarray:
    """A GRANT answer's offsets (uint64); none from an answer that does not decode."""
    try:
        return GrantAnswer.decode(header, payload).offsets
    except FrameError:
        return _NONE
