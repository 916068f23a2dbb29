"""``emsd.protocol.local``: the SDK-to-daemon messages, through real frames and back.

Every message survives its encoding (header and payload, framed by the codec
and read back by ``FrameDecoder``) unchanged; every limit a request breaks,
and any payload cut short or run over, is a ``FrameError`` of status
INVALID_ARGUMENT; anything a client could send decodes to a message or raises
``FrameError``, never another error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from emsd.pool.keys import KeyBatch
from emsd.protocol.local import (
    MAX_FOUND,
    MAX_HANDLES,
    MAX_NAME,
    MAX_NS,
    MAX_PASS,
    MAX_SIZE,
    OWNER_KEYS,
    CommitAnswer,
    CommitRequest,
    CountAnswer,
    DropAnswer,
    DropRequest,
    ExistsRequest,
    GrantAnswer,
    GrantRequest,
    NamespaceAnswer,
    NamespaceRequest,
    OwnerAnswer,
    OwnerRequest,
    PinAnswer,
    PinRequest,
    PlacementRequest,
    PutAnswer,
    PutRequest,
    ReleaseRequest,
    ReserveAnswer,
    ReserveRequest,
    RingAnswer,
    TouchRequest,
)
from emsd.transport.frames import (
    MAX_BATCH_KEYS,
    PROTOCOL_VERSION,
    FrameDecoder,
    FrameError,
    Status,
    encode_parts,
)

Encoded = tuple[dict[str, Any], list[bytes]]

ns_ids = st.integers(0, MAX_NS)
user_keys = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=32)), max_size=12)
batches = user_keys.map(KeyBatch.from_user)
prevs = st.none() | st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=32)).map(
    lambda k: KeyBatch.from_user([k]))
budgets = st.none() | st.integers(0, 10**9)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)


def u64s(n: int) -> st.SearchStrategy[np.ndarray]:
    return st.lists(u64, min_size=n, max_size=n).map(lambda v: np.array(v, dtype=np.uint64))


def u32s(most: int = 12) -> st.SearchStrategy[np.ndarray]:
    return st.lists(u32, max_size=most).map(lambda v: np.array(v, dtype=np.uint32))


def framed(encoded: Encoded) -> tuple[dict[str, Any], bytes]:
    """``encoded`` sent as a frame and read back by the codec."""
    header, parts = encoded
    raw = b"".join(encode_parts({"v": PROTOCOL_VERSION, "id": 7, "op": 1, **header}, *parts))
    (frame,) = FrameDecoder().feed(raw)
    return frame.header, frame.payload


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Field by field: arrays by value, key batches by their wire form."""
    if type(a) is not type(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and np.array_equal(x, y)):
                return False
        elif isinstance(x, KeyBatch):
            if not (isinstance(y, KeyBatch) and x.to_wire() == y.to_wire()):
                return False
        elif x != y:
            return False
    return True


# -- messages ------------------------------------------------------------------------


@st.composite
def reserves(draw: st.DrawFn) -> ReserveRequest:
    keys = draw(batches)
    return ReserveRequest(draw(ns_ids), keys, draw(u64s(len(keys))), draw(prevs), draw(budgets))


@st.composite
def puts(draw: st.DrawFn) -> PutRequest:
    keys = draw(batches)
    return PutRequest(draw(ns_ids), keys, draw(u64s(len(keys))), draw(u64s(len(keys))), draw(prevs),
                      draw(st.booleans()), draw(budgets))


pins = st.builds(PinRequest, ns_ids, batches, prevs, st.booleans(), st.booleans(), budgets,
                 st.none() | st.integers(1, MAX_BATCH_KEYS))
touches = st.builds(TouchRequest, ns_ids, batches, prevs, st.integers(0, MAX_FOUND))
exists = st.builds(ExistsRequest, ns_ids, batches, st.booleans(), budgets)
commits = st.builds(CommitRequest, u32s(), u32s(), st.booleans(), budgets)
releases = st.builds(ReleaseRequest, u32s())
grants = st.builds(GrantRequest, st.integers(1, MAX_SIZE), st.integers(0, MAX_BATCH_KEYS),
                   st.integers(0, MAX_BATCH_KEYS), st.lists(u64, max_size=8).map(
                       lambda v: np.array(v, dtype=np.uint64)))
namespaces = st.builds(NamespaceRequest, st.text(min_size=1, max_size=40))
drops = st.builds(DropRequest, ns_ids, budgets)
owners = st.builds(OwnerRequest, st.text(min_size=1, max_size=40),
                   st.lists(u64, min_size=1, max_size=12).map(KeyBatch.from_user))
placements = st.builds(PlacementRequest, st.integers(1, 64), st.integers(1, 3))
requests = st.one_of(reserves(), puts(), pins, touches, exists, commits, releases, grants, namespaces,
                     drops, owners, placements)
keyed = st.one_of(reserves(), puts(), pins, touches, exists)


@given(requests)
def test_every_request_round_trips_through_a_frame(msg: Any) -> None:
    header, payload = framed(msg.encode())
    assert same(type(msg).decode(header, payload), msg)


@given(keyed)
def test_a_keyed_request_decodes_the_same_from_a_split_made_before(msg: Any) -> None:
    header, payload = framed(msg.encode())
    keys_bytes = len(msg.keys.to_wire()[1])
    split = (type(msg).decode(header, payload).keys, payload[keys_bytes:])
    assert same(type(msg).decode(header, payload, split), msg)


@st.composite
def answers(draw: st.DrawFn) -> tuple[Any, int]:
    """An answer and the count its request asked."""
    n = draw(st.integers(0, 12))
    kind = draw(st.sampled_from(["reserve", "pin", "put", "grant", "count", "commit"]))
    if kind == "reserve":
        return ReserveAnswer(draw(u64s(n)), draw(u64s(n)).astype(np.uint32) if False else
                             np.array(draw(st.lists(u32, min_size=n, max_size=n)), dtype=np.uint32),
                             np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
                                      dtype=np.uint8)), n
    count = draw(st.integers(0, n))
    if kind == "pin":
        return PinAnswer(draw(u64s(count)), draw(u64s(count)),
                         np.array(draw(st.lists(u32, min_size=count, max_size=count)), dtype=np.uint32),
                         draw(st.booleans())), n
    if kind == "put":
        status = np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.uint8)
        new = int(np.count_nonzero(status == 0))
        reached = draw(st.none() | st.binary(min_size=new, max_size=new))
        return PutAnswer(status, reached), n
    if kind == "grant":
        return GrantAnswer(draw(u64s(count))), n
    if kind == "count":
        return CountAnswer(count), n
    reached = draw(st.none() | st.binary(min_size=n, max_size=n))
    return CommitAnswer(count, reached), n


@given(answers())
def test_every_answer_round_trips_given_what_was_asked(case: tuple[Any, int]) -> None:
    msg, asked = case
    header, payload = framed(msg.encode())
    assert same(type(msg).decode(header, payload, asked), msg)


@given(st.integers(0, MAX_NS), st.integers(0, 2**63), st.integers(0, 2**63), st.text(min_size=1, max_size=9))
def test_header_only_answers_round_trip(ns: int, dropped: int, missed: int, _name: str) -> None:
    assert NamespaceAnswer.decode(*framed(NamespaceAnswer(ns).encode())) == NamespaceAnswer(ns)
    assert DropAnswer.decode(*framed(DropAnswer(dropped, missed).encode())) == DropAnswer(dropped, missed)
    owners = [[_name], [_name, "b"]]
    assert OwnerAnswer.decode(*framed(OwnerAnswer(owners).encode()), 2) == OwnerAnswer(owners)


@given(puts())
def test_the_one_block_forms_agree_with_decode(msg: PutRequest) -> None:
    header, payload = framed(msg.encode())
    if len(msg.keys) == 1:
        rest = payload[len(msg.keys.to_wire()[1]):]
        at, size, prev = PutRequest.one(header, rest)
        assert (at, size) == (int(msg.at[0]), int(msg.sizes[0]))
        assert (prev is None) == (msg.prev is None)
        one = PutRequest.encode_one(msg.ns, msg.keys, at, size, msg.prev, msg.wr, msg.to)
        assert framed(one) == (header, payload)  # the SDK's scalar encode: the same frame
    for status in (0, 1, 2):
        for reached in (None, b"\0", b"\1"):
            answer = PutAnswer(np.array([status], dtype=np.uint8), reached if status == 0 else None)
            h, p = framed(answer.encode() if reached is None or status else PutAnswer.encode_one(status))
            if reached is not None and status == 0:
                h["reached"] = reached
            one, got = PutAnswer.one(h, p), PutAnswer.decode(h, p, 1)
            assert one[0] == int(got.status[0])
            assert one[1] == (got.reached != b"\0")


# -- refusals ----------------------------------------------------------------------


def refused(decode: Any, *args: Any) -> None:
    with pytest.raises(FrameError) as caught:
        decode(*args)
    assert caught.value.status == Status.INVALID_ARGUMENT


@given(keyed, st.data())
def test_a_keyed_payload_cut_short_or_run_over_is_refused(msg: Any, data: st.DataObject) -> None:
    header, payload = framed(msg.encode())
    extra = data.draw(st.binary(min_size=1, max_size=40))
    refused(type(msg).decode, header, payload + extra)
    if payload:
        cut = data.draw(st.integers(1, len(payload)))
        refused(type(msg).decode, header, payload[:-cut])


@given(st.one_of(commits, grants, releases), st.data())
def test_a_handle_or_offset_payload_off_its_size_is_refused(msg: Any, data: st.DataObject) -> None:
    header, payload = framed(msg.encode())
    if isinstance(msg, CommitRequest):
        refused(CommitRequest.decode, header, payload + data.draw(st.binary(min_size=1, max_size=9)))
        if payload:
            refused(CommitRequest.decode, header, payload[:-1])
    else:  # a count the payload gives: refused only when not whole entries
        refused(type(msg).decode, header, payload + data.draw(st.binary(min_size=1, max_size=3)))


def keyed_header(**fields: Any) -> dict[str, Any]:
    return {"ns": 1, "n": 1, "kt": 0, **fields}


KEY = (5).to_bytes(8, "little")
BAD_HEADERS: list[tuple[Any, dict[str, Any], bytes]] = [
    # namespace ids, key counts and types, budgets, flags, pk: every keyed request the same
    *[(cls, keyed_header(**bad), KEY + rest)
      for cls, rest in ((PinRequest, b""), (ExistsRequest, b""), (TouchRequest, b""),
                        (ReserveRequest, bytes(8)), (PutRequest, bytes(16)))
      for bad in ({"ns": -1}, {"ns": MAX_NS + 1}, {"ns": "a"}, {"ns": True}, {"ns": None},
                  {"n": MAX_BATCH_KEYS + 1}, {"n": -1}, {"n": "1"}, {"kt": 2}, {"kt": None})],
    *[(cls, keyed_header(to=to), KEY + rest)  # TOUCH has no budget: no peers
      for cls, rest in ((PinRequest, b""), (ExistsRequest, b""), (ReserveRequest, bytes(8)),
                        (PutRequest, bytes(16)))
      for to in (-1, "5", 1.5)],
    *[(cls, keyed_header(pk=pk), KEY + rest)
      for cls, rest in ((PinRequest, b""), (TouchRequest, b""), (ReserveRequest, bytes(8)),
                        (PutRequest, bytes(16)))
      for pk in (b"", b"x" * 9, "text", 5, b"\x40" + bytes(32))],
    *[(cls, keyed_header(**{flag: 1}), KEY) for cls, flag in
      ((PinRequest, "lo"), (PinRequest, "wr"), (ExistsRequest, "lo"))],
    *[(PinRequest, keyed_header(br=br), KEY) for br in (0, -1, MAX_BATCH_KEYS + 1, "4", 2.0, True)],
    (PutRequest, keyed_header(wr="no"), KEY + bytes(16)),
    (TouchRequest, keyed_header(x=-1), KEY),
    (TouchRequest, keyed_header(x=MAX_FOUND + 1), KEY),
    (CommitRequest, {"c": -1, "a": 0}, b""),
    (CommitRequest, {"c": 0, "a": MAX_HANDLES + 1}, b""),
    (CommitRequest, {"c": "1"}, bytes(4)),
    (CommitRequest, {"c": 1, "wr": 0}, bytes(4)),
    (ReleaseRequest, {}, bytes(5)),
    (GrantRequest, {"size": 0, "k": 1}, b""),
    (GrantRequest, {"size": MAX_SIZE + 1, "k": 1}, b""),
    (GrantRequest, {"size": 1, "k": MAX_BATCH_KEYS + 1}, b""),
    (GrantRequest, {"size": 1, "k": 1, "need": -1}, b""),
    (GrantRequest, {"size": 1}, b""),
    (GrantRequest, {"size": 1, "k": 1}, bytes(7)),
    (NamespaceRequest, {"name": ""}, b""),
    (NamespaceRequest, {"name": "x" * (MAX_NAME + 1)}, b""),
    (NamespaceRequest, {"name": 3}, b""),
    (DropRequest, {"ns": "x"}, b""),
    (DropRequest, {"ns": 1, "to": -5}, b""),
    (OwnerRequest, {"ns": "m", "n": 0, "kt": 0}, b""),
    (OwnerRequest, {"ns": "m", "n": OWNER_KEYS + 1, "kt": 0}, bytes(8 * (OWNER_KEYS + 1))),
    (OwnerRequest, {"ns": 1, "n": 1, "kt": 0}, KEY),
    (PlacementRequest, {"vnodes": 0, "replicas": 1}, b""),
    (PlacementRequest, {"vnodes": 8, "replicas": "2"}, b""),
]


@pytest.mark.parametrize(("cls", "header", "payload"), BAD_HEADERS)
def test_every_limit_a_request_breaks_is_an_invalid_argument(cls: Any, header: dict[str, Any],
                                                              payload: bytes) -> None:
    refused(cls.decode, header, payload)


def test_the_bad_cases_differ_from_good_requests_only_in_the_field_named() -> None:
    for cls, rest in ((PinRequest, b""), (ExistsRequest, b""), (TouchRequest, b""),
                      (ReserveRequest, bytes(8)), (PutRequest, bytes(16))):
        assert len(cls.decode(keyed_header(), KEY + rest).keys) == 1
    assert PutRequest.one(keyed_header(), bytes(16)) == (0, 0, None)
    refused(PutRequest.one, keyed_header(), bytes(15))
    refused(PutRequest.one, keyed_header(wr=1), bytes(16))


@pytest.mark.parametrize(("cls", "header", "payload", "asked"), [
    (ReserveAnswer, {"n": 2}, bytes(25), 2),
    (PinAnswer, {"count": 3}, bytes(60), 2),  # more than asked
    (PinAnswer, {"count": 1}, bytes(19), 2),
    (PinAnswer, {}, b"", 2),
    (PutAnswer, {"n": 2}, bytes(1), 2),
    (GrantAnswer, {"k": 2}, bytes(8), 8),
    (CountAnswer, {"count": 3}, b"", 2),
    (CountAnswer, {"count": "1"}, b"", 2),
    (CommitAnswer, {"committed": -1}, b"", 2),
    (CommitAnswer, {"committed": 2, "reached": b"\1"}, b"", 2),  # reached: one byte per block
    (CommitAnswer, {"committed": 2, "reached": "\1\1"}, b"", 2),
    (PutAnswer, {"n": 2, "reached": b"\1"}, bytes(2), 2),  # two NEW blocks
    (PutAnswer, {"n": 2, "reached": b"\1"}, bytes((1, 1)), 2),  # no NEW block: no reached
    (OwnerAnswer, {"owners": [["a"]]}, b"", 2),  # fewer keys than asked
    (OwnerAnswer, {"owners": [["a"], []]}, b"", 2),  # a key with no owner
    (OwnerAnswer, {"owners": [["a"], [1]]}, b"", 2),
    (OwnerAnswer, {"owners": "a"}, b"", 1),
])
def test_an_answer_that_does_not_fit_its_request_is_refused(cls: Any, header: dict[str, Any],
                                                            payload: bytes, asked: int) -> None:
    refused(cls.decode, header, payload, asked)


values = st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.text(max_size=5),
                   st.binary(max_size=40), st.floats(allow_nan=False))
fields = st.sampled_from(["ns", "n", "kt", "to", "pk", "lo", "wr", "x", "c", "a", "size", "k", "need",
                          "name", "vnodes", "replicas"])
REQUEST_TYPES = [ReserveRequest, CommitRequest, PinRequest, ReleaseRequest, TouchRequest, ExistsRequest,
                 GrantRequest, PutRequest, NamespaceRequest, DropRequest, OwnerRequest, PlacementRequest]


@given(st.sampled_from(REQUEST_TYPES), st.dictionaries(fields, values, max_size=8), st.binary(max_size=120))
def test_anything_a_client_sends_decodes_or_is_a_frame_error(cls: Any, header: dict[str, Any],
                                                             payload: bytes) -> None:
    try:
        cls.decode(header, payload)
    except FrameError as exc:
        assert exc.status == Status.INVALID_ARGUMENT


node_ids = st.text(min_size=1, max_size=12)
rings = st.builds(
    RingAnswer, st.binary(min_size=1, max_size=MAX_PASS), st.integers(1, 3600), st.integers(1, 4096),
    st.integers(1, 3), node_ids, st.text(max_size=20),
    st.dictionaries(node_ids, st.tuples(st.integers(1, 2**40), st.text(max_size=21)), min_size=1,
                    max_size=5).map(lambda m: [(k, c, a) for k, (c, a) in sorted(m.items())]))


@given(rings)
def test_a_ring_answer_round_trips(msg: RingAnswer) -> None:
    assert RingAnswer.decode(*framed(msg.encode())) == msg


@pytest.mark.parametrize("change", [
    {"pass": b""}, {"pass": b"x" * (MAX_PASS + 1)}, {"pass": "text"}, {"vnodes": 0}, {"replicas": 0},
    {"members": []}, {"members": [["a", 1, "h:1"], ["a", 2, "h:2"]]}, {"members": [["a", 0, "h:1"]]},
    {"members": [["", 1, "h:1"]]}, {"members": [["a", 1]]}, {"members": [["a", True, "h:1"]]},
    {"me": 3}, {"prefix": "p" * (MAX_NAME + 1)}, {"ttl": 0}])
def test_a_ring_answer_off_its_limits_is_refused(change: dict[str, Any]) -> None:
    header, _ = RingAnswer(b"pass", 300, 512, 1, "a", "", [("a", 1, "h:1")]).encode()
    RingAnswer.decode(header, b"")  # the unchanged answer decodes
    with pytest.raises(FrameError) as exc:
        RingAnswer.decode({**header, **change}, b"")
    assert exc.value.status == Status.INVALID_ARGUMENT


@given(st.dictionaries(st.sampled_from(["pass", "ttl", "vnodes", "replicas", "me", "prefix", "members"]),
                       values, max_size=7))
def test_any_ring_answer_header_decodes_or_is_a_frame_error(header: dict[str, Any]) -> None:
    try:
        RingAnswer.decode(header, b"")
    except FrameError as exc:
        assert exc.status == Status.INVALID_ARGUMENT
