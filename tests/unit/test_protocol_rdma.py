"""``emsd.protocol.rdma``: the RDMA control messages, through real frames and back.

Every message must survive its encoding (framed by the codec, read back by
``FrameDecoder``) unchanged; every limit broken is a ``FrameError``; anything a
peer could send instead decodes or raises ``FrameError``, never another error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_peer_protocol import (  # the peer messages' strategies and checks
    decode_or_refuse,
    fields,
    framed,
    names,
    sizes,
    user_keys,
)

from emsd.pool.keys import KeyBatch
from emsd.protocol.peer import MAX_NAME
from emsd.protocol.rdma import (
    MAX_TOKEN,
    CommitAnswer,
    CommitRequest,
    PinAnswer,
    PinRequest,
    QpAnswer,
    QpRequest,
    ReserveAnswer,
    ReserveRequest,
    UnpinRequest,
)
from emsd.transport.frames import FrameError, PeerOp

u64s = st.integers(0, 2**64 - 1)
tokens = st.integers(1, MAX_TOKEN)


@given(names, user_keys)
def test_pin_requests_round_trip(ns: str, ks: list[int | bytes]) -> None:
    keys = KeyBatch.from_user(ks)
    header, payload = framed(PinRequest(ns, keys).encode())
    assert header["op"] == PeerOp.RDMA_PIN
    back = PinRequest.decode(header, payload)
    assert back.ns == ns and back.keys.to_wire() == keys.to_wire()


@given(tokens, st.data())
def test_pin_answers_round_trip_within_the_keys_asked(tok: int, data: st.DataObject) -> None:
    lens = data.draw(st.lists(sizes, max_size=20))
    offs = data.draw(st.lists(u64s, min_size=len(lens), max_size=len(lens)))
    answer = PinAnswer(tok, np.array(offs, dtype=np.uint64), np.array(lens, dtype=np.uint64))
    header, payload = framed(answer.encode())
    back = PinAnswer.decode(header, payload, asked=len(lens) + data.draw(st.integers(0, 3)))
    assert (back.tok, back.count) == (tok, len(lens))
    assert (back.offsets.tolist(), back.lengths.tolist()) == (offs, lens)
    if lens:  # more blocks than were asked for is a broken answer
        with pytest.raises(FrameError):
            PinAnswer.decode(header, payload, asked=len(lens) - 1)


@given(names, st.data())
def test_reserve_requests_round_trip(ns: str, data: st.DataObject) -> None:
    ks = data.draw(user_keys)
    lengths = np.array(data.draw(st.lists(sizes, min_size=len(ks), max_size=len(ks))), dtype=np.uint64)
    keys = KeyBatch.from_user(ks)
    header, payload = framed(ReserveRequest(ns, keys, lengths).encode())
    assert header["op"] == PeerOp.RDMA_RESERVE
    back = ReserveRequest.decode(header, payload)
    assert back.ns == ns and back.keys.to_wire() == keys.to_wire()
    assert back.lengths.tolist() == lengths.tolist()


@given(tokens, st.data())
def test_reserve_answers_round_trip_and_must_cover_every_key_asked(tok: int, data: st.DataObject) -> None:
    status = data.draw(st.lists(st.integers(0, 2), max_size=20))
    offs = data.draw(st.lists(u64s, min_size=len(status), max_size=len(status)))
    answer = ReserveAnswer(tok, np.array(status, np.uint8), np.array(offs, np.uint64))
    header, payload = framed(answer.encode())
    back = ReserveAnswer.decode(header, payload, asked=len(status))
    assert (back.tok, back.status.tolist(), back.offsets.tolist()) == (tok, status, offs)
    with pytest.raises(FrameError):
        ReserveAnswer.decode(header, payload, asked=len(status) + 1)


@given(tokens, st.booleans(), st.integers(0, 1000), st.integers(0, 1000))
def test_unpin_and_commit_round_trip(tok: int, ok: bool, stored: int, asked: int) -> None:
    assert UnpinRequest.decode(*framed(UnpinRequest(tok).encode())) == UnpinRequest(tok)
    header, payload = framed(CommitRequest(tok, ok).encode())
    assert header["op"] == PeerOp.RDMA_COMMIT
    assert CommitRequest.decode(header, payload) == CommitRequest(tok, ok)
    header, payload = framed(CommitAnswer(stored).encode())
    if stored <= asked:
        assert CommitAnswer.decode(header, payload, asked).stored == stored
    else:
        with pytest.raises(FrameError):
            CommitAnswer.decode(header, payload, asked)


def test_queue_pairs_travel_as_given() -> None:
    qp = {"qpn": 5, "psn": 9, "lid": 0, "gid": b"\0" * 16}
    assert QpRequest.decode(*framed(QpRequest(qp).encode())).qp == qp
    assert QpAnswer.decode(*framed(QpAnswer(qp).encode())).qp == qp
    with pytest.raises(FrameError):
        QpRequest.decode({"op": PeerOp.RDMA_QP, "qp": qp}, b"\0")


def test_what_a_control_message_must_not_carry_is_refused() -> None:
    keys = KeyBatch.from_user([1, 2])
    header, parts = ReserveRequest("ns", keys, np.array([10, 20], dtype=np.uint64)).encode()
    payload = b"".join(parts)
    for bad_header, bad_payload in (
            (header, payload[:-1]),  # lengths cut short
            (header, payload[:-8] + np.array([0], "<u8").tobytes()),  # an empty block
            ({**header, "ns": ""}, payload),
            ({**header, "ns": "x" * (MAX_NAME + 1)}, payload),
            ({**header, "n": 3}, payload)):
        with pytest.raises(FrameError):
            ReserveRequest.decode(bad_header, bad_payload)
    pin_header, pin_parts = PinRequest("ns", keys).encode()
    with pytest.raises(FrameError):  # bytes after the keys
        PinRequest.decode(pin_header, b"".join(pin_parts) + b"\0")
    for tok in (0, -1, MAX_TOKEN + 1, "1", 1.0, True, None):
        with pytest.raises(FrameError):
            UnpinRequest.decode({"op": PeerOp.RDMA_UNPIN, "tok": tok}, b"")
        with pytest.raises(FrameError):
            CommitRequest.decode({"op": PeerOp.RDMA_COMMIT, "tok": tok, "ok": True}, b"")
    for ok in (1, 0, "yes", None):  # commit or abort is said with a bool, nothing else
        with pytest.raises(FrameError):
            CommitRequest.decode({"op": PeerOp.RDMA_COMMIT, "tok": 1, "ok": ok}, b"")
    with pytest.raises(FrameError):  # a PIN answer whose body does not hold its blocks
        PinAnswer.decode({"count": 2, "tok": 1}, b"\0" * 31, asked=2)


field_names = st.sampled_from(["ns", "n", "kt", "count", "tok", "ok", "stored", "qp", "op"])


@settings(max_examples=300)
@given(st.dictionaries(field_names, fields), st.binary(max_size=120), st.integers(0, 20))
def test_anything_a_peer_sends_decodes_or_is_a_frame_error(header: dict[str, Any], payload: bytes,
                                                           asked: int) -> None:
    decode_or_refuse((QpRequest, PinRequest, UnpinRequest, ReserveRequest, CommitRequest),
                     (QpAnswer, PinAnswer, ReserveAnswer, CommitAnswer), header, payload, asked)
