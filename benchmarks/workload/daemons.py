"""Real emsd processes for the workload replay: one standalone node, or a 3-node cluster.

Daemons are started as ``python -m emsd --config FILE`` (as tests/conftest.py
does), with their pool files in tmpfs, and are waited for on ``/readyz``
(never a fixed sleep). A cluster also gets a real ZooKeeper (Debian's
package, ``tests/zk.py``). Everything is stopped by process id. Each node
gets one SDK ``ContextCaching`` object of its own, so one process can drive
several nodes (``Ems`` itself is one per process).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import daemon_ready

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import zk  # noqa: E402


@dataclass
class Node:
    name: str
    sock: Path
    metrics_port: int
    proc: subprocess.Popen[bytes]

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics (0.0 when absent)."""
        want = f"{name}{{{labels}}}" if labels else name
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(want + " "):
                    return float(line.split()[-1])
        return 0.0


@dataclass
class Deployment:
    """Running daemons (and ZooKeeper); ``stop()`` ends them all by pid."""

    nodes: list[Node]
    zookeeper: zk.ZooKeeperServer | None = None
    clients: list[Any] = field(default_factory=list)  # closed by stop(), last added first

    def wait_prefaulted(self, timeout: float = 300.0) -> None:
        """Until every node's pool is faulted in (``daemon_ready.wait``: at once with
        ``prefault`` off), as a deployed daemon's is long before engines use it.
        ``RuntimeError`` after ``timeout`` s in all, or if a daemon has exited."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            daemon_ready.wait(node.metrics_port, node.proc, f"emsd {node.name}",
                              max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        for c in reversed(self.clients):
            c.close()
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.terminate()
        for n in self.nodes:
            try:
                n.proc.wait(20)
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait()
        if self.zookeeper is not None:
            self.zookeeper.stop()


def _start(work: Path, name: str, pool: int, eviction: str, cluster: dict[str, str] | None,
           page: int = 64 << 10, grants: bool = False, prefault: bool = False,
           disk: dict[str, str] | None = None) -> Node:
    d = work / name
    d.mkdir(parents=True)
    port = zk.free_port()
    lines = [
        f'[node]\nid = "{name}"\nsocket_dir = "{d / "sock"}"',
        f'[pool]\nsize = {pool}\nhugepages = "off"\npage_size = {page}\nprefault = {str(prefault).lower()}\n'
        f'warm_restart = false\neviction = "{eviction}"\ngrants = {str(grants).lower()}',
        f'[metrics]\nlisten = "127.0.0.1:{port}"',
        '[log]\nlevel = "warning"',
    ]
    if disk is not None:
        lines.append("[disk]\n" + "\n".join(f'{k} = "{v}"' for k, v in disk.items()))
    if cluster is not None:
        lines.append("[cluster]\n" + "\n".join(f'{k} = "{v}"' for k, v in cluster.items())
                     + f'\npeer_listen = "127.0.0.1:{zk.free_port()}"\nsession_timeout = 4')
    cfg = d / "emsd.toml"
    cfg.write_text("\n".join(lines) + "\n")
    log = open(d / "emsd.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, "-m", "emsd", "--config", str(cfg)], cwd=ROOT,
                            stdout=log, stderr=log)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"emsd {name} exited {proc.returncode}: {(d / 'emsd.log').read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return Node(name, d / "sock", port, proc)
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"emsd {name} not ready after 60 s")


def start(work: Path, nodes: int, pool_per_node: int, eviction: str,
          zookeeper: zk.ZooKeeperServer | None = None, name: str = "workload",
          page: int = 64 << 10, grants: bool = False, prefault: bool = False,
          disk: dict[str, str] | None = None) -> Deployment:
    """``nodes`` daemons of ``pool_per_node`` bytes each (slab pages of ``page`` bytes):
    1 standalone, more a cluster named ``name`` on ``zookeeper`` (started here, and
    stopped with it, if None).

    ``grants`` (``pool.grants``) is off unless asked for, so that a daemon's hit rates
    equal ``sim.in_store``'s exactly: with it on, the chunks a connection holds for its
    next save (at most 1/64 of a pool, here a few MiB) cost 0.01-0.09 points of hit rate
    at 25-100% of the live working set (seed 1, measured 2026-11-24). ``prefault``
    (``pool.prefault``, the daemon's default) is off unless asked for: the replay's pools
    are small and start faster without it. ``disk``: a ``[disk]`` table (standalone only)."""
    if nodes == 1:
        return Deployment([_start(work / name, "solo", pool_per_node, eviction, None, page, grants,
                                  prefault, disk)])
    own = zookeeper is None
    if zookeeper is None:
        zookeeper = start_zookeeper(work / "zk")
    dep = Deployment([], zookeeper if own else None)
    secret = work / "secret"
    secret.write_text("workload-benchmark-cluster-secret\n")
    secret.chmod(0o600)  # emsd refuses a secret others can read
    try:
        for i in range(nodes):
            dep.nodes.append(_start(work / name, f"n{i}", pool_per_node, eviction,
                                    {"name": name, "zookeeper": zookeeper.hosts,
                                     "secret_file": str(secret)}, page, grants, prefault))
        _wait_members(dep, nodes)
    except BaseException:
        dep.stop()
        raise
    return dep


def start_zookeeper(workdir: Path) -> zk.ZooKeeperServer:
    """A real ZooKeeper on loopback; raises ``RuntimeError`` if it cannot run here."""
    why = zk.available()
    if why is not None:
        raise RuntimeError(f"cannot start a cluster: {why}")
    return zk.ZooKeeperServer(workdir).start()


def _wait_members(dep: Deployment, n: int) -> None:
    """Until every node sees all ``n`` members (the ring is complete)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(node.metric("emsd_cluster_members") >= n for node in dep.nodes):
            return
        time.sleep(0.1)
    raise RuntimeError("the cluster did not form within 60 s")


def connect(dep: Deployment, model_id: str) -> list[Any]:
    """One SDK ``ContextCaching`` per node, each on its own connection."""
    from ems import CcConfig, EmsConfig
    from ems.client import DaemonClient
    from ems.context_caching import ContextCaching
    from ems.profiling import Profiler

    config = EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id=model_id))
    out = []
    for node in dep.nodes:
        client = DaemonClient(node.sock / "emsd.sock")
        client.connect({"access_id": "", "access_key": ""})
        cc = ContextCaching(lambda c=client: c, config.validate(), None, Profiler(False))
        out.append(cc)
        dep.clients += [client, cc]  # the SDK first: it holds connections of its own (ems.direct)
    return out
