"""A real ZooKeeper server for tests: Debian's zookeeper package, own config, loopback.

``ZooKeeperServer(workdir).start()`` writes a zoo.cfg (a free loopback port,
tickTime 200 ms so sessions of 1-4 s work, no admin server), runs
``QuorumPeerMain`` with Java, and returns once it serves sessions (``srvr`` reports ``Mode: standalone``).
``stop()`` ends it by pid (SIGTERM, then SIGKILL); ``start()`` again
restarts it on the same port with the same data. ``available()`` says
whether Java and the jar are installed, so tests can skip with a reason.

``ZooKeeperEnsemble(workdir, 3).start()`` runs a real quorum as production
does: three servers on loopback, each with its own client, peer and
election ports, ``server.N`` lines and a ``myid`` file; it returns once
every server reports ``Mode: leader`` or ``follower`` (``srvr``).
``leader()`` names the server that leads now, ``kill9()`` on a server kills
it without warning. Three JVMs: only for the tests that need a quorum.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ports import free_port

JAR = Path("/usr/share/java/zookeeper.jar")
CONF_DIR = Path("/etc/zookeeper/conf")
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"


def available() -> str | None:
    """None when a server can be started here, else the reason why not."""
    if shutil.which("java") is None:
        return "java is not installed"
    if not JAR.exists():
        return f"{JAR} missing: apt-get install zookeeper"
    return None


class ZooKeeperServer:
    def __init__(self, workdir: Path, host: str = "127.0.0.1", myid: int = 0) -> None:
        """``myid``: this server's number in an ensemble (``ZooKeeperEnsemble``), 0 alone."""
        self.workdir = workdir
        self.host = host
        self.port = free_port()
        self.myid = myid
        self.quorum = ""  # the ensemble's server.N lines (set by ZooKeeperEnsemble)
        self.peer_ports = (free_port(), free_port()) if myid else (0, 0)  # quorum, election
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def hosts(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ZooKeeperServer:
        """Launch a standalone server; return once it serves sessions (``ruok`` would answer
        as soon as the port is open, before the server takes sessions: ``srvr`` says when)."""
        self.launch()
        self.wait(lambda: self.mode() == "standalone", timeout)
        return self

    def launch(self) -> None:
        """Start the JVM; do not wait for it to serve."""
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        if self.myid:
            (data / "myid").write_text(f"{self.myid}\n")
        cfg = self.workdir / "zoo.cfg"
        cfg.write_text(
            f"tickTime=200\ndataDir={data}\nclientPort={self.port}\nclientPortAddress={self.host}\n"
            "admin.enableServer=false\nminSessionTimeout=400\nmaxSessionTimeout=60000\n"
            "4lw.commands.whitelist=srvr\n"
            # an ensemble: 10 s to sync a follower, 5 s of silence before it is dropped
            + (f"initLimit=50\nsyncLimit=25\n{self.quorum}" if self.quorum else "")
        )
        log = open(self.workdir / "zookeeper.log", "ab")  # noqa: SIM115 - the child keeps it
        classpath = f"{CONF_DIR}:{JAR}" if CONF_DIR.exists() else str(JAR)
        self.proc = subprocess.Popen(
            ["java", "-Xmx256m", "-cp", classpath, f"-Dzookeeper.log.dir={self.workdir}", MAIN, str(cfg)],
            stdout=log, stderr=log, start_new_session=True,
        )
        log.close()

    def wait(self, ready: Callable[[], bool], timeout: float) -> None:
        """Return once ``ready()``; raise (and stop the server) if it exits or ``timeout`` passes."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zookeeper exited with {self.proc.returncode}")
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"zookeeper {self.hosts} not ready in {timeout:g} s")

    def mode(self) -> str:
        """What ``srvr`` reports: "leader", "follower", "standalone"; "" when it does not answer
        or serves no requests (an ensemble without quorum)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"srvr")
                text = b""
                while chunk := s.recv(4096):
                    text += chunk
        except OSError:
            return ""
        for line in text.decode(errors="replace").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill9(self) -> None:
        """Kill the server at once (SIGKILL, no goodbye to its clients or peers)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class ZooKeeperEnsemble:
    """``n`` servers forming one quorum on loopback (see the module docstring)."""

    def __init__(self, workdir: Path, n: int = 3) -> None:
        self.servers = [ZooKeeperServer(workdir / f"zk{i}", myid=i) for i in range(1, n + 1)]
        quorum = "".join(f"server.{z.myid}={z.host}:{z.peer_ports[0]}:{z.peer_ports[1]}\n"
                         for z in self.servers)
        for z in self.servers:
            z.quorum = quorum

    @property
    def hosts(self) -> str:
        """The connect string naming every server, as a production client is configured."""
        return ",".join(z.hosts for z in self.servers)

    def start(self, timeout: float = 60.0) -> ZooKeeperEnsemble:
        """Start every server; return once each is a leader or a follower."""
        for z in self.servers:
            z.launch()
        try:
            for z in self.servers:
                z.wait(lambda z=z: z.mode() in ("leader", "follower"), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def leader(self) -> ZooKeeperServer | None:
        """The server that leads now, if one does."""
        return next((z for z in self.servers if z.mode() == "leader"), None)

    def stop(self) -> None:
        for z in self.servers:
            z.stop()
