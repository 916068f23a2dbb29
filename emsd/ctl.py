"""``emsctl``: the operator's command line for the local emsd.

    emsctl [--socket-dir DIR] [--json] status
    emsctl [--socket-dir DIR] [--json] stats [--interval SECONDS]
    emsctl [--socket-dir DIR] [--json] owner --namespace NAME KEY [KEY ...]
    emsctl [--socket-dir DIR] [--json] drain [--timeout SECONDS]
    emsctl [--socket-dir DIR] [--json] [--access-id ID] drop --namespace NAME [--timeout SECONDS]
    emsctl [--socket-dir DIR] [--json] placement set --vnodes N --replicas R
    emsctl [--json] config check FILE

It talks to the daemon over its Unix socket (``--socket-dir``, else
``$EMS_SOCKET_DIR``, else /dev/shm/ems) and, for ``stats``, reads the
daemon's ``/metrics`` twice, ``--interval`` apart. It never writes to
ZooKeeper: ``drain`` asks the daemon to leave the ring itself, ``placement
set`` asks it to rewrite the cluster's placement record. Tables by
default, ``--json`` for scripts. Exit status: 0 done, 1 the daemon could
not be reached or refused, 2 a bad command line or config file.

emsctl speaks for the default tenant, or with ``--access-id ID`` for tenant
ID, whose key it takes from ``$EMS_ACCESS_KEY`` only (a command line is
visible to every user of the host). ``drain`` and ``placement set`` change
the cluster for every tenant: they are the operator's, and a daemon with a
tenants file takes them only from emsctl without ``--access-id`` run as root
or as the daemon's user (``Service.operator``). Such a connection is served
on a daemon of tenants only (no ``tenants.allow_default``) too, for
``status``, ``stats``, ``owner``, ``drain`` and ``placement set`` alone. And
``drop`` of a tenant's namespace needs that tenant, since the daemon keeps
tenants' namespaces apart.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from emsd.config import ConfigError, load_config
from emsd.pool.keys import KeyBatch, KeyError_
from emsd.protocol.local import (
    DropAnswer,
    DropRequest,
    NamespaceAnswer,
    NamespaceRequest,
    OwnerAnswer,
    OwnerRequest,
    PlacementRequest,
)
from emsd.tenants import PREFIX as TENANT_PREFIX
from emsd.transport.frames import PROTOCOL_VERSION, SOCKET_NAME, FrameDecoder, FrameError, Op, encode_parts

DEFAULT_SOCKET_DIR = "/dev/shm/ems"


class CtlError(Exception):
    """A failure to report in one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Control:
    """A control connection without the pool mapping (the HELLO's descriptor is closed at once)."""

    def __init__(self, socket_dir: Path, timeout: float = 10.0, access_id: str | None = None,
                 access_key: str | None = None) -> None:
        """Connect as the default tenant, or as tenant ``access_id`` with ``access_key``."""
        self.path = socket_dir / SOCKET_NAME
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout)
        self.decoder = FrameDecoder()
        self.ids = 0
        hello: dict[str, Any] = {"pid": os.getpid()}
        if access_id is not None:
            hello |= {"access_id": access_id, "access_key": access_key}
        else:  # on a daemon of tenants only: a session of operator commands (Service.hello)
            hello["operator"] = True
        try:
            self.sock.connect(str(self.path))
            self._send(Op.HELLO, hello)
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
            for fd in fds:
                os.close(fd)
            frames = self.decoder.feed(data)
        except OSError as exc:
            self.sock.close()
            raise CtlError(f"cannot reach emsd at {self.path}: {exc}") from None
        if not frames or frames[0].header.get("st") != 0:
            why = frames[0].header.get("msg") if frames else "no answer"
            self.sock.close()
            raise CtlError(f"emsd refused the connection: {why}")

    def call(self, op: Op, fields: dict[str, Any], payload: list[bytes] | tuple[()] = (),
             timeout: float = 10.0) -> dict[str, Any]:
        """Send one request (``fields`` and ``payload`` as ``emsd.protocol.local`` encodes it) and
        return its answer's header; ``CtlError`` if the daemon refuses or does not answer."""
        rid = self._send(op, fields, *payload)
        self.sock.settimeout(timeout)
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except OSError as exc:
                raise CtlError(f"emsd did not answer: {exc}") from None
            if not data:
                raise CtlError("emsd closed the connection")
            for frame in self.decoder.feed(data):
                if frame.header.get("id") == rid:
                    if frame.header.get("st"):
                        raise CtlError(f"emsd refused: {frame.header.get('msg')}")
                    return frame.header

    def _send(self, op: Op, fields: dict[str, Any], *payload: bytes) -> int:
        self.ids += 1
        header = {"v": PROTOCOL_VERSION, "id": self.ids, "op": int(op), **fields}
        self.sock.sendall(b"".join(encode_parts(header, *payload)))
        return self.ids

    def close(self) -> None:
        self.sock.close()


# -- commands -------------------------------------------------------------------------------


def status(ctl: Control) -> dict[str, Any]:
    return ctl.call(Op.STATS, {})


def show_status(st: dict[str, Any]) -> str:
    gib = 1 << 30
    lines = [
        f"node        {st['node']}   emsd {st.get('version', '?')}   pid {st.get('pid', '?')}",
        f"pool        {st['capacity'] / gib:.2f} GiB {st['region']}   used {st['bytes_used'] / gib:.2f} GiB"
        f" (granted {st.get('granted', 0) / gib:.2f})   free {st['bytes_free'] / gib:.2f} GiB",
        f"blocks      {st['entries']} (read-cache copies {st['cached']}, pinned {st['pinned']},"
        f" pending {st['pending']})   namespaces {st['namespaces']}   clients {st.get('clients', '?')}",
        f"evictions   {', '.join(f'{k} {v}' for k, v in sorted(st['evictions'].items())) or 'none'}",
        f"restart     {st.get('restart', '?')} ({st.get('restored', 0)} blocks restored)",
        *_disk(st.get("disk")),
        *_prefault(st.get("prefault")),
        f"membership  {st['membership']}{'  (draining)' if st.get('draining') else ''}"
        f"   transport {st.get('transport', '?')}",
        *_handoff(st.get("handoff")),
        *_placement_differs(st),
        "",
        table(["member", "capacity GiB", "share", "peer", "via"],
              [[m["id"], f"{m['capacity'] / gib:.2f}", f"{st['share'].get(m['id'], 0.0):.1%}", m["peer"],
                _via(st.get("peer_transports", {}).get(m["id"]))]
               for m in st.get("view", [])]),
    ]
    return "\n".join(lines)


def _handoff(h: dict[str, Any] | None) -> list[str]:
    """The handoff's line (none standalone, and none before its first pass)."""
    if not h or not h.get("passes"):
        return []
    return [f"handoff     {h['moved']} blocks moved to new owners, {h['kept']} kept, in {h['passes']} passes"
            f" ({h['seconds']:.1f} s)"]


def _prefault(p: dict[str, Any] | None) -> list[str]:
    """The background prefault's line (none when the pool was prefaulted before serving, or not)."""
    if p is None:
        return []
    gib = 1 << 30
    state = ("done" if p["done"] == p["total"] else f"stopped: {p['error']}") if p["finished"] else "running"
    share = 100 * p["done"] / max(p["total"], 1)
    return [f"prefault    {p['done'] / gib:.2f} of {p['total'] / gib:.2f} GiB ({share:.0f}%)"
            f" in {p['seconds']:.1f} s, {state}"]


def _disk(d: dict[str, Any] | None) -> list[str]:
    """The disk tier's line (none when it is not configured)."""
    if d is None:
        return []
    if "capacity" not in d:
        return [f"disk        {d['dir']}   OFF: {d.get('failed', '?')}"]
    gib = 1 << 30
    dropped = sum(d["dropped"].values())
    return [f"disk        {d['capacity'] / gib:.2f} GiB in {d['dir']}   used {d['bytes_used'] / gib:.2f} GiB"
            f"   blocks {d['blocks']}   queue {d['queued']}   writes {d['writes']}   reads {d['reads']}"
            f"   dropped {dropped}   {'O_DIRECT' if d['direct'] else 'buffered'}"
            + (f"   FAILED: {d['failed']}" if d["failed"] else "")]


def _placement_differs(st: dict[str, Any]) -> list[str]:
    """One line per member that places keys otherwise than this node (none when all agree), and one
    when this node's config differs from the cluster's placement record it follows."""
    own = st.get("placement_config", {})
    mine = ([f"PLACEMENT   this node's config vnodes={own.get('vnodes')} replicas={own.get('replicas')} "
             f"differs from the cluster's record vnodes={st.get('vnodes')} replicas={st.get('replicas')} "
             f"(version {st.get('placement_record')}): the record is used"]
            if st.get("placement_config_differs") else [])
    return mine + [
        f"PLACEMENT   {node} uses vnodes={p.get('vnodes')} replicas={p.get('replicas')}, this node "
        f"vnodes={st.get('vnodes')} replicas={st.get('replicas')}: loads between them miss"
        for node, p in sorted(st.get("placement_differs", {}).items())]


def _via(path: dict[str, str] | None) -> str:
    """How blocks move with a member: "rdma", "tcp (why not RDMA)", or "-" (not dialed yet, or this node)."""
    if not path:
        return "-"
    why = path["reason"] if path["transport"] == "tcp" else ""
    return f"{path['transport']} ({why})" if why else path["transport"]


def stats(ctl: Control, interval: float) -> dict[str, Any]:
    st = ctl.call(Op.STATS, {})
    url = st.get("metrics")
    if not url:
        raise CtlError("this daemon serves no metrics (metrics.listen is off)")
    before = _scrape(url)
    time.sleep(interval)
    after = _scrape(url)
    rates = {k: (after[k] - before.get(k, 0.0)) / interval for k in after if k[0].endswith("_total")}
    ops: dict[str, float] = {}
    keys: dict[tuple[str, str], float] = {}
    for (name, labels), rate in rates.items():
        lab = dict(labels)
        if name == "emsd_ops_total":
            ops[lab["op"]] = ops.get(lab["op"], 0.0) + rate
        elif name == "emsd_lookup_keys_total":
            keys[(lab["op"], lab["result"])] = rate
    hits, misses = keys.get(("pin", "hit"), 0.0), keys.get(("pin", "miss"), 0.0)
    total = {k: v for k, v in after.items() if k[0] == "emsd_lookup_keys_total"}
    all_hits = sum(v for k, v in total.items() if dict(k[1]) == {"op": "pin", "result": "hit"})
    all_keys = sum(v for k, v in total.items() if dict(k[1]).get("op") == "pin")
    return {"interval_s": interval, "ops_per_s": ops,
            "load_hit_ratio": hits / (hits + misses) if hits + misses else None,
            "load_hit_ratio_since_start": all_hits / all_keys if all_keys else None,
            "peer_bytes_per_s": {dict(k[1]).get("peer", "") + "/" + dict(k[1]).get("direction", ""): v
                                 for k, v in rates.items() if k[0] == "emsd_peer_bytes_total"}}


def show_stats(s: dict[str, Any]) -> str:
    ratio = s["load_hit_ratio"]
    since = s["load_hit_ratio_since_start"]
    lines = [table(["op", "per second"], [[op, f"{r:.1f}"] for op, r in sorted(s["ops_per_s"].items())]),
             "",
             f"load hit ratio  {'-' if ratio is None else f'{ratio:.1%}'} over {s['interval_s']:g} s,"
             f" {'-' if since is None else f'{since:.1%}'} since start"]
    if s["peer_bytes_per_s"]:
        lines += ["", table(["peer/direction", "MB/s"],
                            [[k, f"{v / 1e6:.1f}"] for k, v in sorted(s["peer_bytes_per_s"].items())])]
    return "\n".join(lines)


def owner(ctl: Control, namespace: str, raw_keys: list[str]) -> dict[str, Any]:
    keys = [_key(k) for k in raw_keys]
    try:
        batch = KeyBatch.from_user(keys)
    except KeyError_ as exc:
        raise CtlError(f"KEY: {exc}", 2) from None
    answer = ctl.call(Op.OWNER, *OwnerRequest(namespace, batch).encode())
    owners = _decoded(OwnerAnswer.decode, answer, len(keys)).owners
    return {"namespace": namespace, "owners": dict(zip(raw_keys, owners, strict=True))}


def show_owner(o: dict[str, Any]) -> str:
    return table(["key", "owners (primary first)"], [[k, ", ".join(v)] for k, v in o["owners"].items()])


def drain(ctl: Control, timeout: float, progress: bool) -> dict[str, Any]:
    """Leave the ring and move owned blocks, a step at a time, printing progress."""
    deadline = time.monotonic() + timeout
    moved = failed = 0
    while True:
        step = ctl.call(Op.DRAIN, {"to": 2000}, timeout=30)
        moved, failed = moved + step["moved"], failed + step["failed"]
        if progress:
            print(f"drain: {moved} blocks moved, {failed} not taken, {step['remaining']} to go",
                  file=sys.stderr, flush=True)
        if step["remaining"] == 0:
            return {"moved": moved, "failed": failed, "remaining": 0}
        if time.monotonic() > deadline:
            raise CtlError(f"drain: {step['remaining']} blocks still to move after {timeout:g} s")


def drop(ctl: Control, namespace: str, timeout: float) -> dict[str, Any]:
    """Drop a namespace on this node and every member of its cluster (``Service.drop_namespace``).

    ``namespace`` is the name ``ctl``'s tenant uses (``tenant_name``).
    """
    opened = ctl.call(Op.NAMESPACE, *NamespaceRequest(namespace).encode())
    ns = _decoded(NamespaceAnswer.decode, opened).ns
    request = DropRequest(ns, max(1, int(timeout * 1000)))
    answer = _decoded(DropAnswer.decode, ctl.call(Op.DROP, *request.encode(), timeout=timeout + 5))
    if answer.missed:
        raise CtlError(f"drop: {answer.missed} cluster member(s) did not confirm; their blocks "
                       "may still be found (run it again)")
    return {"namespace": namespace, "dropped": answer.dropped}


def tenant_name(namespace: str, access_id: str | None) -> str:
    """The name tenant ``access_id`` (None: the default tenant) opens for ``namespace``: the
    name its clients use, or the daemon's name of it that ``status`` lists
    (``tenant:<id>/<name>``). Raises ``CtlError`` for another tenant's namespace."""
    if not namespace.startswith(TENANT_PREFIX):
        return namespace
    tenant, _, name = namespace[len(TENANT_PREFIX) :].partition("/")
    if tenant == access_id:
        return name
    raise CtlError(f"{namespace} is a namespace of tenant {tenant!r}: run emsctl --access-id {tenant} "
                   "with the tenant's key in $EMS_ACCESS_KEY", 2)


def config_check(path: str) -> dict[str, Any]:
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        raise CtlError(f"{path}: {exc}", 2) from None
    return {"file": path, "ok": True, "node": cfg.node.id, "pool_bytes": cfg.pool.size,
            "cluster": cfg.cluster.name if cfg.cluster.enabled else None}


# -- helpers -------------------------------------------------------------------------------


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [head, *rows])


def _decoded(decode: Any, header: dict[str, Any], *asked: int) -> Any:
    """``decode(header, b"", *asked)`` of an answer (``emsd.protocol.local``); ``CtlError`` if it
    does not fit its request."""
    try:
        return decode(header, b"", *asked)
    except FrameError as exc:
        raise CtlError(f"malformed answer from emsd: {exc}") from None


def _key(text: str) -> int | bytes:
    """An int key, or bytes given as 0x-prefixed hex."""
    try:
        return bytes.fromhex(text[2:]) if text.lower().startswith("0x") else int(text)
    except ValueError:
        raise CtlError(f"KEY {text!r}: give an integer or 0x-prefixed hex bytes", 2) from None


def _scrape(listen: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    host, _, port = listen.rpartition(":")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host.strip("[]")
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError as exc:
        raise CtlError(f"cannot read metrics from {listen}: {exc}") from None
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def placement_set(ctl: Control, vnodes: int, replicas: int) -> dict[str, Any]:
    """Rewrite the cluster's placement record (``emsd.placement.record``) through the local daemon;
    every node rebuilds its ring from it. Returns the new record."""
    answer = ctl.call(Op.PLACEMENT, *PlacementRequest(vnodes, replicas).encode(), timeout=30)
    return {k: answer[k] for k in ("vnodes", "replicas", "version")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emsctl", description="operate the local emsd")
    p.add_argument("--socket-dir", default=os.environ.get("EMS_SOCKET_DIR", DEFAULT_SOCKET_DIR),
                   help="the daemon's node.socket_dir (default $EMS_SOCKET_DIR or /dev/shm/ems)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--access-id", default=None,
                   help="speak for this tenant (its key from $EMS_ACCESS_KEY); default: the default tenant")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="this node and the cluster view")
    st = sub.add_parser("stats", help="request rates and hit ratio")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between the two samples")
    ow = sub.add_parser("owner", help="which nodes own keys")
    ow.add_argument("--namespace", required=True,
                    help="the namespace name the keys live in (emsctl --json status lists them)")
    ow.add_argument("keys", nargs="+", metavar="KEY", help="an integer, or 0x-prefixed hex bytes")
    dr = sub.add_parser("drain", help="leave the ring and move owned blocks away")
    dr.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    dp = sub.add_parser("drop", help="forget every block of a namespace, on every node (e.g. after a "
                        "weight update)")
    dp.add_argument("--namespace", required=True, help="its name (emsctl --json status lists them)")
    dp.add_argument("--timeout", type=float, default=10.0, help="seconds the other nodes have to confirm")
    pl = sub.add_parser("placement", help="the cluster's ring parameters (ZooKeeper clusters)")
    pl_sub = pl.add_subparsers(dest="placement_cmd", required=True)
    ps = pl_sub.add_parser("set", help="change vnodes and replicas on every node at once (blocks placed "
                           "under the old values are found by their old owners only)")
    ps.add_argument("--vnodes", type=int, required=True, help="ring points per member, 1..4096")
    ps.add_argument("--replicas", type=int, required=True, help="owners per key, 1..8")
    cf = sub.add_parser("config", help="config files")
    cf_sub = cf.add_subparsers(dest="config_cmd", required=True)
    check = cf_sub.add_parser("check", help="validate a config file")
    check.add_argument("file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "config":
            out, text = config_check(args.file), None
            text = f"{args.file}: ok (node {out['node']}, cluster {out['cluster'] or 'none'})"
        else:
            key = os.environ.get("EMS_ACCESS_KEY") or None
            if args.access_id is not None and key is None:
                raise CtlError("--access-id needs the tenant's key in $EMS_ACCESS_KEY", 2)
            if args.cmd == "drop":
                args.namespace = tenant_name(args.namespace, args.access_id)
            ctl = Control(Path(args.socket_dir), access_id=args.access_id, access_key=key)
            try:
                if args.cmd == "status":
                    out = status(ctl)
                    text = show_status(out)
                elif args.cmd == "stats":
                    out = stats(ctl, args.interval)
                    text = show_stats(out)
                elif args.cmd == "owner":
                    out = owner(ctl, args.namespace, args.keys)
                    text = show_owner(out)
                elif args.cmd == "drop":
                    out = drop(ctl, args.namespace, args.timeout)
                    text = f"dropped {out['namespace']}: {out['dropped']} blocks evicted on this node"
                elif args.cmd == "placement":
                    out = placement_set(ctl, args.vnodes, args.replicas)
                    text = (f"placement record version {out['version']}: vnodes={out['vnodes']} "
                            f"replicas={out['replicas']} on every node")
                else:
                    out = drain(ctl, args.timeout, progress=not args.json)
                    text = f"drained: {out['moved']} blocks moved, {out['failed']} not taken"
            finally:
                ctl.close()
    except CtlError as exc:
        print(f"emsctl: {exc}", file=sys.stderr)
        return exc.code
    print(json.dumps(out, indent=2, default=str) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
