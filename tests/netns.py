"""Test hosts in network namespaces: each with its own address on one private bridge.

``Hosts(n).create()`` makes a bridge in the test's own namespace with
address ``10.<net>.0.1/24`` and ``n`` namespaces, each joined to the bridge
by a veth pair and given ``10.<net>.0.<i+2>/24`` and its own loopback.
The test process reaches every host's address through the bridge; Unix
sockets (paths in the file system) work across namespaces as usual.
``cut(i)``/``heal(i)`` take host ``i``'s link down and up again;
``destroy()`` removes everything. ``available()`` says whether this
machine can do it (root and a working ``ip netns``), for a clear skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def available() -> str | None:
    """None when namespaces can be made here, else the reason why not."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"emsprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns does not work here: {exc}"
    return None


class Hosts:
    def __init__(self, n: int) -> None:
        tag = os.getpid() % 10_000
        # Second octet: 10.100-243.x.x, private; each pytest-xdist worker (gw0..gw8) has
        # its own range of 16, so tests in two workers never share a subnet.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        slot = int(worker[2:]) % 9 if worker[2:].isdigit() else 0
        self.net = 100 + 16 * slot + os.getpid() % 16
        self.bridge = f"emsbr{tag}"
        self.names = [f"ems{tag}h{i}" for i in range(n)]
        self.gateway = f"10.{self.net}.0.1"
        self.addresses = [f"10.{self.net}.0.{i + 2}" for i in range(n)]

    def create(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                outer, inner = self._veth(i)
                _ip("netns", "add", name)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", name)
                self.run(i, "ip", "addr", "add", f"{self.addresses[i]}/24", "dev", inner)
                self.run(i, "ip", "link", "set", inner, "up")
                self.run(i, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def _veth(self, i: int) -> tuple[str, str]:
        return f"{self.bridge}v{i}", f"{self.bridge}p{i}"

    def prefix(self, i: int) -> list[str]:
        """A command prefix that runs a program on host ``i`` (``ip netns exec`` keeps its pid)."""
        return ["ip", "netns", "exec", self.names[i]]

    def run(self, i: int, *cmd: str) -> None:
        subprocess.run([*self.prefix(i), *cmd], check=True, capture_output=True, timeout=10)

    def cut(self, i: int) -> None:
        _ip("link", "set", self._veth(i)[0], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self._veth(i)[0], "up")

    def destroy(self) -> None:
        for i, name in enumerate(self.names):
            subprocess.run(["ip", "link", "del", self._veth(i)[0]], capture_output=True, timeout=10)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)
