"""The cluster's placement record: what it encodes decodes back, and nothing else decodes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from emsd.placement.record import REPLICAS, VNODES, Record, invalid, path


@given(st.integers(1, 4096), st.integers(1, 8), st.integers(1, 1 << 40))
def test_a_record_decodes_to_itself(vnodes: int, replicas: int, version: int) -> None:
    rec = Record(vnodes, replicas, version)
    assert Record.decode(rec.encode()) == rec
    assert rec.params == (vnodes, replicas)


@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_to_a_valid_record_or_none(data: bytes) -> None:
    rec = Record.decode(data)
    assert rec is None or (invalid(rec.vnodes, rec.replicas) is None and rec.version >= 1)


@given(st.integers(-10, 5000), st.integers(-10, 20))
def test_only_values_the_config_accepts_are_valid(vnodes: int, replicas: int) -> None:
    assert (invalid(vnodes, replicas) is None) == (vnodes in VNODES and replicas in REPLICAS)
    decoded = Record.decode(Record(vnodes, replicas).encode())
    assert (decoded is None) == (invalid(vnodes, replicas) is not None)


@given(st.sampled_from(["vnodes", "replicas", "version"]),
       st.one_of(st.integers(max_value=0), st.booleans(), st.text(max_size=3), st.none(), st.floats()))
def test_a_missing_or_invalid_field_is_no_record(field: str, bad: object) -> None:
    raw = {"vnodes": 512, "replicas": 2, "version": 3, field: bad}
    assert Record.decode(json.dumps(raw).encode()) is None
    del raw[field]
    assert Record.decode(json.dumps(raw).encode()) is None


def test_not_an_object_is_no_record() -> None:
    assert Record.decode(b"[512, 1, 1]") is None
    assert Record.decode(b"") is None


def test_the_record_lives_under_the_cluster() -> None:
    assert path("prod") == "/emsd/prod/placement"
