"""100,000 hostile frames against a live daemon: it answers or hangs up, stays up, keeps its data.

A seeded generator (the seed is printed on failure; ``EMS_FUZZ_SEED`` and
``EMS_FUZZ_FRAMES`` override it and the count) writes frames of five kinds
onto authenticated control connections:

- well-framed requests with fuzzed headers: known and unknown ops, fields of
  every wrong type and range, payloads of random length and content, and
  out-of-order calls (COMMIT, RELEASE of handles never given out, RESERVE
  without COMMIT, GRANT without PUT); half the GRANTs ask for plausible
  chunks and half the PUTs name chunks granted on the connection (some
  twice, some with a wrong size, some stale), so that real grants are used,
  given back and left behind;
- byte-flipped copies of valid frames;
- frames cut short, then the connection closed;
- oversized length prefixes;
- raw noise.

After each well-framed request a PING marks the end of its answers, since
some ops (RELEASE) never answer. Throughout, a real SDK client's blocks
must load with identical bytes; at the end nothing stays reserved or
pinned or granted, and the daemon's memory has not grown beyond a small bound.

The peer port's path before authentication gets the same treatment
(``EMS_FUZZ_PEER`` connections, each sending one hostile AUTH exchange): AUTH
frames with fuzzed fields, byte-flipped and cut-short ones, oversized length
prefixes and noise. Each is refused and hung up on, the daemon stays up
within a memory bound, and the cluster still moves blocks afterwards.

So does the HTTP endpoint (``EMS_FUZZ_HTTP`` requests): request heads with
random methods, paths, versions and headers, over-long lines, too many
lines, binary noise, heads cut short. Each gets an answer or a hang-up, and
/healthz and /metrics still answer, with memory flat.

Memory is the daemon's private resident memory (``memory.private_rss``):
pool pages that the background prefault or a save touches are shared
memory, not growth (on a slow machine the prefault was still running when
the baseline was taken, and RSS grew by 20 MiB of pool pages).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from memory import private_rss
from test_attack_peer import cluster_still_works, pair  # noqa: F401 (pair: two clustered daemons)

from ems import CcConfig, Ems, EmsConfig
from ems.client import DaemonClient
from emsd.transport.frames import PROTOCOL_VERSION, Op, PeerOp
from emsd.transport.peer import NONCE_BYTES

SEED = int(os.environ.get("EMS_FUZZ_SEED", "20261123"))
FRAMES = int(os.environ.get("EMS_FUZZ_FRAMES", "100000"))
PEER_CONNECTIONS = int(os.environ.get("EMS_FUZZ_PEER", "3000"))
HTTP_REQUESTS = int(os.environ.get("EMS_FUZZ_HTTP", "3000"))
MARK = 0x7FFF_FFF0  # the PING's request id: the end of a fuzz frame's answers
WEIRD: list[Any] = [0, 1, -1, 2, 7, 255, 65536, 65537, 2**31, 2**32 + 5, -(2**40), 2**63, 1.5, "x", "",
                    b"\x00" * 3, None, True, [], [1, 2], {}, {"a": 1}, "\u2603" * 40]
OPS = [int(op) for op in Op if op != Op.HELLO]
FIELDS = ["ns", "n", "kt", "c", "a", "to", "lo", "wr", "name", "tenant", "bulk", "count", "op", "v", "id",
          "size", "k"]
GRANT_ID, PUT_ID = 0x7FFF_FF00, 0x7FFF_FF01  # plausible GRANTs and PUTs: their answers are read
GRANT_SIZES = [64, 4096, 8192]


class Conn:
    """A control connection past HELLO, with frame-level send and receive."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(path)
        head = msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": int(Op.HELLO)})
        self.sock.sendall(struct.pack("<II", len(head), 0) + head)
        data, fds, _, _ = socket.recv_fds(self.sock, 65536, 1)
        for fd in fds:
            os.close(fd)
        assert msgpack.unpackb(data[8:])["st"] == 0
        self.buf = b""
        self.payload = b""  # of the last answer read
        self.granted: list[tuple[int, int]] = []  # (offset, size) of chunks granted here, maybe stale
        self.sent: dict[str, Any] = {}  # the last plausible GRANT's size, PUT's chunks
        self.ns: int | None = None  # a namespace opened here (learnt from a NAMESPACE answer)

    def frame(self) -> dict[str, Any] | None:
        """The next answer's header (its payload in ``payload``); None once the daemon hung up."""
        while True:
            if len(self.buf) >= 8:
                hlen, plen = struct.unpack_from("<II", self.buf)
                if len(self.buf) >= 8 + hlen + plen:
                    head = msgpack.unpackb(self.buf[8 : 8 + hlen])
                    self.payload = self.buf[8 + hlen : 8 + hlen + plen]
                    self.buf = self.buf[8 + hlen + plen :]
                    assert isinstance(head, dict) and "st" in head, head
                    self.learn(head)
                    return head
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.buf += chunk

    def learn(self, head: dict[str, Any]) -> None:
        """Keep track of the chunks a plausible GRANT got and a plausible PUT used."""
        if head.get("st") != 0:
            return
        if type(head.get("ns")) is int:
            self.ns = head["ns"]
        if head.get("id") == GRANT_ID and "size" in self.sent:
            offsets = struct.unpack(f"<{len(self.payload) // 8}Q", self.payload)
            self.granted += [(o, self.sent["size"]) for o in offsets]
        elif head.get("id") == PUT_ID and "at" in self.sent and len(self.payload) == len(self.sent["at"]):
            used = {o for o, st in zip(self.sent["at"], self.payload, strict=True) if st == 0}
            self.granted = [g for g in self.granted if g[0] not in used]

    def close(self) -> None:
        self.sock.close()


def _frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = msgpack.packb(header)
    return struct.pack("<II", len(head), len(payload)) + head + payload


def fuzzed_request(rng: random.Random, conn: Conn | None = None) -> bytes:
    """A well-framed request whose header and payload are fuzzed (GRANT and PUT sometimes
    plausible, with the chunks ``conn`` was granted)."""
    header: dict[Any, Any] = {"v": PROTOCOL_VERSION, "id": rng.randrange(1000),
                              "op": rng.choice(OPS) if rng.random() < 0.85 else
                              rng.choice(WEIRD)}
    if header["op"] == Op.NAMESPACE and rng.random() < 0.5:
        header["name"] = f"fuzz{rng.randrange(4)}"
    if rng.random() < 0.7:
        header["ns"] = rng.randrange(3)
    if rng.random() < 0.7:
        header["n"] = rng.randrange(6)
        header["kt"] = rng.randrange(2)
    for _ in range(rng.randrange(4)):
        header[rng.choice(FIELDS)] = rng.choice(WEIRD)
    if rng.random() < 0.05:
        header[rng.choice([3, 1.5, None, b"k", True])] = 1  # keys that are not strings
    payload = rng.randbytes(rng.choice([0, 4, 8, 16, 40, 48, 99, 264, 1 << rng.randrange(4, 15)]))
    if header.get("op") == Op.RESERVE and rng.random() < 0.5:  # plausible sizes: real reservations
        n = min(max(int(header["n"]), 0), 64) if type(header.get("n")) is int else 1
        keys = rng.randbytes(8 * n)
        sizes = struct.pack(f"<{n}Q", *(rng.randrange(1, 1 << 20) for _ in range(n)))
        payload = keys + sizes
    if conn is not None and header.get("op") in (Op.GRANT, Op.PUT) and rng.random() < 0.5:
        header, payload = _plausible(rng, header, conn)
    try:
        return _frame(header, payload)
    except (TypeError, ValueError):
        return _frame({"v": PROTOCOL_VERSION, "id": 0, "op": int(Op.PING)})


def _plausible(rng: random.Random, header: dict[Any, Any], conn: Conn) -> tuple[dict[Any, Any], bytes]:
    """A GRANT of real sizes (giving some chunks back), or a PUT into chunks ``conn`` was
    granted: mostly right, sometimes a chunk twice, a wrong size or a stale chunk."""
    if header["op"] == Op.GRANT:
        size = rng.choice(GRANT_SIZES)
        back = rng.sample(conn.granted, rng.randrange(min(len(conn.granted), 3) + 1)) \
            if rng.random() < 0.2 else []
        conn.granted = [g for g in conn.granted if g not in back]
        conn.sent = {"size": size}
        header.update(id=GRANT_ID, size=size, k=rng.randrange(6))
        return header, b"".join(struct.pack("<Q", o) for o, _ in back)
    n = rng.randrange(1, min(len(conn.granted), 4) + 1) if conn.granted else 1
    chosen = rng.sample(conn.granted, n) if conn.granted else [(rng.randrange(1 << 26), 64)]
    if rng.random() < 0.1:
        chosen.append(chosen[0])  # a chunk named twice
    at = [o for o, _ in chosen]
    sizes = [size if rng.random() < 0.9 else size + rng.choice([-64, 1, 4096]) for _, size in chosen]
    conn.sent = {"at": at}
    header.update(id=PUT_ID, n=len(at), kt=0)
    if conn.ns is not None:
        header["ns"] = conn.ns
    keys = struct.pack(f"<{len(at)}Q", *(rng.randrange(1 << 64) for _ in at))
    return header, keys + struct.pack(f"<{2 * len(at)}Q", *at, *(max(s, 0) for s in sizes))


def broken_bytes(rng: random.Random, kind: int) -> bytes:
    """Bytes after which the daemon may hang up: flipped, truncated, oversized or noise."""
    good = _frame({"v": PROTOCOL_VERSION, "id": 3, "op": int(Op.EXISTS), "ns": 0, "n": 2, "kt": 0},
                  b"\x01" * 16)
    if kind == 0:
        out = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if kind == 1:
        return good[: rng.randrange(1, len(good))]
    if kind == 2:
        return struct.pack("<II", rng.randrange(1 << 16, 1 << 32), rng.randrange(1 << 32))
    return rng.randbytes(rng.randrange(1, 300))


@pytest.fixture
def victim(emsd_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, list[Any]]]:
    d = emsd_factory(log={"level": "error"}, pool={"grants": True})  # the refusals would fill the log
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="fuzz")))
    cc = Ems.get_cc()
    kv = [[torch.randn(16, 4, 8, 16, generator=torch.Generator().manual_seed(i))] for i in range(2)]
    cc.register_kvcache(kv)
    assert cc.save(list(range(64)), hashes=list(range(100, 116)), offsets=[4] * 16).success == 16
    yield d, cc, kv
    Ems._reset()


def intact(cc: Any, kv: list[Any]) -> bool:
    out = [[torch.zeros_like(t) for t in layer] for layer in kv]
    cc.register_kvcache(out)
    try:
        ok = cc.load(list(range(64)), hashes=list(range(100, 116)), offsets=[4] * 16).success == 16
        return ok and all(torch.equal(a, b) for la, lb in zip(kv, out, strict=True)
                          for a, b in zip(la, lb, strict=True))
    finally:
        cc.register_kvcache(kv)


def test_a_hundred_thousand_hostile_frames(victim: tuple[Any, Any, list[Any]]) -> None:
    d, cc, kv = victim
    rng = random.Random(SEED)
    path = str(d.socket_dir / "emsd.sock")
    ping = _frame({"v": PROTOCOL_VERSION, "id": MARK, "op": int(Op.PING)})
    conn, hangups, baseline = Conn(path), 0, 0
    try:
        for i in range(FRAMES):
            if i == FRAMES // 10:
                baseline = private_rss(d.pid)  # after warm-up: allocator pools and caches filled
            if i % 10_000 == 0:
                assert d.alive() and intact(cc, kv), f"seed {SEED}, frame {i}"
            if rng.random() < 0.96:
                conn.sock.sendall(fuzzed_request(rng, conn) + ping)
                while (head := conn.frame()) is not None and head.get("id") != MARK:
                    pass
                if head is not None:
                    continue
            else:
                try:
                    conn.sock.sendall(broken_bytes(rng, rng.randrange(4)))
                    conn.sock.shutdown(socket.SHUT_WR)
                    while conn.frame() is not None:
                        pass
                except (BrokenPipeError, ConnectionResetError):
                    pass
            conn.close()
            hangups += 1
            conn = Conn(path)
    finally:
        conn.close()
    assert d.alive() and intact(cc, kv), f"seed {SEED}"
    assert hangups > FRAMES // 50  # the broken kinds really were sent and refused
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        stats, _ = client.call(Op.STATS, {}, timeout=5)
    finally:
        client.close()
    assert stats["pending"] == 0 and stats["pinned"] == 0, (SEED, stats)
    Ems._reset()  # the SDK's connection goes too (it holds chunks for its next save): none stay granted
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        deadline = time.monotonic() + 10
        while (granted := client.call(Op.STATS, {}, timeout=5)[0]["granted"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        client.close()
    assert granted == 0, (SEED, granted)
    stored = d.metric("emsd_op_bytes_total", 'op="put"')
    assert stored > 100 * 64, f"only {stored} bytes were stored by PUTs into granted chunks (seed {SEED})"
    grown = private_rss(d.pid) - baseline
    assert grown < 16 << 20, f"daemon RSS grew {grown} bytes over the run (seed {SEED})"


def hostile_auth(rng: random.Random, nonce: bytes) -> bytes:
    """One hostile answer to a peer's CHALLENGE ``nonce`` (see the module docstring)."""
    good = {"v": PROTOCOL_VERSION, "id": 0, "op": PeerOp.AUTH, "node": "mallory",
            "nonce": rng.randbytes(NONCE_BYTES), "mac": rng.randbytes(32)}
    kind = rng.randrange(6)
    if kind == 0:  # well framed, fields fuzzed
        header = dict(good)
        for _ in range(rng.randrange(1, 4)):
            header[rng.choice([*good, "proto", "st"])] = rng.choice([*WEIRD, nonce, rng.randbytes(5000)])
        return _frame(header)
    if kind == 1:  # a plausible AUTH with a wrong mac (an echoed nonce, a long node name)
        return _frame({**good, "nonce": nonce, "node": "n" * rng.randrange(1, 3000)})
    if kind == 2:  # byte-flipped
        raw = bytearray(_frame(good))
        for _ in range(rng.randrange(1, 6)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    if kind == 3:  # cut short
        raw = _frame(good)
        return raw[: rng.randrange(len(raw))]
    if kind == 4:  # an oversized or implausible length prefix, maybe with some of what it announces
        return struct.pack("<II", rng.randrange(1 << 32), rng.randrange(1 << 32)) + rng.randbytes(
            rng.randrange(0, 9000))
    return rng.randbytes(rng.randrange(1, 9000))  # noise


def test_hostile_auth_exchanges_on_the_peer_port(pair: tuple[Any, Any, int],  # noqa: F811
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, port = pair
    rng = random.Random(SEED)
    baseline = 0
    for i in range(PEER_CONNECTIONS):
        if i == PEER_CONNECTIONS // 10:
            baseline = private_rss(b.pid)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            hlen, plen = struct.unpack("<II", _recv_exactly(s, 8))
            challenge = msgpack.unpackb(_recv_exactly(s, hlen + plen)[:hlen])
            assert challenge["op"] == PeerOp.CHALLENGE, challenge
            try:
                s.sendall(hostile_auth(rng, challenge["nonce"]))
                s.shutdown(socket.SHUT_WR)
                while s.recv(1 << 16):  # an answer (a refusal) may come; then the hang-up
                    pass
            except (BrokenPipeError, ConnectionResetError, OSError):  # hung up on before all was sent
                pass
    assert b.alive() and a.alive(), f"seed {SEED}"
    grown = private_rss(b.pid) - baseline
    assert grown < 16 << 20, f"daemon RSS grew {grown} bytes over the run (seed {SEED})"
    refused = b.metric("emsd_peer_connections_refused_total", 'reason="auth"')
    assert refused > PEER_CONNECTIONS // 2, f"{refused} refusals counted (seed {SEED})"
    cluster_still_works(a, b, monkeypatch)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "the daemon hung up before its CHALLENGE"
        data += chunk
    return data


def hostile_http(rng: random.Random) -> bytes:
    """One hostile HTTP request head (see the module docstring)."""
    method = rng.choice([b"GET", b"POST", b"HEAD", b"get", b"", b"\x00GET", rng.randbytes(8)])
    path = rng.choice([b"/healthz", b"/readyz", b"/metrics", b"/metrics?x=" + b"a" * rng.randrange(9000), b"",
                       b"/%00", b"*", b"/" + rng.randbytes(20), b"../../etc/passwd"])
    version = rng.choice([b" HTTP/1.0", b" HTTP/1.1", b" HTTP/9", b"", b" " + rng.randbytes(4)])
    head = method + b" " + path + version + b"\r\n"
    kind = rng.randrange(5)
    if kind == 0:  # many header lines
        head += b"".join(b"X-%d: %d\r\n" % (i, i) for i in range(rng.randrange(200)))
    elif kind == 1:  # one over-long header line
        head += b"X-Long: " + b"a" * rng.randrange(8000, 20000) + b"\r\n"
    elif kind == 2:  # noise
        head = rng.randbytes(rng.randrange(1, 12000))
    elif kind == 3:  # cut short
        return head[: rng.randrange(len(head) + 1)]
    return head + rng.choice([b"\r\n", b"\n", b""])


def test_hostile_requests_on_the_http_endpoint(emsd: Any) -> None:
    rng = random.Random(SEED)
    baseline = 0
    for i in range(HTTP_REQUESTS):
        if i == HTTP_REQUESTS // 10:
            baseline = private_rss(emsd.pid)
        with socket.create_connection((emsd.metrics_host, emsd.metrics_port), timeout=10) as s:
            try:
                s.sendall(hostile_http(rng))
                s.shutdown(socket.SHUT_WR)
                answer = b""
                while chunk := s.recv(1 << 16):
                    answer += chunk
            except (BrokenPipeError, ConnectionResetError, OSError):
                continue
            assert answer == b"" or answer.startswith(b"HTTP/1.0 "), (SEED, i, answer[:80])
    assert emsd.alive(), f"seed {SEED}"
    assert emsd.http("/healthz") == (200, b"ok\n")
    assert emsd.metric("emsd_ready") == 1.0
    grown = private_rss(emsd.pid) - baseline
    assert grown < 16 << 20, f"daemon RSS grew {grown} bytes over the run (seed {SEED})"
