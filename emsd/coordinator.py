"""One client request from its decoded frame to its answer: the handler and the work around it.

``Service`` answers every request synchronously from this node's own pool
and never awaits. Some requests need work with other nodes (or the disk
tier) around that answer; the service returns it as data (``emsd.effects``),
``emsd.remote`` carries it out, and ``Coordinator.serve`` puts it in the one
order every transport and the simulation share:

1. before the handler: a PIN whose keys are not all here first has the
   missing ones promoted from the disk tier and fetched from their owners
   (``Service.before`` names a ``Promote`` or ``Fetch``); the handler then
   pins what is local by then (``Service.after_fetch``, given the copies the
   fetch made that the session may keep only while pinned). A client whose
   connection closed meanwhile gets no PIN (it would leak);
2. the handler (``Service.serve_sync``: the answer and the effects after it);
3. after the handler, before the answer: a COMMIT or PUT forwards its
   blocks to their owners, a save of read-cache copies checks them with
   their owners, an EXISTS asks the owners of the keys not found here, a
   DROP, a DRAIN and a placement change reach the other members; each
   effect runs in turn and its result fields complete the answer.

Budgets become deadlines here, on the loop's clock, when ``serve`` gets the
effect (the service has none). A request with no effect around its handler
(every request of a standalone node without a disk tier, and most in a
cluster) is answered at once, without a task or an await: ``serve`` returns
the answer itself, not an awaitable. The Unix-socket transport
(``emsd.transport.unix``) and the deterministic simulation
(tests/sim/client.py) both call ``serve``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from emsd.effects import Before, Effects
from emsd.remote import AFTER, Remote, now
from emsd.service import Response, Service, Session

log = logging.getLogger("emsd.service")


class Coordinator:
    """Serves decoded requests of any session on one ``Service`` (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.remote = Remote(service)

    def serve(self, session: Session, header: dict[str, Any],
              payload: bytes) -> Response | Awaitable[Response]:
        """The answer to one request, or an awaitable of it when work with other nodes comes
        first or after (the awaitable never raises for that work: peers failing mean misses)."""
        service = self.service
        first = service.before(session, header, payload)
        if first is not None:
            return self._fetch_first(first, now() + first.budget, session, header, payload)
        resp, parts, effects = service.serve_sync(session, header, payload)
        if effects:
            return self._complete(effects, now(), resp, parts)
        return resp, parts

    async def _fetch_first(self, first: Before, deadline: float, session: Session,
                           header: dict[str, Any], payload: bytes) -> Response:
        """Run a PIN's ``before`` work, then handle the PIN (and any work after it)."""
        fetched: frozenset[int] = frozenset()
        refused = self.service.refusals()  # another load's work may raise it too: then one PIN more
        try:
            fetched = await self.remote.before(first, deadline)
        except Exception:  # peers failing means misses, never a failed PIN
            log.exception("remote fetch failed")
        if session.closed:  # the client is gone: pinning now would leak the pins
            self.service.drop_fetched(session, fetched)
            return {}, []
        resp, parts, effects = self.service.after_fetch(session, header, payload, fetched,
                                                        self.service.refusals() != refused, first.upto)
        if effects:
            return await self._complete(effects, now(), resp, parts)
        return resp, parts

    async def _complete(self, effects: Effects, start: float, resp: dict[str, Any],
                        parts: list[bytes]) -> Response:
        """Run the work after a handler, in order; each effect's fields go into the answer."""
        for effect in effects:
            try:
                resp.update(await AFTER[type(effect)](self.remote, effect, start + effect.budget))
            except Exception:  # the handler's work is done; only the work with other nodes failed
                log.exception("work with other nodes after a request failed")
        return resp, parts
