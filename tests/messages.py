"""Local requests built as ``emsd.protocol.local`` messages for tests that hand them to a
``Service`` (or its coordinator) in this process or send them to a daemon on a
``DaemonClient``, as the SDK builds them.

A test reads an answer with the matching ``decode``; one about a bad field puts the bad
value over the message's own (``handled(..., field=bad)``, ``{**header, "field": bad}``).
"""

from __future__ import annotations

from typing import Any, Protocol

from ems.client import DaemonClient
from emsd.protocol.local import Encoded, NamespaceAnswer, NamespaceRequest
from emsd.service import Service, Session
from emsd.transport.frames import Op, Status


class Message(Protocol):
    def encode(self) -> Encoded: ...


def request(op: Op, message: Message, rid: int = 1) -> tuple[dict[str, Any], bytes]:
    """``message`` as a request of ``op``: its header (``op``, ``id`` and the message's fields)
    and its payload."""
    fields, parts = message.encode()
    return {"op": int(op), "id": rid, **fields}, b"".join(parts)


def handled(svc: Service, session: Session, op: Op, message: Message,
            **over: Any) -> tuple[dict[str, Any], bytes]:
    """``message`` answered by ``svc.handle`` on ``session``, with the header fields ``over`` put
    over the message's own: the answer's header and payload."""
    header, payload = request(op, message)
    resp, parts = svc.handle(session, {**header, **over}, payload)
    return resp, b"".join(parts)


def opened(svc: Service, name: str = "n") -> tuple[Session, int]:
    """A new authenticated session of ``svc`` with namespace ``name`` open, and its id."""
    s = Session()
    s.authenticated = True
    resp, payload = handled(svc, s, Op.NAMESPACE, NamespaceRequest(name))
    assert resp["st"] == Status.OK, resp
    return s, NamespaceAnswer.decode(resp, payload).ns


def called(client: DaemonClient, op: Op, message: Message,
           timeout: float = 5) -> tuple[dict[str, Any], bytes]:
    """``message`` sent on ``client`` as a request of ``op`` and answered (an error answer raises
    ``EmsException``): the answer's header and payload."""
    return client.call(op, *message.encode(), timeout=timeout)


def namespace_id(client: DaemonClient, name: str) -> int:
    """The id of namespace ``name``, opened on ``client``."""
    return NamespaceAnswer.decode(*called(client, Op.NAMESPACE, NamespaceRequest(name))).ns
