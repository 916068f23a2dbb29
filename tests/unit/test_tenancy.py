"""Tenant memory (emsd.pool.tenancy): pages of one view, each from its tenant's own memfd."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from emsd.pool.region import Region, RegionError
from emsd.pool.tenancy import TenantMemory

PAGE = 64 << 10
PAGES = 8


@pytest.fixture
def memory() -> TenantMemory:
    region = Region.create(PAGES * PAGE, "off", name="test-tenancy")
    m = TenantMemory(region, PAGE, "test-tenancy", None)
    yield m
    m.close()
    region.close()


def file_bytes(fd: int, page: int) -> bytes:
    """What a client mapping ``fd`` (as the SDK does) sees at ``page``."""
    mm = mmap.mmap(fd, PAGES * PAGE, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        return mm[page * PAGE : (page + 1) * PAGE]
    finally:
        mm.close()


def allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_a_bound_page_is_in_its_tenants_file_alone_and_leaves_it_when_it_moves(memory: TenantMemory) -> None:
    view = memory.region.mm
    a, b = memory.open("a"), memory.open("b")
    assert (a, b) == (1, 2) and memory.open("a") == 1 and memory.group("nobody") == 0
    assert memory.open("") == 0 and memory.fd("") == memory.region.fd  # the default tenant's: the pool's own
    view[PAGE : 2 * PAGE] = b"\x11" * PAGE  # the default tenant's bytes first
    memory.bind(1, 0, a)
    view[PAGE : 2 * PAGE] = b"\xaa" * PAGE
    assert file_bytes(memory.fd("a"), 1) == b"\xaa" * PAGE
    assert file_bytes(memory.region.fd, 1) == bytes(PAGE)  # punched from the pool's own file
    assert file_bytes(memory.fd("b"), 1) == bytes(PAGE)

    held = allocated(memory.fd("a"))
    memory.bind(1, a, b)
    view[PAGE : 2 * PAGE] = b"\xbb" * PAGE
    assert allocated(memory.fd("a")) <= held - PAGE  # a's memory went back to the kernel
    assert file_bytes(memory.fd("b"), 1) == b"\xbb" * PAGE
    assert file_bytes(memory.fd("a"), 1) == bytes(PAGE)  # a's client sees zeroes, never b's bytes
    assert view[0:PAGE] == bytes(PAGE) and file_bytes(memory.region.fd, 0) == bytes(PAGE)


def test_restore_maps_each_page_from_its_owner_and_punches_the_rest(memory: TenantMemory) -> None:
    a = memory.open("a")
    memory.bind(2, 0, a)
    memory.bind(3, 0, a)
    memory.region.mm[2 * PAGE : 4 * PAGE] = b"\xaa" * (2 * PAGE)
    memory._map(2, 0)  # as a restarted daemon's view starts: the pool's own file everywhere
    memory._map(3, 0)
    memory.region.mm[5 * PAGE : 7 * PAGE] = b"\x55" * (2 * PAGE)  # the default tenant's
    owners = np.zeros(PAGES, dtype=np.int32)
    owners[2] = a  # page 3's block did not come back
    free = np.ones(PAGES, dtype=bool)
    free[[2, 5]] = False  # page 6's default block did not come back either
    memory.restore(owners, free)
    assert memory.region.mm[2 * PAGE : 3 * PAGE] == b"\xaa" * PAGE
    assert file_bytes(memory.fd("a"), 3) == bytes(PAGE)
    assert memory.region.mm[3 * PAGE : 4 * PAGE] == bytes(PAGE)
    assert memory.region.mm[5 * PAGE : 6 * PAGE] == b"\x55" * PAGE
    assert memory.region.mm[6 * PAGE : 7 * PAGE] == bytes(PAGE)  # free: nothing left for anyone


def test_a_slab_page_smaller_than_the_pools_pages_is_refused() -> None:
    region = Region.create(PAGES * PAGE, "off", name="test-tenancy")
    try:
        with pytest.raises(RegionError, match="multiple"):
            TenantMemory(region, 1024, "test-tenancy", None)
    finally:
        region.close()
