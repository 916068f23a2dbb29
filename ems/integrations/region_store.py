"""RegionStore: values made of byte ranges of one memory region, kept in emsd; fails open.

The SDK copies between *registered* memory and the pool. A region (the
engine's host KV pool, or a staging buffer this package owns) is registered
as one ``KvBufferWrapper`` of ``length // granularity`` slots of
``granularity`` bytes (``block_size`` 1), so slot ``s`` is the region's bytes
``[s * g, (s + 1) * g)``. A value is a list of *segments* ``(address,
nbytes)`` inside the region; it is stored under one key as the segments'
bytes concatenated in order, and loaded back into the same kind of segments.
Consecutive slots become one memcpy in the SDK, so a segment costs one copy
whatever its size.

Each store owns its ``ContextCaching`` (SDK namespace from its
``CcConfig``) on the process's one emsd connection (``Ems.init``), so one
process can hold several regions, e.g. a host pool and a staging buffer.

Fail open: ``save``/``load``/``exists`` never raise. They return how many
keys succeeded consecutively from the first (0 when emsd is unreachable).
After a failure that says emsd is away, hung or refusing us (I/O error,
timeout, recovering, a bad tenant key, anything unexpected), the store is
*down* for ``retry_interval_s``: calls return 0 at once without touching
emsd, then the next call tries again (and re-initialises the SDK if it was
never up). A hung emsd therefore costs at most one ``timeout_ms`` per
``retry_interval_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ems.buffer import KvBufferWrapper
from ems.config import CcKvOption, EmsConfig
from ems.context_caching import ContextCaching
from ems.ems import Ems
from ems.profiling import Profiler

log = logging.getLogger("ems.integrations")

Segment = tuple[int, int]  # (absolute address, byte count)
MAX_KEYS_PER_CALL = 4096  # larger batches are cut into calls of this many keys


def slot_plan(segments: Sequence[Sequence[Segment]], base: int, nslots: int,
              granularity: int) -> tuple[np.ndarray, list[int]]:
    """(slot_mapping, slots per key) for the leading keys whose segments are valid.

    A segment is valid when it is non-empty, starts and ends on a slot
    boundary and lies inside the region. Planning stops at the first key
    with an invalid (or no) segment: ``len(counts)`` says how many keys the
    plan covers.
    """
    parts: list[np.ndarray] = []
    counts: list[int] = []
    end = nslots * granularity
    for segs in segments:
        key_parts = []
        for addr, nbytes in segs:
            off = int(addr) - base
            nbytes = int(nbytes)
            if nbytes <= 0 or off < 0 or off + nbytes > end or off % granularity or nbytes % granularity:
                return _concat(parts), counts
            first = off // granularity
            key_parts.append(np.arange(first, first + nbytes // granularity, dtype=np.int64))
        if not key_parts:
            return _concat(parts), counts
        parts.extend(key_parts)
        counts.append(int(sum(p.size for p in key_parts)))
    return _concat(parts), counts


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class RegionStore:
    """Values of one registered region in emsd (see the module docstring).

    ``region``: a writable buffer-protocol object (kept alive by the store),
    or an int address whose ``length`` bytes the caller keeps mapped while
    the store lives. ``granularity``: slot size in bytes; every segment
    must start and end on a multiple of it, relative to the region's start.
    ``config``: the SDK config; its ``CcConfig`` names the namespace.
    Raises ``ValueError`` for a region smaller than one slot.
    """

    def __init__(self, config: EmsConfig, region: Any, length: int, granularity: int,
                 timeout_ms: int = 5000, retry_interval_s: float = 5.0, name: str = "emsd") -> None:
        if granularity <= 0 or length < granularity:
            raise ValueError(f"{name}: region of {length} bytes holds no slot of {granularity} bytes")
        self.nslots = length // granularity
        self.granularity = granularity
        if isinstance(region, int):
            self._wrapper = KvBufferWrapper(region, self.nslots * granularity,
                                            num_blocks=self.nslots, block_size=1)
        else:
            self._wrapper = KvBufferWrapper(region, num_blocks=self.nslots, block_size=1)
        self.base = self._wrapper.address
        self.name = name
        self._config = config
        self._option = CcKvOption(timeout=int(timeout_ms))
        self._retry = float(retry_interval_s)
        self._cc: ContextCaching | None = None
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()

    # -- calls (never raise) -----------------------------------------------------------

    def save(self, keys: Sequence[bytes], segments: Sequence[Sequence[Segment]]) -> int:
        """Store each key's segments; returns how many leading keys are now stored."""
        return self._transfer("save", keys, segments)

    def load(self, keys: Sequence[bytes], segments: Sequence[Sequence[Segment]]) -> int:
        """Copy each key's stored bytes into its segments; returns the leading hits.

        A key whose stored value has another byte size than its segments is a
        miss (and so are the keys after it): nothing is written for it.
        """
        return self._transfer("load", keys, segments)

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading keys emsd holds (0 while emsd is down)."""
        done = 0
        for start in range(0, len(keys), MAX_KEYS_PER_CALL):
            chunk = list(keys[start:start + MAX_KEYS_PER_CALL])
            found = self._call(lambda cc, c=chunk: cc.exists(c, self._option).success)
            done += found
            if found < len(chunk):
                break
        return done

    def clear(self) -> bool:
        """Drop every value of this store's namespace (``ContextCaching.clear``, on every
        member of a cluster); True once emsd confirmed it. Never raises; a failure is
        logged and leaves the store usable (it does not count as emsd being down)."""
        cc = self._context()
        if cc is None:
            return False
        try:
            dropped = cc.clear(self._option)
        except Exception as exc:
            log.warning("%s: clear failed, stored values may still be found: %s", self.name, exc)
            return False
        log.info("%s: cleared (%d blocks evicted on this node)", self.name, dropped)
        return True

    def close(self) -> None:
        """Wait for the store's SDK work in flight; later calls reconnect."""
        with self._lock:
            cc, self._cc = self._cc, None
        if cc is not None:
            cc.close()

    @property
    def available(self) -> bool:
        """False while the store is down (see the module docstring)."""
        return not self._down or time.monotonic() >= self._down_until

    # -- the work --------------------------------------------------------------------

    def _transfer(self, op: str, keys: Sequence[bytes], segments: Sequence[Sequence[Segment]]) -> int:
        if len(keys) != len(segments):
            log.error("%s: %s of %d keys with %d segment lists; nothing done",
                      self.name, op, len(keys), len(segments))
            return 0
        done = 0
        for start in range(0, len(keys), MAX_KEYS_PER_CALL):
            stop = min(start + MAX_KEYS_PER_CALL, len(keys))
            slots, counts = slot_plan(segments[start:stop], self.base, self.nslots, self.granularity)
            if len(counts) < stop - start:
                log.warning("%s: %s: segment of key %d is not whole %d-byte slots inside the region",
                            self.name, op, start + len(counts), self.granularity)
            if not counts:
                break
            chunk = list(keys[start:start + len(counts)])

            def call(cc: ContextCaching, s: np.ndarray = slots, k: list[bytes] = chunk,
                     c: list[int] = counts) -> int:
                fn = cc.save if op == "save" else cc.load
                return int(fn(s, k, c, self._option).success)

            got = self._call(call)
            done += got
            if got < stop - start:
                break
        return done

    def _call(self, fn: Any) -> int:
        cc = self._context()
        if cc is None:
            return 0
        try:
            result = int(fn(cc))
        except Exception as exc:  # fail open: any failure is a miss, never the engine's problem
            self._mark_down(exc)
            return 0
        if self._down:
            self._down = False
            log.info("%s: emsd answers again", self.name)
        return result

    def _context(self) -> ContextCaching | None:
        if self._down and time.monotonic() < self._down_until:
            return None
        cc = self._cc
        if cc is not None:
            return cc
        with self._lock:
            if self._cc is None:
                try:
                    Ems.init(self._config)
                    cc = ContextCaching(Ems._current_client, self._config.validate(),
                                        self._config.access_id, Profiler.from_env())
                    cc.register_kvcache([[self._wrapper]])
                except Exception as exc:
                    self._mark_down(exc)
                    return None
                self._cc = cc
                log.info("%s: connected to emsd (%d slots of %d bytes registered)",
                         self.name, self.nslots, self.granularity)
            return self._cc

    def _mark_down(self, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self._retry
        if not self._down:
            log.warning("%s: emsd unavailable, serving misses for %.1f s between retries: %s",
                        self.name, self._retry, exc)
        self._down = True
