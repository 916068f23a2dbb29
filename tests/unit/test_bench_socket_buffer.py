"""benchmarks/bench_socket_buffer.py: the sizes it is given and how it names them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_socket_buffer import label, parse_sizes


def test_sizes_are_read_in_order_with_units_and_zero() -> None:
    assert parse_sizes("256KiB, 4MiB,0") == [256 << 10, 4 << 20, 0]


@pytest.mark.parametrize("bad", ["", "256KiB,,4MiB", "lots", "1MiB,1024KiB", "-1"])
def test_bad_lists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_sizes(bad)


def test_labels() -> None:
    assert [label(s) for s in (0, 256 << 10, 4 << 20, 1000)] == ["autotuning", "256 KiB", "4 MiB", "1000 B"]


@given(st.lists(st.integers(0, 1 << 34), min_size=1, max_size=6, unique=True))
def test_a_list_of_byte_counts_reads_back(sizes: list[int]) -> None:
    assert parse_sizes(",".join(map(str, sizes))) == sizes
