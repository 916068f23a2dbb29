"""``Service._keys``: a request looked at twice is parsed once, and nothing else is reused."""

from __future__ import annotations

import numpy as np
import pytest

from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.protocol.local import ExistsRequest
from emsd.service import RequestError, Service, Session
from emsd.transport.frames import Op
from tests.messages import opened, request


def test_the_same_payload_is_parsed_once_and_an_equal_copy_again() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = opened(svc)
    header, payload = request(Op.EXISTS, ExistsRequest(ns, KeyBatch.from_ints(np.arange(5, dtype=np.uint64))))
    first = svc._keys(s, header, payload)
    assert svc._keys(s, dict(header), payload)[1] is first[1]  # the PIN/EXISTS second look
    again = svc._keys(s, header, bytes(bytearray(payload)))  # equal bytes, another request
    assert again[1] is not first[1] and again[1].to_wire() == first[1].to_wire()
    fewer = svc._keys(s, {**header, "n": 3}, payload)  # other fields: parsed for themselves
    assert len(fewer[1]) == 3 and fewer[2] == payload[24:]


def test_a_remembered_payload_does_not_pass_checks_it_would_fail() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = opened(svc)
    header, payload = request(Op.EXISTS, ExistsRequest(ns, KeyBatch.from_ints(np.arange(2, dtype=np.uint64))))
    svc._keys(s, header, payload)
    with pytest.raises(RequestError, match="expected 24 bytes"):
        svc._keys(s, {**header, "n": 3}, payload)
    other = Session()  # another connection has not opened the namespace
    with pytest.raises(RequestError, match="not opened"):
        svc._keys(other, header, payload)
    with pytest.raises(RequestError, match="n must be"):
        svc._keys(s, {**header, "n": True}, b"")
