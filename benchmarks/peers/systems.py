"""Start each system's servers and name its client workers; stop everything by process id.

Each ``start_*`` takes an ExitStack (which stops what it started, by pid, in
reverse order) and returns the workers to run against it, or raises
``Missing`` with the reason the system cannot run here; the harness reports
that reason instead of a number.

Every server binds to loopback only. Mooncake's transfer engine listens on all
addresses whatever it is told, so its master, its client daemon and its client
workers all run in one private network namespace holding only ``lo``
(``unshare --net``, entered with ``nsenter``; both need root).

Third-party venvs (scripts/setup-bench-peers.sh) are looked for in
``$BENCH_VENV_DIR`` (default: the repository root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_sdk import start_daemon  # noqa: E402
from bench_sdk import stop as stop_daemon  # noqa: E402
from zk import free_port  # noqa: E402

SHM_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else None  # the emsd pool file lives in the work dir
WORKER = Path(__file__).resolve().parent / "worker.py"
SYSTEMS = ("memmove", "emsd", "emsd-remote", "mooncake", "lmcache", "redis", "memcached")
MC_MASTER_PORT, MC_CLIENT_PORT = 50051, 50052  # inside the private namespace: nothing else there


class Missing(Exception):
    """The system cannot be installed or run here; the message says why."""


@dataclass(frozen=True)
class WorkerSpec:
    """One client process: ``argv`` runs worker.py for ``client`` with ``options``."""

    name: str  # the column in the report, e.g. "mooncake-shm"
    client: str  # clients/<client>_client.py
    argv: tuple[str, ...]  # the interpreter (possibly behind nsenter)
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        import json

        return [*self.argv, str(WORKER), self.client, json.dumps(self.options)]


def venv_dir() -> Path:
    return Path(os.environ.get("BENCH_VENV_DIR", str(ROOT)))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _spawn(stack: contextlib.ExitStack, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stack.callback(_stop, proc)
    return proc


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path,
               netns: int | None = None) -> None:
    """Until 127.0.0.1:port accepts (inside ``netns``'s namespace when given), or fail naming ``what``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Missing(f"{what} exited with {proc.returncode}: {_tail(log)}")
        if netns is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        elif subprocess.run(["nsenter", f"--net=/proc/{netns}/ns/net", "bash", "-c",
                             f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise Missing(f"{what} did not listen on port {port} within 60 s: {_tail(log)}")


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(lines[-3:])


def start_memmove(stack: contextlib.ExitStack, work: Path, volume: int) -> list[WorkerSpec]:
    return [WorkerSpec("memmove", "memmove", (sys.executable,), {"volume": volume})]


def emsd_pool_bytes(volume: int) -> int:
    """The standalone emsd's pool: room for eight cells, at least 1 GiB."""
    return max(1 << 30, 8 * volume)


def mooncake_segment_bytes(volume: int) -> int:
    """mooncake_client's global segment: room for sixteen cells, at least 2 GiB."""
    return max(2 << 30, 16 * volume)


def hugepage_bytes(names: list[str], volume: int) -> int:
    """Hugepage memory the systems ``names`` map when hugepages are there (``--hugepages``):
    each emsd pool (``hugepages = "auto"``) and, with ``MC_STORE_USE_HUGEPAGE``,
    Mooncake's segment and its shared-memory client's pool (two volumes and 128 MiB)
    as measured here."""
    from bench_cluster import POOL

    need = {"emsd": emsd_pool_bytes(volume), "emsd-remote": 2 * POOL,
            "mooncake": mooncake_segment_bytes(volume) + 2 * volume + (128 << 20)}
    return sum(need.get(name, 0) for name in names)


def start_emsd(stack: contextlib.ExitStack, work: Path, volume: int) -> list[WorkerSpec]:
    d = work / "emsd"
    d.mkdir()
    pool_mib = emsd_pool_bytes(volume) >> 20
    proc, sock_dir = start_daemon(d, f"{pool_mib}MiB", "64MiB")  # bench_sdk's: a real standalone daemon
    stack.callback(stop_daemon, proc)
    return [WorkerSpec("emsd", "emsd", (sys.executable,), {"volume": volume, "sock_dir": str(sock_dir)},
                       {"PYTHONPATH": str(ROOT)})]


def start_emsd_remote(stack: contextlib.ExitStack, work: Path, volume: int) -> list[WorkerSpec]:
    """A ZooKeeper and two clustered daemons (bench_cluster's helpers); the worker is a client of A."""
    import zk
    from bench_cluster import POOL
    from bench_cluster import start_daemon as start_member

    why = zk.available()
    if why:
        raise Missing(f"no ZooKeeper for the cluster: {why}")
    d = work / "emsd-remote"
    server = zk.ZooKeeperServer(d / "zk").start()
    stack.callback(server.stop)
    secret = d / "secret"
    secret.write_text("benchmark-peers-secret\n")
    secret.chmod(0o600)  # emsd refuses a secret others can read
    socks = {}
    for name in ("a", "b"):
        proc, socks[name] = start_member(d, name, server.hosts, secret)
        stack.callback(stop_daemon, proc)
    time.sleep(1.0)  # both views settle (as bench_cluster does: membership is event-driven)
    options = {"volume": volume, "sock_dir": str(socks["a"]), "pool": POOL}
    return [WorkerSpec("emsd-remote", "emsd_remote", (sys.executable,), options, {"PYTHONPATH": str(ROOT)})]


def start_redis(stack: contextlib.ExitStack, work: Path, volume: int) -> list[WorkerSpec]:
    if shutil.which("redis-server") is None:
        raise Missing("redis-server not installed (scripts/setup-bench-peers.sh)")
    _need_module("redis", "hiredis")
    port = free_port()
    log = work / "redis.log"
    proc = _spawn(stack, ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--protected-mode", "yes"], log)
    _wait_port(port, proc, "redis-server", log)
    return [WorkerSpec("redis", "redis", (sys.executable,), {"volume": volume, "port": port})]


def start_memcached(stack: contextlib.ExitStack, work: Path, volume: int) -> list[WorkerSpec]:
    if shutil.which("memcached") is None:
        raise Missing("memcached not installed (scripts/setup-bench-peers.sh)")
    _need_module("pymemcache")
    port = free_port()
    log = work / "memcached.log"
    # -I: the default 1 MiB item size limit refuses the 2 and 8 MiB values
    argv = ["memcached", "-l", "127.0.0.1", "-p", str(port), "-U", "0",
            "-m", str(max(1024, 4 * volume >> 20)), "-I", "16m", "-t", "2"]
    if os.geteuid() == 0:
        argv += ["-u", "root"]
    proc = _spawn(stack, argv, log)
    _wait_port(port, proc, "memcached", log)
    return [WorkerSpec("memcached", "memcached", (sys.executable,), {"volume": volume, "port": port})]


def start_lmcache(stack: contextlib.ExitStack, work: Path, volume: int) -> list[WorkerSpec]:
    venv = venv_dir() / ".venv-bench-lmcache"
    server = venv / "bin" / "lmcache_server"
    if not server.exists():
        raise Missing(f"no {server} (scripts/setup-bench-peers.sh)")
    port = free_port()
    log = work / "lmcache.log"
    proc = _spawn(stack, [str(server), "127.0.0.1", str(port), "cpu"], log)
    _wait_port(port, proc, "lmcache_server", log)
    python = str(venv / "bin" / "python")
    return [WorkerSpec("lmcache", "lmcache", (python,), {"volume": volume, "port": port})]


def start_mooncake(stack: contextlib.ExitStack, work: Path, volume: int) -> list[WorkerSpec]:
    venv = venv_dir() / ".venv-bench-mooncake"
    if not (venv / "bin" / "mooncake_master").exists():
        raise Missing(f"no {venv}/bin/mooncake_master (scripts/setup-bench-peers.sh)")
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        raise Missing("needs root, unshare and nsenter for its private network namespace")
    log = work / "mooncake.log"
    holder = _spawn(stack, ["unshare", "--net", "sh", "-c", "ip link set lo up && exec sleep 86400"], log)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{holder.pid}/comm").read_text().strip() != "sleep":  # lo is up once sh exec'd
        if holder.poll() is not None or time.monotonic() > deadline:
            raise Missing(f"unshare --net failed: {_tail(log)}")
        time.sleep(0.02)
    ns = ["nsenter", f"--net=/proc/{holder.pid}/ns/net"]
    # A get leases its object for --default_kv_lease_ttl (10 s by default) and a leased object
    # cannot be removed; 2 s is still far longer than any get here and lets each cell's
    # values be removed soon after, instead of filling the segment and forcing evictions.
    master = _spawn(stack, [*ns, str(venv / "bin" / "mooncake_master"), "--enable_http_metadata_server=false",
                            f"--rpc_port={MC_MASTER_PORT}", "--default_kv_lease_ttl=2s"], log)
    _wait_port(MC_MASTER_PORT, master, "mooncake_master", log, holder.pid)
    segment = mooncake_segment_bytes(volume)
    daemon = _spawn(stack, [*ns, str(venv / "bin" / "mooncake_client"), "--metadata_server=P2PHANDSHAKE",
                            "--protocol=tcp", "--host=127.0.0.1", f"--port={MC_CLIENT_PORT}",
                            f"--master_server_address=127.0.0.1:{MC_MASTER_PORT}",
                            f"--global_segment_size={segment >> 20}MB"], log)
    _wait_port(MC_CLIENT_PORT, daemon, "mooncake_client", log, holder.pid)
    argv = (*ns, str(venv / "bin" / "python"))
    common = {"volume": volume, "master": f"127.0.0.1:{MC_MASTER_PORT}",
              "client": f"127.0.0.1:{MC_CLIENT_PORT}"}
    return [WorkerSpec("mooncake-shm", "mooncake", argv, {**common, "mode": "shm"}),
            WorkerSpec("mooncake-tcp", "mooncake", argv, {**common, "mode": "tcp"})]


def _need_module(*names: str) -> None:
    import importlib.util

    for name in names:
        if importlib.util.find_spec(name) is None:
            raise Missing(f"python module {name} not installed in {sys.executable} "
                          "(scripts/setup-bench-peers.sh)")


STARTERS = {"memmove": start_memmove, "emsd": start_emsd, "emsd-remote": start_emsd_remote,
            "mooncake": start_mooncake,
            "lmcache": start_lmcache, "redis": start_redis, "memcached": start_memcached}
