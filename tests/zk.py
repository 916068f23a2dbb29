"""A real ZooKeeper server for tests: Debian's zookeeper package, own config, loopback.

``ZooKeeperServer(workdir).start()`` writes a zoo.cfg (a free loopback port,
tickTime 200 ms so sessions of 1-4 s work, no admin server), runs
``QuorumPeerMain`` with Java, and returns once the server answers ``ruok``.
``stop()`` ends it by pid (SIGTERM, then SIGKILL); ``start()`` again
restarts it on the same port with the same data. ``available()`` says
whether Java and the jar are installed, so tests can skip with a reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ZooKeeperServer:
    def __init__(self, workdir: Path, host: str = "127.0.0.1") -> None:
        self.workdir = workdir
        self.host = host
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def hosts(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ZooKeeperServer:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "zoo.cfg"
        cfg.write_text(
            f"tickTime=200\ndataDir={data}\nclientPort={self.port}\nclientPortAddress={self.host}\n"
            "admin.enableServer=false\nminSessionTimeout=400\nmaxSessionTimeout=60000\n"
            "4lw.commands.whitelist=ruok,srvr\n"
        )
        log = open(self.workdir / "zookeeper.log", "ab")  # noqa: SIM115 - the child keeps it
        classpath = f"{CONF_DIR}:{JAR}" if CONF_DIR.exists() else str(JAR)
        self.proc = subprocess.Popen(
            ["java", "-Xmx256m", "-cp", classpath, f"-Dzookeeper.log.dir={self.workdir}", MAIN, str(cfg)],
            stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zookeeper exited with {self.proc.returncode}")
            if self.ruok():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError("zookeeper did not answer ruok")

    def ruok(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"ruok")
                return s.recv(8) == b"imok"
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
