"""Read passes: what lets an SDK client read its tenant's blocks straight from their owner.

A cluster node gives each of its clients that asks (local op RING) a pass:
the client's tenant and an expiry, signed with the cluster secret. The
client shows it to another member of the cluster on a peer connection (peer
op READ, in place of the daemons' AUTH) and may then GET, and nothing else,
blocks of its own tenant's namespaces there (``emsd.transport.peer``). The
owner checks the signature and the expiry with the same secret; the secret
never leaves the daemons. A pass is a bearer token: whoever holds it reads
what its tenant may read, until it expires (``PASS_TTL``); on a cluster
without TLS anyone who can watch the peer network sees block bytes anyway.

Layout: ``msgpack([1, tenant, expires])`` (``expires`` in whole seconds of
the Unix clock) followed by a 32-byte HMAC-SHA256 of it under the secret,
tagged so that no other MAC of the cluster (the peer AUTH's) can pass for one.
"""

from __future__ import annotations

import hashlib
import hmac

import msgpack

from emsd.transport.frames import FrameError

PASS_VERSION = 1
PASS_TTL = 300  # seconds a pass is good for; the SDK asks for a new one before it runs out
MAX_PASS = 1024  # bytes of a pass on the wire (a tenant id is at most 512 characters)
_TAG = b"emsd-read-pass\0"
_MAC = 32


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, _TAG + body, hashlib.sha256).digest()


def issue(secret: bytes, tenant: str, expires: int) -> bytes:
    """A pass for ``tenant`` ("" the default tenant) good until ``expires`` (Unix seconds)."""
    body = msgpack.packb([PASS_VERSION, tenant, int(expires)], use_bin_type=True)
    return body + _mac(secret, body)


def check(secret: bytes, blob: object, now: float) -> tuple[str, int]:
    """The tenant and expiry of a genuine pass still good at ``now``; raises ``FrameError``
    (INVALID_ARGUMENT) for anything else: not bytes, too long, a wrong MAC, malformed, expired."""
    if not isinstance(blob, bytes) or not _MAC < len(blob) <= MAX_PASS:
        raise FrameError("a read pass must be bytes of the right length")
    body, mac = blob[:-_MAC], blob[-_MAC:]
    if not hmac.compare_digest(mac, _mac(secret, body)):
        raise FrameError("read pass refused: not signed by this cluster")
    try:
        version, tenant, expires = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise FrameError("read pass malformed") from None
    if version != PASS_VERSION or not isinstance(tenant, str) or type(expires) is not int:
        raise FrameError("read pass malformed")
    if expires <= now:
        raise FrameError("read pass expired")
    return tenant, expires
