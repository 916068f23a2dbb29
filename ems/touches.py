"""Keys the SDK loaded through the shared index, told to the daemon in batches (``TOUCH``).

A load that reads its blocks through the shared index (``emsd.pool.shared_index``)
does not ask the daemon, so the daemon's LRU and hit counters do not see it, nor
do they see an ``exists`` answered from the table. ``Touches`` collects such
loads' keys (and the count of such exists' keys, field ``x``) and sends them as
one ``TOUCH`` request,
without waiting for an answer: in the same write as this object's next request
to the daemon (``DaemonClient.send_later``), or on its own once ``TOUCH_KEYS``
keys have gathered or ``TOUCH_DELAY`` seconds have passed since the batch's
first load (a thread of its own sends it then, off the loads' path). A write
of its own per load would wake the sleeping daemon each time, which costs 100
us and more on a virtual machine: as much as the rest of the load.

What it costs: blocks read this way count as used up to ``TOUCH_DELAY`` late
and, batched, as one load of all the batch's keys (the ``prefix`` policy
stamps them head newest, as one call's). Touches are hints: a batch pending
when its connection is lost, or when the process is killed, is dropped.
"""

from __future__ import annotations

import threading
import time

from ems.client import DaemonClient
from ems.common.exception import EmsException
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import TouchRequest
from emsd.transport.frames import Op

TOUCH_KEYS = 64  # keys that make a batch go on its own
TOUCH_DELAY = 0.02  # seconds after a batch's first load that it goes at the latest

Batch = tuple[DaemonClient, TouchRequest]


class Touches:
    """One namespace's pending touches on one connection (another connection, namespace id or
    key type starts a new batch; the last one goes out first). Thread-safe; ``close`` sends
    what is pending and stops the thread that sends late batches."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._client: DaemonClient | None = None
        self._ns = self._kt = -1
        self._raw: list[bytes] = []
        self._n = 0
        self._x = 0  # keys that exists found in the table
        self._since = 0.0  # when the latest batch (pending or taken) started
        self._closed = False
        self._idle = False  # the sender thread waits for a batch, with no deadline, not woken yet
        self._thread: threading.Thread | None = None  # started with the first batch

    def add(self, client: DaemonClient, ns: int, kt: int, n: int, raw: bytes, exists: int = 0) -> None:
        """``n`` keys (wire form ``kt``: ``raw``) of namespace id ``ns`` were loaded on ``client``,
        and ``exists`` keys were found by an ``exists``."""
        now = time.monotonic()
        with self._cond:
            done = None
            if self._pending() and (client is not self._client or ns != self._ns or kt != self._kt):
                done = self._take()
            if not self._pending():
                self._client, self._ns, self._kt, self._since = client, ns, kt, now
                self._start()
                if self._idle:  # else it is timing an earlier batch, which was due sooner
                    self._idle = False  # woken: the next batch need not wake it again
                    self._cond.notify()
            self._raw.append(raw)
            self._n += n
            self._x += exists
            ready = self._take() if self._n >= TOUCH_KEYS else None
        for batch in (done, ready):
            if batch is not None:
                _send(batch, later=False)

    def send_with_next(self, client: DaemonClient) -> None:
        """Queue the pending batch to go out with ``client``'s next request (one write)."""
        with self._cond:
            batch = self._take() if self._pending() else None
        if batch is not None:
            _send(batch, later=batch[0] is client)

    def close(self) -> None:
        """Send what is pending, on its own, and stop the sender thread."""
        with self._cond:
            batch = self._take() if self._pending() else None
            self._closed = True
            self._cond.notify()
        if batch is not None:
            _send(batch, later=False)
        if self._thread is not None:
            self._thread.join()

    def _start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="ems-touches", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        """Send each batch still pending ``TOUCH_DELAY`` after its first load.

        The thread sleeps until the latest batch's due time, whether a request
        has taken that batch since or not, and then looks again; only when the
        latest batch is past due and none is pending does it wait with no
        deadline, and only ``add`` of a batch then wakes it (``_idle``). So
        loads and saves one after the other wake it about once a
        ``TOUCH_DELAY``, not at every load (a wake-up is a thread switch and a
        GIL hand-over in the caller's path)."""
        while True:
            with self._cond:
                if self._closed:
                    return
                left = self._since + TOUCH_DELAY - time.monotonic()
                if left > 0:
                    self._cond.wait(left)  # then look again: taken, replaced or due
                    continue
                if not self._pending():
                    self._idle = True
                    self._cond.wait()
                    continue
                batch = self._take()
            _send(batch, later=False)

    def _pending(self) -> bool:
        return bool(self._n or self._x)

    def _take(self) -> Batch:
        assert self._client is not None
        keys = KeyBatch.from_wire(self._kt, b"".join(self._raw), self._n)  # the SDK's own: valid
        batch = (self._client, TouchRequest(self._ns, keys, found=self._x))
        self._raw, self._n, self._x, self._client = [], 0, 0, None
        return batch


def _send(batch: Batch, later: bool) -> None:
    client, touch = batch
    if client.broken:
        return  # a lost connection's touches are dropped: they are hints
    try:
        if later:
            client.send_later(Op.TOUCH, *touch.encode())
        else:
            client.send_noreply(Op.TOUCH, *touch.encode())
    except EmsException:
        pass
