"""Daemon logging: text (the default) or one JSON object per line, on stderr.

``setup(level, fmt)`` installs the handler once. JSON lines carry ``ts``
(ISO 8601, UTC), ``level``, ``logger``, ``msg`` and, for an exception,
``exc``; they suit journald, Loki or Elasticsearch without a parser.
The daemon logs start-up, state changes (joined, suspended, lost, peer
down and up again, eviction under pressure) once each, never per request.
"""

from __future__ import annotations

import json
import logging
import sys
import time

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(level: str, fmt: str = "text") -> None:
    """Log at ``level`` to stderr in ``fmt`` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class Once:
    """Rate limit for a repeating condition: ``due()`` is True at most once per ``every`` seconds."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every
        return True
