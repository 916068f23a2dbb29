"""One client request from its decoded frame to its answer: the handler and the work around it.

``Service.handle`` answers every request synchronously from this node's own
pool. Some requests need work with other nodes (or the disk tier) around
that answer; the service names it, and ``Coordinator.serve`` carries it out
in the one order every transport and the simulation share:

1. before the handler: a PIN whose keys are not all here first has the
   missing ones promoted from the disk tier and fetched from their owners
   (``Service.remote_fetch``); the handler then pins what is local by then.
   A client whose connection closed meanwhile gets no PIN (it would leak);
2. the handler (``Service.handle``);
3. after the handler, before the answer: a COMMIT or PUT forwards its
   blocks to their owners, an EXISTS asks the owners of the keys not found
   here, a DROP, a DRAIN and a placement change reach the other members
   (``Service.follow_up``); their results complete the answer.

A request with nothing to do around its handler (every request of a
standalone node without a disk tier, and most in a cluster) is answered at
once, without a task or an await: ``serve`` returns the answer itself, not
an awaitable. The Unix-socket transport (``emsd.transport.unix``) and the
deterministic simulation (tests/sim/client.py) both call ``serve``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from emsd.service import Response, Service, Session

log = logging.getLogger("emsd.service")


class Coordinator:
    """Serves decoded requests of any session on one ``Service`` (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def serve(self, session: Session, header: dict[str, Any],
              payload: bytes) -> Response | Awaitable[Response]:
        """The answer to one request, or an awaitable of it when work with other nodes comes
        first or after (the awaitable never raises for that work: peers failing mean misses)."""
        service = self.service
        fetch = service.remote_fetch(session, header, payload)
        if fetch is not None:
            return self._after_fetch(fetch, session, header, payload)
        resp, parts = service.handle(session, header, payload)
        push = service.follow_up(session, header, payload, resp)
        if push is not None:
            return self._after_handler(push, resp, parts)
        return resp, parts

    async def _after_fetch(self, fetch: Awaitable[None], session: Session, header: dict[str, Any],
                           payload: bytes) -> Response:
        try:
            await fetch
        except Exception:  # peers failing means misses, never a failed PIN
            log.exception("remote fetch failed")
        if session.closed:  # the client is gone: pinning now would leak the pins
            return {}, []
        return self.service.handle(session, header, payload)

    @staticmethod
    async def _after_handler(push: Awaitable[dict[str, Any]], resp: dict[str, Any],
                             parts: list[bytes]) -> Response:
        try:
            resp = await push
        except Exception:  # the handler's work is done; only the work with other nodes failed
            log.exception("work with other nodes after a request failed")
        return resp, parts
