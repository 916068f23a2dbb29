"""A fault seam: named sites where tests inject drops, delays and errors (inert in production).

The daemon reads ``EMSD_FAULTS`` once at start; unset (production), every
site is a single attribute test that finds nothing. Set, it is a list of
``site=action:probability[:seconds]`` separated by commas, and optionally
``seed=N``::

    EMSD_FAULTS="peer.get=error:0.2,peer.serve=delay:0.1:0.3,pool.reserve=error:0.05,seed=7"

Sites: ``peer.get`` and ``peer.put`` (this daemon asking a peer),
``peer.serve`` (this daemon answering a peer), ``pool.reserve`` (a save's
reservation), ``zk.session`` (the ZooKeeper session, consulted about once a
second by the membership worker while connected), ``disk.read`` (a block
read from the disk tier, in its reader thread), ``disk.flush`` (the disk
tier's index written to the file system, in its flusher thread: at
``delay`` a slow ``fdatasync``), ``pool.prefault`` (a chunk of
the background prefault: ``delay`` only). Actions: ``error`` (the
operation fails as if the peer or the pool had; at ``zk.session`` the
session is expired by ZooKeeper itself), ``drop`` (the connection is cut; at
``zk.session`` the client reconnects with the same session), ``delay`` (it
waits ``seconds`` first; at ``zk.session`` the membership worker stalls; at ``disk.read`` the read
takes that much longer).
Stopping the ZooKeeper server is tested for real too. Decisions come
from one ``random.Random(seed)``, so a run is repeatable given the same
sequence of calls.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from dataclasses import dataclass

log = logging.getLogger("emsd.faults")

SITES = ("peer.get", "peer.put", "peer.serve", "pool.reserve", "zk.session", "disk.read", "disk.flush",
         "pool.prefault")
ACTIONS = ("error", "drop", "delay")


@dataclass(frozen=True)
class Rule:
    action: str
    probability: float
    seconds: float = 0.0


class Faults:
    def __init__(self, rules: dict[str, Rule], seed: int) -> None:
        self.rules = rules
        self.rng = random.Random(seed)
        self.fired: dict[str, int] = {}

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """Rules from ``spec`` (see the module docstring); raises ValueError naming the bad part."""
        rules: dict[str, Rule] = {}
        seed = 0
        for part in filter(None, (p.strip() for p in spec.split(","))):
            site, _, what = part.partition("=")
            if site == "seed":
                seed = int(what)
                continue
            fields = what.split(":")
            if site not in SITES or fields[0] not in ACTIONS or len(fields) not in (2, 3):
                raise ValueError(f"EMSD_FAULTS: bad rule {part!r} (sites {SITES}, actions {ACTIONS})")
            p = float(fields[1])
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"EMSD_FAULTS: probability out of 0..1 in {part!r}")
            rules[site] = Rule(fields[0], p, float(fields[2]) if len(fields) == 3 else 0.0)
        return cls(rules, seed)

    def at(self, site: str) -> Rule | None:
        """The fault to inject at ``site`` this time, or None."""
        rule = self.rules.get(site)
        if rule is None or self.rng.random() >= rule.probability:
            return None
        self.fired[site] = self.fired.get(site, 0) + 1
        return rule


def io_fault(site: str) -> None:
    """An I/O fault site (``disk.read``, ``disk.flush``), in the thread doing the I/O: with a
    rule firing, ``delay`` sleeps its seconds (a slow device), any other action raises
    ``OSError(EIO)``. Nothing without ``EMSD_FAULTS``."""
    rule = FAULTS.at(site) if FAULTS is not None else None
    if rule is None:
        return
    if rule.action == "delay":
        time.sleep(rule.seconds)
    else:
        raise OSError(errno.EIO, f"injected fault at {site}")


def _from_env() -> Faults | None:
    spec = os.environ.get("EMSD_FAULTS", "")
    if not spec:
        return None
    faults = Faults.parse(spec)
    log.warning("fault injection ON (EMSD_FAULTS=%s): for tests only", spec)
    return faults


FAULTS: Faults | None = _from_env()
