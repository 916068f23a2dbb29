"""``emsd.protocol.peer``: the daemon-to-daemon messages, through real frames and back.

Every message must survive its encoding (header and payload, framed by the
codec and decoded by ``FrameDecoder``) unchanged; anything a peer could send
instead decodes to a message or raises ``FrameError``, never another error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.keys import KeyBatch
from emsd.protocol.peer import (
    MAX_BULK,
    MAX_NAME,
    DropAnswer,
    DropRequest,
    GetAnswer,
    GetRequest,
    HasAnswer,
    HasRequest,
    PutAnswer,
    PutRequest,
    block_lengths,
)
from emsd.transport.frames import PROTOCOL_VERSION, FrameDecoder, FrameError, PeerOp, Status, encode_parts

names = st.text(min_size=1, max_size=40)
user_keys = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=32)), max_size=20)
sizes = st.integers(1, 1 << 26)


def framed(encoded: tuple[dict[str, Any], list[bytes]], rid: int = 7) -> tuple[dict[str, Any], bytes]:
    """``encoded`` sent as a frame with id ``rid`` and read back by the codec."""
    header, parts = encoded
    raw = b"".join(encode_parts({"v": PROTOCOL_VERSION, "id": rid, **header}, *parts))
    (frame,) = FrameDecoder().feed(raw)
    return frame.header, frame.payload


def wire(keys: KeyBatch) -> tuple[int, bytes]:
    return keys.to_wire()


@given(names, user_keys)
def test_get_and_has_requests_round_trip(ns: str, ks: list[int | bytes]) -> None:
    keys = KeyBatch.from_user(ks)
    for cls, op in ((GetRequest, PeerOp.GET), (HasRequest, PeerOp.HAS)):
        header, payload = framed(cls(ns, keys).encode())
        assert header["op"] == op and header["id"] == 7
        back = cls.decode(header, payload)
        assert back.ns == ns and wire(back.keys) == wire(keys)


@given(names, st.data())
def test_put_requests_round_trip_with_their_bulk(ns: str, data: st.DataObject) -> None:
    ks = data.draw(user_keys)
    lengths = np.array(data.draw(st.lists(sizes, min_size=len(ks), max_size=len(ks))), dtype=np.uint64)
    keys = KeyBatch.from_user(ks)
    header, payload = framed(PutRequest(ns, keys, lengths).encode())
    assert header["bulk"] == int(lengths.sum())
    back = PutRequest.decode(header, payload)
    assert back.ns == ns and wire(back.keys) == wire(keys)
    assert back.lengths.tolist() == lengths.tolist()


@given(st.lists(sizes, max_size=30), st.integers(0, 5))
def test_get_answers_round_trip_within_the_keys_asked(lens: list[int], spare: int) -> None:
    lengths = np.array(lens, dtype=np.uint64)
    header, payload = framed(GetAnswer(len(lens), lengths).encode())
    assert header["st"] == Status.OK
    back = GetAnswer.decode(header, payload, asked=len(lens) + spare)
    assert back.count == len(lens) and back.lengths.tolist() == lens
    if lens:  # more blocks than were asked for is a broken answer
        with pytest.raises(FrameError):
            GetAnswer.decode(header, payload, asked=len(lens) - 1)


@given(st.integers(0, 1000), st.integers(0, 1000))
def test_counting_answers_round_trip_and_never_exceed_the_keys_asked(count: int, asked: int) -> None:
    for cls, field in ((PutAnswer, "stored"), (HasAnswer, "count")):
        header, payload = framed(cls(count).encode())
        if count <= asked:
            assert getattr(cls.decode(header, payload, asked), field) == count
        else:
            with pytest.raises(FrameError):
                cls.decode(header, payload, asked)


@given(names, st.integers(0, 10**9))
def test_drops_round_trip(ns: str, dropped: int) -> None:
    assert DropRequest.decode(*framed(DropRequest(ns).encode())) == DropRequest(ns)
    assert DropAnswer.decode(*framed(DropAnswer(dropped).encode())).dropped == dropped


def test_what_a_put_must_not_carry_is_refused() -> None:
    keys = KeyBatch.from_user([1, 2])
    header, parts = PutRequest("ns", keys, np.array([10, 20], dtype=np.uint64)).encode()
    payload = b"".join(parts)
    for bad_header, bad_payload in (
            ({**header, "bulk": 31}, payload),  # bulk that the lengths do not add up to
            ({**header, "bulk": 10}, payload[:-8] + np.array([0], "<u8").tobytes()),  # an empty block
            ({**header, "bulk": MAX_BULK + 1}, payload[:-16] + np.array([MAX_BULK, 1], "<u8").tobytes()),
            (header, payload[:-1]),  # lengths cut short
            ({**header, "ns": ""}, payload),
            ({**header, "ns": "x" * (MAX_NAME + 1)}, payload),
            ({k: v for k, v in header.items() if k != "ns"}, payload),
            ({**header, "n": 3}, payload)):
        with pytest.raises(FrameError):
            PutRequest.decode(bad_header, bad_payload)


def test_keyed_requests_refuse_bytes_after_their_keys_and_drop_refuses_any_payload() -> None:
    header, parts = GetRequest("ns", KeyBatch.from_user([5])).encode()
    for cls in (GetRequest, HasRequest):
        with pytest.raises(FrameError):
            cls.decode(header, b"".join(parts) + b"\0")
    with pytest.raises(FrameError):
        DropRequest.decode({"op": PeerOp.DROP, "ns": "ns"}, b"\0")


def test_block_lengths_take_exactly_n_nonzero_lengths() -> None:
    assert block_lengths(np.array([3, 4], "<u8").tobytes(), 2).tolist() == [3, 4]
    assert block_lengths(b"", 0).size == 0
    for raw, n in ((np.array([3], "<u8").tobytes(), 2), (np.array([0], "<u8").tobytes(), 1), (b"\1" * 7, 1)):
        with pytest.raises(FrameError):
            block_lengths(raw, n)


fields = st.one_of(st.integers(-(2**64), 2**64), st.text(max_size=10), st.binary(max_size=10), st.none(),
                   st.booleans(), st.floats(allow_nan=False), st.lists(st.integers(), max_size=3))


field_names = st.sampled_from(["ns", "n", "kt", "bulk", "count", "stored", "dropped", "op"])


@settings(max_examples=300)
@given(st.dictionaries(field_names, fields), st.binary(max_size=120), st.integers(0, 20))
def test_anything_a_peer_sends_decodes_or_is_a_frame_error(header: dict[str, Any], payload: bytes,
                                                           asked: int) -> None:
    decode_or_refuse((GetRequest, HasRequest, PutRequest, DropRequest),
                     (GetAnswer, PutAnswer, HasAnswer, DropAnswer), header, payload, asked)


def decode_or_refuse(requests: tuple[Any, ...], answers: tuple[Any, ...], header: dict[str, Any],
                     payload: bytes, asked: int) -> None:
    """Every request type decodes ``header`` and ``payload``, and every answer type those with
    ``asked``, or raises a ``FrameError`` of INVALID_ARGUMENT: never another error."""
    decoders = [*(lambda cls=cls: cls.decode(header, payload) for cls in requests),
                *(lambda cls=cls: cls.decode(header, payload, asked) for cls in answers)]
    for decode in decoders:
        try:
            decode()
        except FrameError as exc:
            assert exc.status == Status.INVALID_ARGUMENT
