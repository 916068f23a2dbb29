"""Mutual TLS for the peer transport (optional: ``[cluster] tls_cert``, ``tls_key``, ``tls_ca``).

``PeerTls.load`` builds the two SSL contexts a daemon needs: one to accept
peers, one to dial them. Both sides present a certificate and require one
from the other, signed by the cluster's own CA (``tls_ca``); host names are
not checked (peers are dialled by address, and the CA issues certificates
for this cluster only). The cluster-secret challenge still runs inside the
TLS session, so a peer needs both a certificate from the CA and the secret.

This module only makes the contexts; ``emsd.transport.peer`` wraps each
connection's socket with them, and ``emsd.transport.stream.TlsStream`` does
its I/O: the handshake in the event loop (non-blocking steps within one
deadline, so a silent stranger holds a descriptor, never a thread), then
every read and write as blocking calls in the transport's worker threads,
with a socket timeout bounding a silent peer; the event loop only waits for
the raw socket to become readable before a frame is read, so an idle
connection holds no thread. Session tickets are off: nothing arrives on a
connection that is not an answer to what was sent.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

MIN_VERSION = ssl.TLSVersion.TLSv1_2


@dataclass(frozen=True)
class PeerTls:
    server: ssl.SSLContext  # accepts peers (requires their certificate)
    client: ssl.SSLContext  # dials peers (presents ours, verifies theirs)

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> PeerTls:
        """Contexts from PEM files; raises ``ValueError`` naming the file that cannot be used."""
        return cls(_context(ssl.Purpose.CLIENT_AUTH, cert, key, ca),
                   _context(ssl.Purpose.SERVER_AUTH, cert, key, ca))


def _context(purpose: ssl.Purpose, cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH
                         else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = MIN_VERSION
    ctx.check_hostname = False  # the CA is the cluster's own; see the module docstring
    ctx.verify_mode = ssl.CERT_REQUIRED
    if purpose is ssl.Purpose.CLIENT_AUTH:
        ctx.num_tickets = 0
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cluster.tls_cert/tls_key: cannot load {cert!r} with key {key!r}: {exc}") from None
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cluster.tls_ca: cannot load {ca!r}: {exc}") from None
    return ctx
