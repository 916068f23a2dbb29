"""The shared-memory region: which memory backs it, and why."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from emsd.pool import keeper
from emsd.pool import region as region_mod
from emsd.pool.region import HugepageInfo, Region, RegionBusy, RegionError, _choose, read_hugepage_info

# The tests that raise the machine's hugepage count or need none free are marked serial: they
# run alone (scripts/test.sh), as do the other tests of the hugepage count.
MIB = 1 << 20
NO_HUGEPAGES = HugepageInfo(page_size=2 * MIB, total=0, free=0)


@pytest.fixture
def shm() -> Iterator[Region]:
    r = Region.create(3 * MIB + 5, "off", name="emsd-test")
    yield r
    r.close()


def test_off_maps_shared_memory_rounded_to_pages(shm: Region) -> None:
    assert shm.kind == "shm"
    assert shm.size == 3 * MIB + mmap.PAGESIZE
    assert "hugepages=off" in shm.reason
    assert os.fstat(shm.fd).st_size == shm.size


def test_the_fd_maps_the_same_bytes(shm: Region) -> None:
    shm.mm[100:105] = b"hello"
    other = mmap.mmap(shm.fd, shm.size, flags=mmap.MAP_SHARED)
    try:
        assert other[100:105] == b"hello"
    finally:
        other.close()


def test_address_is_stable_and_does_not_block_close(shm: Region) -> None:
    assert shm.address() == shm.address() != 0
    shm.close()
    shm.close()  # idempotent
    assert shm.mm.closed and shm.fd == -1


def test_prefault_uses_madvise_and_keeps_the_data(shm: Region) -> None:
    shm.mm[0:4] = b"keep"
    assert shm.prefault() == "MADV_POPULATE_WRITE"
    assert shm.mm[0:4] == b"keep"


def test_prefault_falls_back_to_touching_pages(shm: Region,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(region_mod, "MADV_POPULATE_WRITE", 0x7FFF)  # EINVAL
    shm.mm[mmap.PAGESIZE : mmap.PAGESIZE + 4] = b"keep"
    assert shm.prefault() == "touch"
    assert shm.mm[mmap.PAGESIZE : mmap.PAGESIZE + 4] == b"keep"
    shm.close()


def test_unknown_mode_and_bad_size_are_refused() -> None:
    with pytest.raises(RegionError, match="pool.hugepages"):
        Region.create(MIB, "maybe")
    with pytest.raises(RegionError, match="pool.size"):
        Region.create(0, "off")


def test_auto_without_free_hugepages_says_why_it_uses_shm() -> None:
    size, reason = _choose(4 * MIB, "auto", NO_HUGEPAGES)
    assert size is None
    assert reason == ("hugepages=auto: 0 of 2 free hugepages of 2 MiB needed; "
                      "using shared memory")


def test_auto_with_enough_hugepages_picks_them() -> None:
    size, reason = _choose(3 * MIB, "auto", HugepageInfo(2 * MIB, total=8, free=8))
    assert size == 4 * MIB
    assert reason.startswith("hugepages=auto: 2 hugepages of 2 MiB")


def test_hugepages_promised_to_other_mappings_are_not_free() -> None:
    """Free pages another mapping reserved (not yet touched) cannot back this pool."""
    size, reason = _choose(3 * MIB, "auto", HugepageInfo(2 * MIB, total=8, free=8, reserved=7))
    assert size is None and reason.startswith("hugepages=auto: 1 of 2 free hugepages")
    with pytest.raises(RegionError, match=r"1 of 2 free hugepages .* `echo 9 > "):
        _choose(3 * MIB, "on", HugepageInfo(2 * MIB, total=8, free=8, reserved=7))
    assert _choose(3 * MIB, "auto", HugepageInfo(2 * MIB, total=8, free=8, reserved=6))[0] == 4 * MIB


def test_on_without_enough_hugepages_says_how_to_reserve_them() -> None:
    with pytest.raises(RegionError) as exc:
        _choose(8 * MIB, "on", HugepageInfo(2 * MIB, total=3, free=1))
    msg = str(exc.value)
    assert msg.startswith("pool.hugepages=on: 1 of 4 free hugepages of 2 MiB needed")
    assert "echo 6 > /proc/sys/vm/nr_hugepages" in msg
    assert "\n" not in msg


def test_no_hugetlb_in_the_kernel() -> None:
    assert _choose(MIB, "auto", None)[0] is None
    with pytest.raises(RegionError, match="no hugetlb support"):
        _choose(MIB, "on", None)


def test_meminfo_parsing(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nHugePages_Total:      64\nHugePages_Free:       60\n"
                       "HugePages_Rsvd:       12\nHugepagesize:       2048 kB\n")
    assert read_hugepage_info(meminfo) == HugepageInfo(2 * MIB, 64, 60, 12)
    assert HugepageInfo(2 * MIB, 64, 60, 12).available == 48
    meminfo.write_text("MemTotal: 100 kB\n")
    assert read_hugepage_info(meminfo) is None
    assert read_hugepage_info(tmp_path / "missing") is None


@pytest.mark.serial
def test_on_fails_clearly_on_this_host_without_hugepages() -> None:
    info = read_hugepage_info()
    if info is not None and info.available * info.page_size >= 16 * MIB:
        pytest.skip("this host has free hugepages")
    with pytest.raises(RegionError, match=r"^pool\.hugepages=on: "):
        Region.create(16 * MIB, "on")


@pytest.fixture
def hugepages() -> Iterator[int]:
    """Reserve 16 hugepages for the test (root only), then restore the count."""
    info = read_hugepage_info()
    path = Path(region_mod.NR_HUGEPAGES)
    if info is None or os.geteuid() != 0 or not os.access(path, os.W_OK):
        pytest.skip("needs root and hugetlb to reserve hugepages")
    before = int(path.read_text())
    try:
        path.write_text(str(before + 16))
    except OSError:
        pytest.skip("cannot reserve hugepages here")
    try:
        got = read_hugepage_info()
        if got is None or got.available < 16:
            pytest.skip("the kernel did not grant the hugepages")
        yield got.page_size
    finally:
        path.write_text(str(before))


@pytest.mark.serial
def test_hugetlb_region_when_hugepages_are_reserved(hugepages: int) -> None:
    r = Region.create(3 * hugepages - 1, "on", name="emsd-test-huge")
    try:
        assert r.kind == "hugetlb" and r.size == 3 * hugepages
        assert r.prefault() in ("MADV_POPULATE_WRITE", "touch")
        r.mm[r.size - 3 :] = b"end"
        assert r.mm[r.size - 3 :] == b"end"
    finally:
        r.close()
    auto = Region.create(hugepages, "auto", name="emsd-test-huge")
    try:
        assert auto.kind == "hugetlb"
    finally:
        auto.close()


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A state directory; its keepers are let go afterwards."""
    yield tmp_path
    for sock in tmp_path.glob("*.keeper"):
        keeper.stop(sock)


def test_the_pool_is_sealed_against_any_change_of_size_and_any_further_seal(shm: Region) -> None:
    import fcntl

    for attack in (lambda: os.ftruncate(shm.fd, 0), lambda: os.ftruncate(shm.fd, 2 * shm.size),
                   lambda: fcntl.fcntl(shm.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)):
        with pytest.raises(PermissionError):
            attack()
    assert os.fstat(shm.fd).st_size == shm.size


def test_a_second_region_on_a_held_pool_is_refused_and_changes_nothing(state: Path) -> None:
    first = Region.create(1 << 20, "off", name="p", persist_dir=state)
    try:
        first.mm[:4] = b"live"
        for size in (1 << 20, 2 << 20):  # the same size, and one that would need a new pool
            with pytest.raises(RegionBusy, match="another emsd holds"):
                Region.create(size, "off", name="p", persist_dir=state)
        assert first.mm[:4] == b"live" and os.fstat(first.fd).st_size == 1 << 20
    finally:
        first.close()
    again = Region.create(1 << 20, "off", name="p", persist_dir=state)  # the holder is gone
    try:
        assert again.reused and again.mm[:4] == b"live"
    finally:
        again.close()


def test_a_clients_mapping_of_the_pool_does_not_keep_it_locked(state: Path) -> None:
    first = Region.create(1 << 20, "off", name="p", persist_dir=state)
    client_fd = os.dup(first.fd)  # what a client holds: the fd it was sent, and its mapping
    client_map = mmap.mmap(client_fd, 1 << 20, flags=mmap.MAP_SHARED)
    try:
        first.close()  # the daemon dies; its client lives on
        again = Region.create(1 << 20, "off", name="p", persist_dir=state)  # the warm restart
        assert again.reused
        again.close()
    finally:
        client_map.close()
        os.close(client_fd)


def test_the_keeper_outlives_the_daemon_and_a_pool_of_another_size_replaces_it(state: Path) -> None:
    first = Region.create(1 << 20, "off", name="p", persist_dir=state)
    first.mm[:4] = b"kept"
    first.close()  # nothing in this process holds the memfd now: only the keeper
    again = Region.create(1 << 20, "off", name="p", persist_dir=state)
    try:
        assert again.reused and again.mm[:4] == b"kept" and "kept by p.keeper" in again.reason
    finally:
        again.close()
    bigger = Region.create(2 << 20, "off", name="p", persist_dir=state)
    try:
        assert not bigger.reused and "does not suit pool.size" in bigger.reason and bigger.mm[:4] == bytes(4)
    finally:
        bigger.close()
    third = Region.create(2 << 20, "off", name="p", persist_dir=state)  # the keeper holds the new one
    try:
        assert third.reused and third.size == 2 << 20
    finally:
        third.close()


def test_a_stopped_keeper_exits_and_the_next_start_is_cold(state: Path) -> None:
    first = Region.create(1 << 20, "off", name="p", persist_dir=state)
    first.mm[:4] = b"gone"
    first.close()
    keeper.stop(state / "p.keeper")
    again = Region.create(1 << 20, "off", name="p", persist_dir=state)
    try:
        assert not again.reused and again.mm[:4] == bytes(4)
    finally:
        again.close()


def test_an_older_emsds_pool_file_is_removed(state: Path) -> None:
    (state / "p.pool").write_bytes(bytes(1 << 20))
    (state / "p.pool").chmod(0o600)
    r = Region.create(1 << 20, "off", name="p", persist_dir=state)
    try:
        assert not (state / "p.pool").exists() and not r.reused
    finally:
        r.close()


def test_a_keeper_started_on_its_own_takes_over_the_pool(state: Path) -> None:
    """As the Helm chart's keeper container does, started after a daemon that began its own."""
    import subprocess
    import sys
    import time

    first = Region.create(1 << 20, "off", name="p", persist_dir=state)
    first.mm[:4] = b"over"
    first.close()
    sock = state / "p.keeper"
    before = os.stat(sock).st_ino
    own = subprocess.Popen([sys.executable, "-m", "emsd.pool.keeper", str(sock)])
    try:
        deadline = time.monotonic() + 10
        while (not sock.exists() or os.stat(sock).st_ino == before) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # the first keeper has seen its socket file go, and exited
        again = Region.create(1 << 20, "off", name="p", persist_dir=state)
        try:
            assert again.reused and again.mm[:4] == b"over"
        finally:
            again.close()
    finally:
        keeper.stop(sock)
        assert own.wait(10) == 0
