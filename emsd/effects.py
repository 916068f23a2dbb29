"""Work with other nodes or the disk tier that a request needs, described as data (issue 21).

``Service`` (``emsd/service.py``) decides from a request and this pool's state
alone and never awaits. Where its decision needs other nodes or the disk tier
it returns one of these values instead of doing the work; ``emsd.remote``
carries each out on the event loop, and ``emsd.coordinator`` puts them in
order around the handler:

- before a PIN whose keys are not all here (``Service.before``): ``Promote``
  (from the disk tier, then in a cluster from the owners) or ``Fetch`` (from
  the owners). Its result is the set of copies it fetched that the PIN's
  session may keep only while it pins them (``wr`` false), which the
  coordinator hands to ``Service.after_fetch``;
- after a handler, before the answer (``Service.serve_sync``, the third value):
  ``Forward``, ``RefreshOwners``, ``AskOwners``, ``DropElsewhere``, ``Drain``,
  ``SetPlacement``, run in the order given. Each one's result is a dict of
  fields that the coordinator merges into the handler's answer.

The contract of every effect:

- it is immutable and complete: whatever its work needs from the request
  travels in it (no session field or service attribute is set aside for it);
  the work reads the pool as it is when it runs;
- times are budgets: ``budget`` is the seconds the work may take, counted
  from when the coordinator has the effect (the service has no clock; the
  coordinator reads the loop's, which a simulation makes virtual);
- the work never fails the request: peers failing, slow or gone mean misses,
  fewer ``reached`` or counts in the answer, never an error status (but a
  placement record that was not written is reported as ``IO_ERROR``).

A standalone node without a disk tier never makes one, so none of this is on
its path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from emsd.pool.keys import KeyBatch


@dataclass(frozen=True, slots=True, eq=False)
class Promote:
    """Before a PIN: read the disk-only blocks of the run after the ``count`` leading keys
    found in DRAM (up to the PIN's ``bring`` keys after them) into the pool; then, with
    ``fetch`` (a cluster, not ``read_local_only``), fetch what is still missing from the
    owners as ``Fetch`` does (``keep`` as there). ``elsewhere`` (with ``fetch``): per key,
    owned by other nodes; the run goes on through those keys (``TierStack.promote``)."""

    ns: int
    keys: KeyBatch  # the PIN's keys up to ``upto``
    count: int
    budget: float
    fetch: bool
    keep: bool
    elsewhere: np.ndarray | None = None  # bool per key

    @property
    def upto(self) -> int:
        """The index of the PIN's first key this work does not bring here."""
        return len(self.keys)


@dataclass(frozen=True, slots=True, eq=False)
class Fetch:
    """Before a PIN: fetch ``keys`` (the PIN's keys from the first one missing here, at most
    its ``bring``) from their owners. The copies stay as read cache; with ``keep`` false
    (``wr``: write_rcache off) only while the PIN's session holds them pinned."""

    ns: int
    keys: KeyBatch
    budget: float
    keep: bool
    upto: int  # the index of the PIN's first key after ``keys`` (not brought here)


@dataclass(frozen=True, slots=True, eq=False)
class Forward:
    """After a COMMIT or PUT in a cluster: send the committed entries ``handles`` to their
    owners. Answers ``reached``: one byte per handle, 1 when the block is now held by an owner
    (or is owned here); the handler answers all zeros in case the work fails outright. With
    ``keep`` false the local copies of blocks another owner now holds are dropped; else they
    stay as read-cache copies."""

    handles: np.ndarray  # uint32, in the order of the answer's bytes
    keep: bool
    budget: float


@dataclass(frozen=True, slots=True, eq=False)
class RefreshOwners:
    """After a RESERVE or PUT that found ``keys`` of namespace ``ns`` here only as read-cache
    copies: ask their owners whether they still hold them (no bytes move) and push the copies
    from the first one they lack. Best effort; the answer does not change."""

    ns: int
    keys: KeyBatch
    budget: float


@dataclass(frozen=True, slots=True, eq=False)
class AskOwners:
    """After an EXISTS that did not find every key here: ask the owners of the rest. Answers
    ``count``: the leading keys held here (``here``: per key) or by their owners."""

    name: str  # the namespace's name (owners place by name)
    keys: KeyBatch
    here: np.ndarray  # bool per key
    budget: float


@dataclass(frozen=True, slots=True)
class DropElsewhere:
    """After a DROP done here: the other members of the view drop namespace ``name`` too.
    Answers ``missed``: the members that did not confirm it in time."""

    name: str
    budget: float


@dataclass(frozen=True, slots=True)
class Drain:
    """After a DRAIN: leave the ring, then push the blocks owned here (oldest namespaces first)
    to their new owners until the budget is spent. Answers ``moved``, ``failed``, ``remaining``."""

    budget: float


@dataclass(frozen=True, slots=True)
class SetPlacement:
    """After a PLACEMENT (checked): rewrite the cluster's placement record. Answers the new
    record's ``vnodes``, ``replicas`` and ``version`` (``IO_ERROR`` when it was not written).
    The write keeps its own limit (``emsd.cluster.PLACEMENT_WRITE_TIMEOUT``), not ``budget``."""

    vnodes: int
    replicas: int
    budget: float


Before = Promote | Fetch
After = Forward | RefreshOwners | AskOwners | DropElsewhere | Drain | SetPlacement
Effects = tuple[After, ...]
NONE: Effects = ()
