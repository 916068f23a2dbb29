"""The RDMA advertisement in membership and the QP address exchange: encode, decode, reject."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emsd.membership.base import NodeInfo
from emsd.transport.rdma_desc import (
    EXTRA_KEY,
    DescriptorError,
    RdmaDescriptor,
    qp_from_wire,
    qp_to_wire,
)
from emsd.transport.verbs import PortInfo, QpAddress

GID = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
PORT = PortInfo("mlx5_0", 1, GID, 0, 4096, 30, 32768)

gids = st.lists(st.integers(0, 0xFFFF), min_size=8, max_size=8).map(lambda g: ":".join(f"{x:04x}" for x in g))
ports = st.builds(PortInfo, st.from_regex(r"[a-z0-9_]{1,16}", fullmatch=True), st.integers(1, 255), gids,
                  st.integers(0, 0xFFFF), st.sampled_from([256, 512, 1024, 2048, 4096]),
                  st.integers(1, 1 << 16), st.integers(1, 1 << 24))
descriptors = st.builds(RdmaDescriptor, ports, st.integers(0, 1 << 47),
                        st.lists(st.tuples(st.integers(1, 1 << 40), st.integers(0, (1 << 32) - 1)),
                                 min_size=1, max_size=256).map(tuple))


@given(desc=descriptors)
def test_a_descriptor_survives_membership_encoding(desc: RdmaDescriptor) -> None:
    info = NodeInfo("n1", "10.0.0.1:11000", desc.size, 1, {EXTRA_KEY: desc.to_extra()})
    back = NodeInfo.decode(info.encode())  # msgpack, under the 16 KiB limit even at 256 chunks
    assert RdmaDescriptor.from_extra(back.extra, back.capacity) == desc


def test_remote_chunks_are_contiguous_from_the_base() -> None:
    desc = RdmaDescriptor(PORT, 1 << 30, ((100, 7), (50, 8)))
    assert [(c.offset, c.length, c.key, c.addr) for c in desc.remote_chunks()] == [
        (0, 100, 7, 1 << 30), (100, 50, 8, (1 << 30) + 100)]


def test_a_node_without_rdma_advertises_none() -> None:
    assert RdmaDescriptor.from_extra({}, 1 << 20) is None


GOOD = RdmaDescriptor(PORT, 1 << 30, ((1 << 20, 5),)).to_extra()
BAD: list[tuple[str, Any]] = [
    ("v", 2), ("v", None), ("dev", ""), ("dev", "a b"), ("dev", 3), ("port", 0), ("port", "1"),
    ("gid", "fe80::1"), ("gid", b"x" * 16), ("lid", -1), ("lid", 1 << 16), ("mtu", 100), ("sge", 0),
    ("wr", True), ("base", -1), ("base", 1 << 64), ("chunks", []), ("chunks", [[0, 5]]),
    ("chunks", [[1 << 20, -1]]), ("chunks", [[1 << 20]]), ("chunks", [[1 << 19, 5]]),
    ("chunks", "x"), ("chunks", [[1, 1]] * 257), ("chunks", [[1 << 20, 1 << 32]]),
    ("chunks", [[float(1 << 20), 5]]),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_a_malformed_descriptor_is_rejected_naming_the_field(field: str, value: Any) -> None:
    raw = {**GOOD, field: value}
    with pytest.raises(DescriptorError, match=field):
        RdmaDescriptor.from_extra({EXTRA_KEY: raw}, 1 << 20)


def test_a_descriptor_that_is_not_a_map_is_rejected() -> None:
    with pytest.raises(DescriptorError):
        RdmaDescriptor.from_extra({EXTRA_KEY: [1, 2]}, 1 << 20)


def test_a_pool_running_past_the_address_space_is_rejected() -> None:
    with pytest.raises(DescriptorError, match="base"):
        RdmaDescriptor.from_extra({EXTRA_KEY: {**GOOD, "base": (1 << 64) - 100}}, 1 << 20)


@given(st.dictionaries(st.sampled_from(sorted(GOOD) + ["zz"]),
                       st.one_of(st.none(), st.integers(), st.text(max_size=5), st.binary(max_size=5),
                                 st.lists(st.integers(), max_size=3))))
def test_garbage_never_raises_anything_but_descriptor_error(raw: dict[str, Any]) -> None:
    try:
        RdmaDescriptor.from_extra({EXTRA_KEY: {**GOOD, **raw}}, 1 << 20)
    except DescriptorError:
        pass


@given(st.builds(QpAddress, st.integers(1, (1 << 24) - 1), st.integers(0, (1 << 24) - 1), gids,
                 st.integers(0, 0xFFFF)))
def test_qp_addresses_round_trip(qp: QpAddress) -> None:
    assert qp_from_wire(qp_to_wire(qp)) == qp


@pytest.mark.parametrize("raw", [None, [], {"qpn": 0, "psn": 0, "gid": GID, "lid": 0},
                                 {"qpn": 1 << 24, "psn": 0, "gid": GID, "lid": 0},
                                 {"qpn": 1, "psn": -1, "gid": GID, "lid": 0},
                                 {"qpn": 1, "psn": 0, "gid": "nope", "lid": 0},
                                 {"qpn": 1, "psn": 0, "gid": GID}])
def test_a_malformed_qp_address_is_rejected(raw: Any) -> None:
    with pytest.raises(DescriptorError):
        qp_from_wire(raw)
