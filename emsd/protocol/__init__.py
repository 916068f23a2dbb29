"""The messages daemons and clients exchange, as value types with their encoding and limits.

The frame codec (``emsd.transport.frames``) turns a header map and payload
bytes into frames and back; the modules here turn those into typed messages
and back, checking every field against its limits on the way in, so that a
transport never reads a header field or a payload offset by hand.

- ``emsd.protocol.local``: the ops between the SDK and its daemon (RESERVE,
  COMMIT, PIN, RELEASE, TOUCH, EXISTS, GRANT, PUT and the header-only NAMESPACE,
  DROP, OWNER, PLACEMENT) and their answers; their layouts are in its docstring.
- ``emsd.protocol.peer``: the data ops between daemons (GET, PUT, HAS, DROP)
  and their answers.
- ``emsd.protocol.rdma``: the RDMA control messages between daemons (QP, PIN,
  UNPIN, RESERVE, COMMIT) and their answers, sent on the peers' TCP connection.
- ``emsd.protocol.fields``: the header checks both share (bounded ints,
  namespace names).
"""
