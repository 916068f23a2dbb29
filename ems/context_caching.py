"""``ContextCaching``: save, load and look up KV blocks through the local emsd.

A save is three steps: RESERVE places for the blocks (one round trip for the
whole batch), copy the tensors' slots into those places in the mapped pool
(one batched gather in this process, see ``ems.layout``), COMMIT (one round
trip). Blocks the daemon already has come back as PRESENT and are not copied
again. When the connection holds enough chunks granted ahead of time for the
blocks' size (``ems.grants``; after its first save of that size, on a daemon
with ``pool.grants``), a save is two: copy into those chunks, then one PUT,
which the daemon commits at once. A load is PIN (one round trip), one batched
scatter into the tensors, and a RELEASE sent without waiting for its answer.

Results follow the EMS contract: ``CcResult.total`` is the number of keys,
``success`` the number of keys that succeeded consecutively from the first.
A miss, a full pool or a block stored with a different size are shown in
``success``, never raised. Blocks after the first failure of a save are not
written at all: a load can only use a consecutive run, so they would only
take space.

Decisions the spec leaves open:
- Blocks are content-addressed: saving a key that is already stored (or
  being stored by another client) is a success without storing it again
  (with RESERVE, without a copy; a save into granted chunks has copied it
  by then, and its chunk is kept for the next save).
- The namespace is (tenant, model, engine, KV-cache type, TP/PP shape and
  ranks); it does not include the registered tensors' shapes, so that a
  scheduler process can call ``exists`` without registering. A load whose
  stored block has a different byte size than the registered layout expects
  is a miss from that key on; an engine that changes dtype must change
  ``model_id`` (the vLLM connector does).
- ``timeout`` bounds each round trip with the remaining time of the call; a
  call that runs out raises ``EMS_IO_TIMEOUT`` and leaves nothing reserved or
  pinned behind.
"""

from __future__ import annotations

import array
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
from ems.client import DaemonClient
from ems.common.exception import EmsErrorCode, EmsException, invalid
from ems.config import CcKvOption, resolve_option
from ems.direct import DIRECT_MOST, DirectReads
from ems.direct import wanted as direct_wanted
from ems.layout import KvLayout
from ems.namespace import namespace_name
from ems.profiling import Profiler
from ems.requests import BatchRequest, exists_keys, hash_request, request_part, slots_within, token_request
from ems.result import CcFuture, CcResult
from ems.touches import Touches
from emsd.pool.keys import KT_INT, KeyBatch
from emsd.protocol.local import (
    CommitAnswer,
    CommitRequest,
    DropAnswer,
    DropRequest,
    ExistsAnswer,
    ExistsRequest,
    NamespaceAnswer,
    NamespaceRequest,
    PinAnswer,
    PinRequest,
    PutAnswer,
    PutRequest,
    ReleaseRequest,
    ReserveAnswer,
    ReserveRequest,
)
from emsd.transport.frames import MAX_BATCH_KEYS, FrameError, Op

_NEW, _PRESENT, _FAILED = 0, 1, 2
_NO_HANDLES = np.zeros(0, dtype=np.uint32)
_A = TypeVar("_A")
ASYNC_WORKERS = 4


class ContextCaching:
    """The object ``Ems.get_cc()`` returns. Thread-safe; async calls pipeline."""

    def __init__(self, client: Callable[[], DaemonClient], cc_config: CcConfig_v1,
                 access_id: str | None, profiler: Profiler) -> None:
        self._client = client
        self._namespace = namespace_name(access_id, cc_config, "")
        self._ns_for: tuple[DaemonClient, int] | None = None  # (connection, ns id on it)
        self._layout: KvLayout | None = None
        self._profiler = profiler
        self._executor = ThreadPoolExecutor(max_workers=ASYNC_WORKERS, thread_name_prefix="ems-cc")
        self._lock = threading.Lock()
        # Saves into granted chunks copy a key that is stored already for nothing: not for
        # MLA namespaces, which every TP rank fills with the same keys (see ems.grants).
        self._granted = cc_config.kvcache_type != KVCacheType.MLA
        self._touches = Touches()  # keys loaded through the shared index, not told to the daemon yet
        self._direct = DirectReads() if direct_wanted() else None  # loads read from owners (ems.direct)
        self._scratch = threading.local()  # per thread: the buffer a direct read receives into

    def close(self) -> None:
        """Wait for async calls in flight, send the loads' pending touches (``ems.touches``),
        then close the profiling record file."""
        self._executor.shutdown(wait=True)
        self._touches.close()
        if self._direct is not None:
            self._direct.close()
        self._profiler.close()

    # -- registration ------------------------------------------------------------

    def register_kvcache(self, kvcache: Any) -> None:
        """Record the KV tensors' layout and addresses; no data moves. The connection starts
        filling its page tables for the pool in the background (``DaemonClient.populate``), so
        that the first copies do not fault on every 4 KiB page."""
        self._layout = KvLayout.from_kvcache(kvcache)
        try:
            self._client().populate()
        except EmsException:
            pass  # not connected: the first call after a (re)connection starts it (_connected)

    @property
    def layout(self) -> KvLayout:
        if self._layout is None:
            raise invalid("register_kvcache() must be called before save/load")
        return self._layout

    # -- calls --------------------------------------------------------------------

    def save(self, slot_mapping: Any, hashes: Any = None, offsets: Any = None,
             option: CcKvOption | None = None, **kwargs: Any) -> CcResult:
        """Save the slots' KV data under the keys; see the module docstring."""
        start = time.perf_counter_ns()
        opt = resolve_option(option)
        req = self._request(slot_mapping, hashes, offsets, kwargs, for_save=True)
        result = self._save(req, opt)
        self._profiler.record("save", start, result)
        return result

    def load(self, slot_mapping: Any, hashes: Any = None, offsets: Any = None,
             option: CcKvOption | None = None, **kwargs: Any) -> CcResult:
        """Copy stored KV data back into the slots; ``success`` = leading hits."""
        start = time.perf_counter_ns()
        opt = resolve_option(option)
        req = self._request(slot_mapping, hashes, offsets, kwargs, for_save=False)
        result = self._load(req, opt)
        self._profiler.record("load", start, result)
        return result

    def async_save(self, slot_mapping: Any, hashes: Any = None, offsets: Any = None,
                   option: CcKvOption | None = None, **kwargs: Any) -> CcFuture:
        """``save`` in the background; arguments are checked before returning."""
        opt = resolve_option(option).copy()  # the call's own: the caller may change theirs
        req = self._request(slot_mapping, hashes, offsets, kwargs, for_save=True)
        return CcFuture(self._executor.submit(self._timed, "async_save", self._save, req, opt))

    def async_load(self, slot_mapping: Any, hashes: Any = None, offsets: Any = None,
                   option: CcKvOption | None = None, **kwargs: Any) -> CcFuture:
        """``load`` in the background; arguments are checked before returning."""
        opt = resolve_option(option).copy()  # the call's own: the caller may change theirs
        req = self._request(slot_mapping, hashes, offsets, kwargs, for_save=False)
        return CcFuture(self._executor.submit(self._timed, "async_load", self._load, req, opt))

    def is_ready(self, future: CcFuture) -> bool:
        """True once ``future`` has finished (successfully or not); never blocks."""
        _check_future(future)
        return future.done()

    def get_result(self, future: CcFuture) -> CcResult:
        """Wait for ``future``; raises its ``EmsException`` if it failed as a whole."""
        _check_future(future)
        return future.result()

    def exists(self, hashes: Any, option: CcKvOption | None = None, **kwargs: Any) -> CcResult:
        """How many leading ``hashes`` are stored; no pin, no LRU refresh.

        ``**kwargs`` is in the published signature but no keyword is defined:
        any raises ``EMS_INVALID_ARGUMENT`` naming it.
        """
        if kwargs:
            raise invalid(f"exists: unexpected keyword argument(s): {', '.join(sorted(kwargs))}")
        start = time.perf_counter_ns()
        opt = resolve_option(option)
        fast = _int_keys_wire(hashes)
        keys = KeyBatch.from_wire(KT_INT, fast, len(fast) // 8) if fast is not None else exists_keys(hashes)
        n = len(keys)
        if n == 0:
            return CcResult(0, 0)
        client = self._connected()
        deadline = _deadline(opt)
        ns = self._ns(client, deadline)
        if client.index is not None and _all_published(client, ns, keys):
            self._touches.add(client, ns, KT_INT, 0, b"", exists=n)  # counted by the daemon later
            result = CcResult(n, n)  # all in this node's pool: nothing to ask
            self._profiler.record("exists", start, result)
            return result
        query = ExistsRequest(ns, keys, opt.read_local_only, _to(deadline))
        self._touches.send_with_next(client)
        header, payload = client.call(Op.EXISTS, *query.encode(), timeout=_remaining(deadline))
        result = CcResult(_answer(ExistsAnswer.decode, header, payload, n).held, n)
        self._profiler.record("exists", start, result)
        return result

    def clear(self, option: CcKvOption | None = None) -> int:
        """Drop every block stored under this object's namespace (an emsd extension, not
        in the EMS API): on the local emsd and, in a cluster, on every member. Later
        loads miss and saves store afresh, so call it when the stored KV is wrong
        for the engine, e.g. after its weights changed in place.

        Returns how many blocks the local node evicted. Blocks that a load in
        flight has pinned, or that a save begun before the call is still
        writing, are no longer found but free their memory only later.
        Raises ``EMS_IO_ERROR`` when a member did not confirm in time (its
        blocks may still be found there; call again), and the SDK's usual
        errors (no daemon, timeout).
        """
        opt = resolve_option(option)
        client, deadline = self._connected(), _deadline(opt)
        ns = self._ns(client, deadline)
        header, payload = client.call(Op.DROP, *DropRequest(ns, _to(deadline)).encode(),
                                      timeout=_remaining(deadline))
        self._ns_for = None  # the name has a new id now: ask for it (the shared index knows only it)
        dropped, missed = _answer(DropAnswer.decode, header, payload)
        if missed:
            raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                               f"clear: {missed} cluster member(s) did not confirm the drop; "
                               "their blocks may still be found")
        return dropped

    # -- the work ------------------------------------------------------------------

    def _timed(self, op: str, fn: Callable[[BatchRequest, CcKvOption], CcResult],
               req: BatchRequest, opt: CcKvOption) -> CcResult:
        start = time.perf_counter_ns()
        result = fn(req, opt)
        self._profiler.record(op, start, result)
        return result

    def _request(self, slot_mapping: Any, hashes: Any, offsets: Any, kwargs: dict[str, Any],
                 for_save: bool) -> BatchRequest:
        layout = self.layout
        unknown = set(kwargs) - {"token_ids", "mask"}
        if unknown:
            raise invalid(f"unexpected keyword argument(s): {', '.join(sorted(unknown))} "
                          "(the keyword arguments are token_ids= and mask=)")
        if "token_ids" in kwargs:
            if hashes is not None or offsets is not None:
                raise invalid("give either hashes/offsets or token_ids/mask, not both")
            # mask is optional (reference tables 8-4/8-9/8-15/8-20): None = all ones
            req = token_request(slot_mapping, kwargs["token_ids"], kwargs.get("mask"),
                                layout.block_size, for_save)
        else:
            if "mask" in kwargs:
                raise invalid("mask= is only valid together with token_ids=")
            if hashes is None or offsets is None:
                raise invalid("hash semantics need hashes and offsets")
            req = hash_request(slot_mapping, hashes, offsets)
        if not slots_within(slot_mapping, layout.num_slots):
            layout.check_slots(req.slots)  # names the first slot out of range
        return req

    def _save(self, req: BatchRequest, opt: CcKvOption) -> CcResult:
        """A save: into granted chunks with one PUT when there are enough of the blocks'
        one size (``ems.grants``), else RESERVE, copy, COMMIT. Either way, then asks for
        chunks for the next save of this shape."""
        n = len(req.keys)
        if n == 0:
            return CcResult(0, req.total)
        layout, client, deadline = self.layout, self._connected(), _deadline(opt)
        ns = self._ns(client, deadline)
        self._touches.send_with_next(client)
        _remaining(deadline)  # a call whose time is up reserves nothing
        size = _one_size(req, layout) if self._granted else 0
        at = client.grants.take(size, n, _left(deadline)) if size else None
        if at is not None:
            return self._put(req, opt, client, deadline, ns, size, at)
        sizes = layout.block_bytes(req.counts).astype("<u8")
        result = self._reserve_commit(req, opt, client, deadline, ns, sizes)
        if size:
            client.grants.ask(size, n)
        return result

    def _put(self, req: BatchRequest, opt: CcKvOption, client: DaemonClient, deadline: float | None,
             ns: int, size: int, at: np.ndarray) -> CcResult:
        """Copy the blocks, all of ``size`` bytes, into the granted chunks ``at``, then one PUT;
        unused chunks go back to the grants. One block (the usual one-block save) is placed
        and encoded in scalar steps."""
        layout, n = self.layout, len(req.keys)
        one = int(at[0]) if n == 1 else -1
        try:
            client.map_in(at)
            segs = layout.place_one(req.slots, client.pool_addr, one, client.pool_size) if n == 1 else None
            if segs is None:
                segs = layout.place(layout.plan(req.slots, req.counts), client.pool_addr, at,
                                    pool_size=client.pool_size)
            layout.copy(segs, client.pool_addr, client.pool_size, to_pool=True)
        except BaseException:
            client.grants.give_back(size, at)
            raise
        if n == 1:
            put = PutRequest.encode_one(ns, req.keys, one, size, req.prev, opt.write_rcache, _to(deadline))
        else:
            put = PutRequest(ns, req.keys, at, np.full(n, size, dtype="<u8"), req.prev, opt.write_rcache,
                             _to(deadline)).encode()
        pending = client.submit(Op.PUT, *put, late=_unused_back(client, size, at))
        client.grants.ask(size, n)  # the daemon handles it after answering the PUT
        try:
            header, payload = client.wait(pending, _left(deadline))
        except EmsException as exc:
            if exc.status_code() != EmsErrorCode.EMS_IO_TIMEOUT:  # refused: nothing was stored
                client.grants.give_back(size, at)
            raise  # (a late answer gives the unused chunks back: _unused_back)
        done = _one_put_success if n == 1 else _put_success  # one block a call: scalar steps
        return CcResult(done(header, payload, client, size, at), req.total)

    def _reserve_commit(self, req: BatchRequest, opt: CcKvOption, client: DaemonClient,
                        deadline: float | None, ns: int, sizes: np.ndarray) -> CcResult:
        """RESERVE places (the copy is planned while the daemon answers), copy, COMMIT."""
        layout, n = self.layout, len(req.keys)
        reserve = ReserveRequest(ns, req.keys, sizes, req.prev, _to(deadline))
        pending = client.submit(Op.RESERVE, *reserve.encode(), late=_abort_late(client, n))
        try:
            plan = layout.plan(req.slots, req.counts)  # while the daemon reserves
        except BaseException:
            with contextlib.suppress(EmsException):  # undo the reservation, keep the first error
                _abort_late(client, n)({}, client.wait(pending, _left(deadline))[1])
            raise
        offsets, handles, status = _answer(ReserveAnswer.decode, *client.wait(pending, _left(deadline)), n)
        if not status.any():  # every key NEW (0): the usual save of new blocks
            good, new, keys, mine = n, np.arange(n), None, handles
        else:
            failed = np.flatnonzero(status == _FAILED)
            good = int(failed[0]) if failed.size else n
            new = keys = np.flatnonzero(status[:good] == _NEW)
            offsets, mine = offsets[new], handles[new]
        if new.size:
            try:
                client.map_in(offsets)
                segs = layout.place(plan, client.pool_addr, offsets, keys, pool_size=client.pool_size)
                layout.copy(segs, client.pool_addr, client.pool_size, to_pool=True)
            except BaseException:
                client.send_noreply(Op.COMMIT, *CommitRequest(_NO_HANDLES, mine).encode())
                raise
            commit = CommitRequest(mine, wr=opt.write_rcache, to=_to(deadline))
            answer = client.call(Op.COMMIT, *commit.encode(), timeout=_remaining(deadline))
            good = _reached(_answer(CommitAnswer.decode, *answer, new.size).reached, new, good)
        return CcResult(good, req.total)

    def _load(self, req: BatchRequest, opt: CcKvOption) -> CcResult:
        """A load: from the shared index without a round trip when every block is in this
        node's pool, else PIN, copy, RELEASE. In a cluster a PIN brings at most the daemon's
        ``part`` bytes (HELLO; ``Service.load_part``) of blocks from other nodes here, so that
        their copies find room: its ``bring`` (``PinRequest``) is the keys of the largest
        block that fit. Blocks here already are pinned however many. A PIN that loads fewer
        blocks than it asked for is followed by one for the rest when its answer says ``more``
        (it stopped at that bound, or blocks it fetched found no room, which other loads'
        pins may have held: ``PinAnswer.more``), and the load ends at the first that loads
        none. Against an older emsd (HELLO without ``bring``) the load goes in parts of at
        most ``part`` bytes, one after the other; without ``more`` too, a short part is
        followed by a PIN for the rest every time. A load that keeps no read-cache copy
        (``write_rcache`` off) of blocks another node owns first reads the leading ones
        from their owner itself (``_direct_load``, ``ems.direct``)."""
        n = len(req.keys)
        if n == 0:
            return CcResult(0, req.total)
        layout, client, deadline = self.layout, self._connected(), _deadline(opt)
        ns = self._ns(client, deadline)
        if client.index is not None and self._load_published(req, client, ns):
            return CcResult(n, req.total)
        most = int(client.info.get("part", 0))
        if not most:  # standalone: a block is here or nowhere
            return CcResult(self._pin_load(req, opt, client, ns, deadline)[0], req.total)
        sizes = layout.block_bytes(req.counts)
        done = self._direct_load(req, sizes, opt, client, deadline)
        if done == n:
            return CcResult(n, req.total)
        # (at most n: a PIN's br is bounded by the keys a request may have)
        bring = min(n, max(1, most // int(sizes.max()))) if client.info.get("bring") else None
        always = not client.info.get("more")
        while done < n:  # a PIN that stops short goes on from there if it may load more
            part = request_part(req, sizes, done, 0 if bring else most)
            got, more = self._pin_load(part, opt, client, ns, deadline, bring)
            done += got
            if got == 0 or (got < len(part.keys) and not (more or always)):
                break
        return CcResult(done, req.total)

    def _direct_load(self, req: BatchRequest, sizes: np.ndarray, opt: CcKvOption, client: DaemonClient,
                     deadline: float | None) -> int:
        """How many leading blocks of ``req`` (of ``sizes`` bytes) were read straight from
        their owner into their slots (``ems.direct``): a load that keeps no read-cache copy
        here, of at most ``DIRECT_MOST`` bytes that another node owns. 0 when not tried or
        when the owner could not be asked: the caller loads through the daemon from there."""
        direct, layout = self._direct, self.layout
        if direct is None or opt.write_rcache or opt.read_local_only or layout.device == "cuda":
            return 0
        found = direct.run(client, self._namespace, req.keys, _remaining(deadline))
        if found is None:
            return 0
        node, run = found
        ends = np.cumsum(sizes[:run])
        run = int(np.searchsorted(ends, DIRECT_MOST, side="right"))
        if run == 0:
            return 0
        part = request_part(req, sizes, 0, int(ends[run - 1]))  # exactly the ``run`` leading keys
        into = self._scratch_of(int(ends[run - 1]))
        left = _remaining(deadline)
        lengths = direct.read(node, self._namespace, part.keys, into.data, 5.0 if left is None else left)
        if lengths is None:
            return 0
        wrong = np.flatnonzero(lengths != sizes[: lengths.size].astype(np.uint64))
        hits = int(wrong[0]) if wrong.size else lengths.size
        if hits:
            offsets = np.concatenate(([0], np.cumsum(lengths[: hits - 1], dtype=np.uint64)))
            offsets = offsets.astype(np.uint64)
            addr = int(into.ctypes.data)
            plan = layout.plan(part.slots, part.counts, part.skip)
            which = None if hits == run else np.arange(hits)
            segs = layout.place(plan, addr, offsets, which, pool_size=into.size)
            layout.copy(segs, addr, into.size, to_pool=False)
        return hits

    def _scratch_of(self, nbytes: int) -> np.ndarray:
        """This thread's buffer for a direct read, at least ``nbytes`` long (kept for the next)."""
        have = getattr(self._scratch, "buf", None)
        if have is None or have.size < nbytes:
            have = self._scratch.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        return have

    def _pin_load(self, req: BatchRequest, opt: CcKvOption, client: DaemonClient, ns: int,
                  deadline: float | None, bring: int | None = None) -> tuple[int, bool]:
        """PIN ``req``'s keys (bringing at most ``bring`` here: ``PinRequest``), copy the leading
        blocks found into its slots, RELEASE; how many, and whether the daemon said ``more``
        (``PinAnswer.more``)."""
        layout, n = self.layout, len(req.keys)
        self._touches.send_with_next(client)
        pin = PinRequest(ns, req.keys, req.prev, opt.read_local_only, opt.write_rcache, _to(deadline), bring)
        _remaining(deadline)  # a call whose time is up pins nothing
        pending = client.submit(Op.PIN, *pin.encode(), late=_release_late(client, n))
        try:
            plan = layout.plan(req.slots, req.counts, req.skip)  # while the daemon pins
        except BaseException:
            with contextlib.suppress(EmsException):  # drop the pins, keep the first error
                header, payload = client.wait(pending, _left(deadline))
                _release_late(client, n)(header, payload)
            raise
        answer = _answer(PinAnswer.decode, *client.wait(pending, _left(deadline)), n)
        offsets, lengths, handles = answer.offsets, answer.lengths, answer.handles
        count = len(handles)
        try:
            expected = layout.block_bytes(req.counts[:count]).astype(np.uint64)
            wrong = np.flatnonzero(lengths != expected)
            hits = int(wrong[0]) if wrong.size else count
            if hits:
                keys = None if hits == n else np.arange(hits)
                client.map_in(offsets[:hits])
                segs = layout.place(plan, client.pool_addr, offsets[:hits], keys, pool_size=client.pool_size)
                layout.copy(segs, client.pool_addr, client.pool_size, to_pool=False)
        finally:
            if count:
                client.send_noreply(Op.RELEASE, *ReleaseRequest(handles).encode())
        return hits, answer.more and hits == count  # a block of the wrong length ends the load

    def _load_published(self, req: BatchRequest, client: DaemonClient, ns: int) -> bool:
        """A load without a round trip, when every key is in the shared index
        (``emsd.pool.shared_index``): copy the blocks, then check that none was retracted
        meanwhile and that the daemon is still up; the keys go to the daemon later, batched
        (``ems.touches``: LRU, metrics). False when any key is not found or the check fails:
        the caller asks the daemon (slots may have been written by this try then, as a load
        writes slots it then reports as not loaded)."""
        layout = self.layout
        found = _published(client, ns, req, layout)
        if found is None:
            return False  # a key not there, or a block of another size: the daemon's answer says what loads
        offsets, unchanged = found
        plan = layout.plan(req.slots, req.counts, req.skip)
        segs = layout.place(plan, client.pool_addr, offsets, None, pool_size=client.pool_size)
        layout.copy(segs, client.pool_addr, client.pool_size, to_pool=False)
        if not unchanged() or client.hung_up():
            return False
        kt, raw = req.keys.to_wire()
        self._touches.add(client, ns, kt, len(req.keys), raw)
        return True

    # -- connection helpers ----------------------------------------------------------

    def _connected(self) -> DaemonClient:
        """The connection for a call; a new one (after a reconnection) fills its page tables
        too once a KV cache is registered."""
        client = self._client()
        if client.broken:
            raise EmsException(EmsErrorCode.EMS_IO_ERROR, "the connection to emsd was lost")
        if self._layout is not None:
            client.populate()
        return client

    def _ns(self, client: DaemonClient, deadline: float | None) -> int:
        """This namespace's id on ``client``'s connection (opened once per connection)."""
        cached = self._ns_for
        if cached is not None and cached[0] is client:
            return cached[1]
        with self._lock:
            answer = client.call(Op.NAMESPACE, *NamespaceRequest(self._namespace).encode(),
                                 timeout=_remaining(deadline))
            self._ns_for = (client, _answer(NamespaceAnswer.decode, *answer).ns)
            return self._ns_for[1]


def _published(client: DaemonClient, ns: int, req: BatchRequest,
               layout: KvLayout) -> tuple[np.ndarray, Callable[[], bool]] | None:
    """Where the shared index has every key of ``req``, each with the length ``layout``
    expects: their byte offsets in the pool, and the check to make after copying them
    (true while no slot used changed: ``SharedIndexReader.check``). None otherwise. One
    key (one block a call) is looked up in scalars (``find_one``)."""
    index = client.index
    assert index is not None
    if len(req.keys) == 1:
        one = index.find_one(ns, req.keys, client.pool_size)
        if one is None or one[1] != int(req.counts[0]) * layout.slot_bytes:
            return None
        offset, _, slot, seq = one
        return np.array((offset,), dtype=np.uint64), lambda: index.check_one(slot, seq)
    found = index.find(ns, req.keys, client.pool_size)
    if found.offsets.size < len(req.keys) \
            or not np.array_equal(found.lengths, layout.block_bytes(req.counts)):
        return None
    return found.offsets, lambda: index.check(found.slots, found.seqs)


def _all_published(client: DaemonClient, ns: int, keys: KeyBatch) -> bool:
    """Whether every key is in the shared index (present in this node's pool)."""
    assert client.index is not None
    if len(keys) == 1:
        return client.index.find_one(ns, keys, client.pool_size) is not None
    return client.index.find(ns, keys, client.pool_size).offsets.size == len(keys)


def _int_keys_wire(hashes: Any) -> bytes | None:
    """KT_INT wire bytes of a list/tuple of 64-bit ints, or None (take the general path).

    The scheduler side of a connector calls ``exists`` with hundreds of
    Python ``hash()`` values on every step; ``array.array`` converts them
    strictly (a float or an out-of-range int falls through to the general
    path, which names it) in a few microseconds.
    """
    if type(hashes) not in (list, tuple) or len(hashes) > MAX_BATCH_KEYS:
        return None
    for code in ("q", "Q"):
        try:
            return array.array(code, hashes).tobytes()
        except (TypeError, OverflowError):
            continue
    return None


def _one_size(req: BatchRequest, layout: KvLayout) -> int:
    """The bytes of every block of ``req`` when they all have one size (a save that granted
    chunks can take), else 0; one block a call in scalar steps."""
    if len(req.counts) == 1:
        return int(req.counts[0]) * layout.slot_bytes
    sizes = layout.block_bytes(req.counts)
    return int(sizes[0]) if int(sizes.min()) == int(sizes.max()) else 0


def _check_future(future: Any) -> None:
    if not isinstance(future, CcFuture):
        raise invalid(f"future must be a CcFuture from async_save/async_load, not {type(future).__name__}")


def _deadline(opt: CcKvOption) -> float | None:
    return None if opt.timeout == 0 else time.monotonic() + opt.timeout / 1000.0


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT, "the call's timeout passed")
    return left


def _left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (0 once it passed: a wait then gives up at once)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _to(deadline: float | None) -> int | None:
    """The ``to`` field: milliseconds the daemon may spend on peers for this request."""
    return None if deadline is None else max(1, int((deadline - time.monotonic()) * 1000))


def _answer(decode: Callable[..., _A], header: dict[str, Any], payload: bytes, *asked: int) -> _A:
    """``decode(header, payload, *asked)`` of an answer from emsd (``emsd.protocol.local``); one
    that does not fit its request is ``EMS_IO_ERROR``."""
    try:
        return decode(header, payload, *asked)
    except FrameError as exc:
        raise EmsException(EmsErrorCode.EMS_IO_ERROR, f"malformed answer from emsd: {exc}") from None


def _reached(reached: bytes | None, new: np.ndarray, good: int) -> int:
    """``good`` cut at the first of the keys at positions ``new`` (the committed ones, in
    order) that a cluster answer's ``reached`` says did not reach its owner."""
    if reached is not None:
        lost = new[np.frombuffer(reached, dtype=np.uint8) == 0]
        if lost.size:
            return min(good, int(lost[0]))
    return good


def _put_success(answer: dict[str, Any], payload: bytes, client: DaemonClient, size: int,
                 at: np.ndarray) -> int:
    """``success`` of a PUT of ``at.size`` blocks from its answer: the keys before the first
    FAILED one, cut at the first NEW one that (in a cluster) did not reach its owner; the
    chunks the blocks did not take go back to the grants."""
    n = at.size
    status, reached = _answer(PutAnswer.decode, answer, payload, n)
    client.grants.give_back(size, at[status != _NEW])
    failed = np.flatnonzero(status == _FAILED)
    good = int(failed[0]) if failed.size else n
    return _reached(reached, np.flatnonzero(status == _NEW), good)


def _one_put_success(answer: dict[str, Any], payload: bytes, client: DaemonClient, size: int,
                     at: np.ndarray) -> int:
    """``_put_success`` of a one-block PUT, in scalar steps: 1 when the block is stored
    (PRESENT, or NEW and, in a cluster, at its owner), 0 when FAILED or not at its owner."""
    status, reached = _answer(PutAnswer.one, answer, payload)
    if status != _NEW:
        client.grants.give_back(size, at)
        return int(status != _FAILED)
    return int(reached)


def _unused_back(client: DaemonClient, size: int, at: np.ndarray) -> Callable[[dict[str, Any], bytes], None]:
    """For a PUT whose answer came after the call timed out: its unused chunks are free again."""

    def late(header: dict[str, Any], payload: bytes) -> None:
        with contextlib.suppress(FrameError):
            client.grants.give_back(size, at[PutAnswer.decode(header, payload, at.size).status != _NEW])

    return late


def _abort_late(client: DaemonClient, n: int) -> Callable[[dict[str, Any], bytes], None]:
    """Undo a reservation whose answer came after the call timed out."""

    def late(header: dict[str, Any], payload: bytes) -> None:
        with contextlib.suppress(FrameError):
            _, handles, status = ReserveAnswer.decode(header, payload, n)
            new = handles[status == _NEW]
            if new.size:
                client.send_noreply(Op.COMMIT, *CommitRequest(_NO_HANDLES, new).encode())

    return late


def _release_late(client: DaemonClient, n: int) -> Callable[[dict[str, Any], bytes], None]:
    """Drop pins whose answer came after the call timed out."""

    def late(header: dict[str, Any], payload: bytes) -> None:
        with contextlib.suppress(FrameError):
            handles = PinAnswer.decode(header, payload, n).handles
            if handles.size:
                client.send_noreply(Op.RELEASE, *ReleaseRequest(handles).encode())

    return late
