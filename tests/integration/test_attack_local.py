"""Attacks by another local user on a node's files and sockets (issue 25): each refused at start or closed."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from emsd.transport.frames import PROTOCOL_VERSION, Op, Status
from emsd.transport.unix import UnixControlServer


def test_a_cluster_secret_readable_by_others_is_refused_at_start(emsd_factory: Any, tmp_path: Path) -> None:
    """A 0644 secret is a secret every local user holds: the daemon names the file and exits 2."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    secret.chmod(0o644)
    d = emsd_factory(start=False, cluster={"zookeeper": "127.0.0.1:1", "secret_file": str(secret)})
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) == 2
    refusals = [line for line in d.log().splitlines() if "cluster.secret_file" in line]
    assert len(refusals) == 1 and "chmod 600" in refusals[0] and "0644" in refusals[0], d.log()


def test_the_control_socket_is_never_wider_than_its_mode(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Between bind() and chmod() the socket file must not carry the umask's wider permissions."""
    seen: list[int] = []
    chmod = os.chmod

    def spy(path: Any, mode: int, *args: Any, **kwargs: Any) -> None:
        seen.append(stat.S_IMODE(os.stat(path).st_mode))  # what another user could connect through until now
        chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", spy)
    old = os.umask(0)  # the widest umask a daemon can be started under
    try:
        server = UnixControlServer(tmp_path / "emsd.sock", 0o660, lambda: None, lambda: None, lambda n: None)
        server.bind()
    finally:
        os.umask(old)
    try:
        assert seen and all(mode & 0o007 == 0 for mode in seen), [f"{m:04o}" for m in seen]
        assert stat.S_IMODE(os.stat(tmp_path / "emsd.sock").st_mode) == 0o660
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(tmp_path / "emsd.sock"))
        probe.close()
    finally:
        asyncio.run(server.close())


def hello(d: Any) -> tuple[socket.socket, dict[str, Any], list[int]]:
    """A raw control connection that has sent HELLO: the socket, the answer's header and the
    descriptors that came with it (the caller closes them)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(d.socket_dir / "emsd.sock"))
    head = msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": int(Op.HELLO)})
    sock.sendall(struct.pack("<II", len(head), 0) + head)
    data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
    return sock, msgpack.unpackb(data[8:]), list(fds)


def test_a_peer_outside_the_allowed_uids_never_receives_the_pool_descriptor(emsd_factory: Any) -> None:
    """The SO_PEERCRED check runs before HELLO is answered: the refusal carries no descriptor."""
    d = emsd_factory(node={"allowed_uids": [os.getuid() + 4242], "allowed_gids": [os.getgid() + 4242]})
    sock, answer, fds = hello(d)
    sock.close()
    for fd in fds:
        os.close(fd)
    assert fds == []
    assert answer["st"] == int(Status.INVALID_ARGUMENT)
    assert d.alive()


def test_a_client_that_never_reads_its_answers_is_cut_off_with_memory_bounded(emsd_factory: Any) -> None:
    """Flooding STATS without reading: the daemon stops reading, then hangs up; its RSS stays bounded."""
    from tests.memory import private_rss

    d = emsd_factory()
    before = private_rss(d.proc.pid)
    sock, _, fds = hello(d)
    sock.settimeout(None)
    for fd in fds:
        os.close(fd)
    stats = msgpack.packb({"v": PROTOCOL_VERSION, "id": 2, "op": int(Op.STATS)})
    frame = (struct.pack("<II", len(stats), 0) + stats) * 256
    sock.setblocking(False)
    sent = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "read no answers" not in d.log():
        try:
            sent += sock.send(frame)
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:
            break
    grown = private_rss(d.proc.pid) - before
    print(f"sent {sent >> 20} MiB of STATS; daemon's private RSS grew by {grown >> 20} MiB")
    sock.close()
    assert sent > 0
    assert "read no answers" in d.log()
    assert grown < 256 << 20, f"daemon grew by {grown >> 20} MiB"
    assert d.alive() and d.http("/healthz") == (200, b"ok\n")


def refused_at_start(d: Any, *words: str) -> str:
    """Start ``d``, expect exit 2, and return its one start-up error line (which has ``words``)."""
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) == 2, d.log()
    lines = [line for line in d.log().splitlines() if all(w in line for w in words)]
    assert len(lines) == 1, d.log()
    return lines[0]


@pytest.mark.parametrize("planted", ["pool", "lock", "ledger"])
def test_symlinks_planted_for_the_state_files_are_refused_and_their_targets_untouched(
        emsd_factory: Any, tmp_path: Path, planted: str) -> None:
    """Main truncated and zeroed both targets (which kept mode 0644): now neither is opened."""
    victim = tmp_path / f"victim-{planted}"
    victim.write_bytes(b"someone else's bytes\n" * 100)
    victim.chmod(0o644)
    d = emsd_factory(start=False)
    state = Path(d.sections["pool"]["state_dir"])
    state.mkdir(mode=0o700)
    (state / f"emsd-{d.sections['node']['id']}.{planted}").symlink_to(victim)
    line = refused_at_start(d, "pool.state_dir", "symbolic link")
    assert f"emsd-{d.sections['node']['id']}.{planted}" in line
    assert victim.read_bytes() == b"someone else's bytes\n" * 100
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


@pytest.mark.parametrize("which", ["pool.state_dir", "node.socket_dir"])
def test_a_directory_others_can_write_or_another_user_owns_is_refused(emsd_factory: Any, which: str) -> None:
    """Anyone who can write to the state or socket directory can plant files the daemon would use."""
    section, key = which.split(".")
    d = emsd_factory(start=False)
    directory = Path(d.sections[section][key])
    directory.mkdir(mode=0o700)
    directory.chmod(0o777)
    assert "writable by others" in refused_at_start(d, which, str(directory))
    directory.chmod(0o700)
    os.chown(directory, 65534, 65534)  # nobody's
    d2 = emsd_factory(start=False, **{section: {key: str(directory)}})
    assert "belongs to uid 65534" in refused_at_start(d2, which, str(directory))
    os.chown(directory, os.geteuid(), os.getegid())
    d3 = emsd_factory(start=False, **{section: {key: str(directory)}})
    d3.start()
    assert d3.alive() and d3.http("/readyz")[0] == 200


def pool_descriptor(d: Any) -> tuple[socket.socket, int]:
    """A control connection past HELLO and the pool descriptor it was handed, as any client gets."""
    sock, answer, fds = hello(d)
    assert answer["st"] == 0 and len(fds) == 1
    return sock, fds[0]


F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h; not in Python's fcntl module: it would stop new writable maps


@pytest.mark.usefixtures("reset_sdk")
def test_a_client_cannot_truncate_grow_or_seal_the_pool_it_was_handed(
        emsd_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Main: ftruncate(fd, 0) on the handed descriptor gave every mapper SIGBUS, killed the daemon
    on its next PIN and lost every block. Now the memfd is sealed: the calls fail with EPERM,
    the daemon serves on, and the blocks load equal, also after a kill -9 and a restart."""
    import fcntl

    import torch

    from ems import CcConfig, Ems, EmsConfig

    d = emsd_factory()
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    kv = [[torch.randn(16, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]]
    cc.register_kvcache(kv)
    slots, hashes = list(range(64)), list(range(500, 516))
    assert cc.save(slots, hashes=hashes, offsets=[4] * 16).success == 16

    sock, fd = pool_descriptor(d)
    try:
        size = os.fstat(fd).st_size
        for attack in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, size // 2),
                       lambda: os.ftruncate(fd, size * 2),
                       lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)):
            with pytest.raises(PermissionError):
                attack()
        assert os.fstat(fd).st_size == size
    finally:
        os.close(fd)
        sock.close()

    def loads_equal() -> bool:
        out = [[torch.zeros(16, 4, 8) for _ in range(2)]]
        cc.register_kvcache(out)
        ok = cc.load(slots, hashes=hashes, offsets=[4] * 16).success == 16
        return ok and all(torch.equal(a, b) for a, b in zip(out[0], kv[0], strict=True))

    assert d.alive() and loads_equal()
    d.kill9()
    d.start()
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    assert loads_equal()
