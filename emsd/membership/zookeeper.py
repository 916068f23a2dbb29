"""Membership through a ZooKeeper ensemble (kazoo).

Each daemon registers an ephemeral znode ``/emsd/<cluster>/nodes/<node_id>``
holding its ``NodeInfo`` and watches the children of that directory. The
znode lives as long as the daemon's ZooKeeper session, so a daemon that dies
leaves the view once its session times out.

Threads: kazoo runs its own connection thread and calls our listener and
watch callbacks from its threads; those only set flags and wake our worker
thread, which does every blocking ZooKeeper call (register, read the view)
and runs the ``on_change`` callbacks. A daemon on asyncio marshals those
into its loop with ``call_soon_threadsafe``.

Registration is idempotent: if our znode exists and belongs to our own
session it is rewritten; if it belongs to another live session, the id is
taken and ``start()`` raises ``DuplicateNodeError``. ``start()`` never
blocks for longer than its timeout: with ZooKeeper unreachable it returns
in state CONNECTING and the worker joins once the ensemble answers. Local
service never waits on ZooKeeper. SUSPENDED keeps the last view; LOST (the
session expired, our znode is gone) keeps it too and re-registers as soon
as the client reconnects with a new session.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.connection import _CONNECTION_DROP  # kazoo's own test hook (faults only)
from kazoo.retry import KazooRetry

from emsd.faults import FAULTS, Faults
from emsd.membership.base import DuplicateNodeError, MembershipState, NodeInfo, ViewCallback
from emsd.placement import record as placement_record
from emsd.placement.agreement import Params
from emsd.placement.record import NotWritten, Record

RecordCallback = Callable[[Record], None]

log = logging.getLogger("emsd.membership")
CLAIM_ATTEMPTS = 5  # tries to claim this node's znode while it changes under us


def _endpoint(data: bytes) -> str | None:
    try:
        return NodeInfo.decode(data).peer_addr
    except ValueError:
        return None


class ZooKeeperMembership:
    def __init__(self, hosts: str, cluster: str, me: NodeInfo, session_timeout: float = 10.0,
                 endpoint_is_mine: bool = False, placement: Params | None = None) -> None:
        """``placement``: this node's (vnodes, replicas); given, the cluster's placement record
        (``emsd.placement.record``) is created from it if there is none yet, and followed:
        ``on_placement`` callbacks get the record now and after every change.
        ``endpoint_is_mine``: the caller holds ``me.peer_addr`` (it bound that port), so a live
        registration of this node id with that very endpoint can only be this node's previous
        process, killed before its session expired: it is replaced, not refused."""
        self.me = me
        self.hosts = hosts
        self.faults: Faults | None = FAULTS  # the seam's ``zk.session`` site (a test may set its own)
        self.endpoint_is_mine = endpoint_is_mine
        self.dir = f"/emsd/{cluster}/nodes"
        self.path = f"{self.dir}/{me.node_id}"
        self.placement = placement
        self.record_path = placement_record.path(cluster)
        self.record: Record | None = None  # the cluster's placement record, once read
        self._record_callbacks: list[RecordCallback] = []
        self.state = MembershipState.CONNECTING
        self.transitions: list[MembershipState] = []  # every state entered, in order (metrics, tests)
        self._zk = KazooClient(hosts=hosts, timeout=session_timeout,
                               connection_retry=KazooRetry(max_tries=-1, max_delay=2.0),
                               command_retry=KazooRetry(max_tries=3, max_delay=1.0))
        self._view: dict[str, NodeInfo] = {me.node_id: me}
        self._callbacks: list[ViewCallback] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._need_register = True
        self._need_refresh = True
        self._stopped = False
        self._watching = False
        self._worker = threading.Thread(target=self._run, name="emsd-membership", daemon=True)

    # -- interface ----------------------------------------------------------------

    def start(self, timeout: float = 5.0) -> None:
        """Join; raises ``DuplicateNodeError`` if the id is live elsewhere.

        Returns within about ``timeout`` seconds whether or not ZooKeeper
        answers; without it, or when the connection drops while joining (a
        missed heartbeat on a busy host), the join completes in the background.
        """
        self._zk.add_listener(self._on_state)
        event = self._zk.start_async()
        event.wait(timeout)
        if self._zk.connected:
            try:
                self._register()  # in the caller's thread, so a duplicate id fails start()
                self._refresh()
            except (KazooException, KazooTimeoutError) as exc:
                log.warning("ZooKeeper call failed while joining (%r); joining in the background", exc)
                self._wake.set()
        else:
            log.warning("ZooKeeper %s unreachable; serving locally, joining in the background",
                        self._zk.hosts)
        self._worker.start()

    def stop(self) -> None:
        """Leave the cluster (delete our znode, if it is ours) and close the client.

        A znode of this id that another session created (a live daemon that refused
        us as a duplicate) is left alone: deleting it would take that daemon out of
        every view.
        """
        self._stopped = True
        self._wake.set()
        if self._worker.is_alive():
            self._worker.join(5)
        try:
            if self._zk.connected:
                stat = self._zk.exists(self.path)
                if stat is not None and stat.ephemeralOwner == self._zk.client_id[0]:
                    self._zk.delete(self.path, version=stat.version)
        except KazooException:  # NoNodeError (gone meanwhile) included: nothing of ours to delete
            pass
        self._zk.stop()
        self._zk.close()

    def members(self) -> tuple[NodeInfo, ...]:
        with self._lock:
            return tuple(sorted(self._view.values(), key=lambda n: n.node_id))

    def on_change(self, callback: ViewCallback) -> None:
        self._callbacks.append(callback)

    def on_placement(self, callback: RecordCallback) -> None:
        """Call ``callback(record)`` (from a kazoo thread) for the record now known and every change."""
        self._record_callbacks.append(callback)
        if self.record is not None:
            callback(self.record)

    def set_placement(self, vnodes: int, replicas: int) -> Record:
        """Rewrite the cluster's placement record (``emsctl placement set``); returns the new one.

        A compare-and-set on the znode's version, retried when another writer came first,
        so two concurrent changes both count in ``version``. Raises ``NotWritten`` when
        ZooKeeper does not answer.
        """
        if not self._zk.connected:  # kazoo would queue the write until it reconnects
            raise NotWritten(f"ZooKeeper {self.hosts} is not connected ({self.state.value})")
        try:
            return self._write_placement(vnodes, replicas)
        except (KazooException, KazooTimeoutError) as exc:
            raise NotWritten(f"ZooKeeper {self.hosts}: {exc!r}") from None

    def _write_placement(self, vnodes: int, replicas: int) -> Record:
        self._zk.ensure_path(self.record_path.rsplit("/", 1)[0])
        while True:
            try:
                data, stat = self._zk.get(self.record_path)
            except NoNodeError:
                new = Record(vnodes, replicas)
                try:
                    self._zk.create(self.record_path, new.encode())
                    return new
                except NodeExistsError:
                    continue
            old = Record.decode(data)
            new = Record(vnodes, replicas, (old.version if old else 0) + 1)
            try:
                self._zk.set(self.record_path, new.encode(), version=stat.version)
                return new
            except BadVersionError:
                continue

    # -- kazoo callbacks (kazoo's threads: set flags, wake the worker) ----------------

    def _on_state(self, state: str) -> None:
        if state == KazooState.SUSPENDED:
            self._enter(MembershipState.SUSPENDED)
            log.warning("ZooKeeper connection suspended; keeping the last view")
        elif state == KazooState.LOST:
            self._enter(MembershipState.LOST)
            if self._stopped:  # ``stop`` closed the session: kazoo reports that as lost too
                return
            self._need_register = True
            log.warning("ZooKeeper session lost; keeping the last view, will re-register")
        else:  # CONNECTED: make sure we are registered and the view is fresh
            self._need_register = True
            self._need_refresh = True
            self._wake.set()

    def _on_children(self, _children: list[str]) -> None:
        self._need_refresh = True
        self._wake.set()

    # -- worker ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stopped or not self._zk.connected:
                continue
            if self.faults is not None:
                self._inject_session_fault(self.faults)
            try:
                if self._need_register:
                    self._register()
                if self._need_refresh:
                    self._refresh()
            except DuplicateNodeError as exc:
                log.error("%s; staying out of the cluster", exc)
                self._need_register = False
                self._enter(MembershipState.LOST)
            except KazooException as exc:
                log.warning("ZooKeeper call failed (%s); will retry", exc)
                self._wake.set()

    def _inject_session_fault(self, faults: Faults) -> None:
        """An injected fault at ``zk.session`` (tests only: ``emsd.faults``).

        ``error`` expires our session the way ZooKeeper does when a client
        goes silent: a second client attaches to the session and closes it,
        so our znode goes and we see LOST, then re-register. ``drop`` cuts
        the connection (SUSPENDED, then a reconnect to the same session).
        ``delay`` stalls this worker, delaying every ZooKeeper call it makes.
        """
        rule = faults.at("zk.session")
        if rule is None:
            return
        log.warning("injected fault at zk.session: %s", rule.action)
        if rule.action == "delay":
            time.sleep(rule.seconds)
        elif rule.action == "drop":
            self._zk._call(_CONNECTION_DROP, None)
        else:
            thief = KazooClient(hosts=self.hosts, client_id=self._zk.client_id)
            try:
                thief.start(timeout=5)
                thief.stop()  # closes the session on the server: our ephemeral znode goes with it
            except (KazooException, KazooTimeoutError) as exc:
                log.warning("injected zk.session expiry did not happen: %s", exc)
            finally:
                thief.close()

    def _register(self) -> None:
        data = self.me.encode()
        self._zk.ensure_path(self.dir)
        for _ in range(CLAIM_ATTEMPTS):
            if self._claim(data):
                break
        else:  # the znode kept changing under us: a KazooException, retried like any other
            raise NodeExistsError(f"{self.path} changed {CLAIM_ATTEMPTS} times while registering")
        self._need_register = False
        if not self._watching:
            if self.placement is not None:
                self._follow_placement(self.placement)
            self._zk.ChildrenWatch(self.dir, self._on_children)
            self._watching = True
        if self.state is not MembershipState.JOINED:
            log.info("joined cluster at %s as %s", self.dir, self.me.node_id)
        self._enter(MembershipState.JOINED)

    def _claim(self, data: bytes) -> bool:
        """Create this node's ephemeral znode, or take over its own or its dead predecessor's
        (same endpoint). False when the znode changed between two calls (the predecessor's
        session expired meanwhile, or it was just replaced): the caller tries again. Raises
        ``DuplicateNodeError`` when another live emsd holds the id."""
        try:
            self._zk.create(self.path, data, ephemeral=True)
            return True
        except NodeExistsError:
            pass
        try:
            old, stat = self._zk.get(self.path)
        except NoNodeError:
            return False  # the old session expired between the create and the get
        if stat.ephemeralOwner == self._zk.client_id[0]:
            self._zk.set(self.path, data)
            return True
        if not (self.endpoint_is_mine and _endpoint(old) == self.me.peer_addr):
            raise DuplicateNodeError(
                f"node id {self.me.node_id!r} is already registered by another live emsd "
                f"(ZooKeeper session {stat.ephemeralOwner:#x}); give each node a unique node.id")
        log.warning("replacing the registration of this node's previous process (session %#x, "
                    "same endpoint %s): it died before its session expired",
                    stat.ephemeralOwner, self.me.peer_addr)
        try:
            self._zk.delete(self.path, version=stat.version)
        except (NoNodeError, BadVersionError):
            pass  # gone or changed meanwhile: the next attempt looks again
        return False

    def _follow_placement(self, mine: Params) -> None:
        """Create the placement record from ``mine`` unless there is one (exactly one creator
        wins the race), then watch it."""
        try:
            self._zk.create(self.record_path, Record(*mine).encode(), makepath=True)
            log.info("placement record %s created: vnodes=%d replicas=%d", self.record_path, *mine)
        except NodeExistsError:
            pass
        self._zk.DataWatch(self.record_path, self._on_record)

    def _on_record(self, data: bytes | None, _stat: Any) -> None:
        """kazoo's thread: a new record (a deleted or unreadable one keeps the last)."""
        if data is None:
            log.warning("placement record %s is gone; keeping vnodes/replicas as they were", self.record_path)
            return
        record = Record.decode(data)
        if record is None:
            log.error("placement record %s is malformed (%r); keeping the last one",
                      self.record_path, data[:200])
            return
        if record == self.record:
            return
        self.record = record
        for callback in self._record_callbacks:
            try:
                callback(record)
            except Exception:  # a broken callback must not stop the watch
                log.exception("placement callback failed")

    def _refresh(self) -> None:
        self._need_refresh = False
        view: dict[str, NodeInfo] = {self.me.node_id: self.me}
        for child in self._zk.get_children(self.dir):
            try:
                data, _ = self._zk.get(f"{self.dir}/{child}")
                info = NodeInfo.decode(data)
            except NoNodeError:
                continue
            except ValueError as exc:
                log.warning("ignoring malformed member %s: %s", child, exc)
                continue
            if info.node_id == child:
                view[child] = info
        with self._lock:
            changed = view != self._view
            self._view = view
        if changed:
            members = self.members()
            log.info("cluster view: %s", ", ".join(n.node_id for n in members))
            for callback in self._callbacks:
                try:
                    callback(members)
                except Exception:  # a broken callback must not stop membership
                    log.exception("membership callback failed")

    def _enter(self, state: MembershipState) -> None:
        if state is not self.state or not self.transitions:
            self.transitions.append(state)
        self.state = state

    def debug_state(self) -> dict[str, Any]:
        return {"state": self.state.value, "members": [n.node_id for n in self.members()]}
