"""emsd: a distributed KV-cache memory pool for LLM inference (the daemon).

Kept import-light: the SDK imports ``emsd.pool.keys`` and
``emsd.transport.frames`` and must not pull in the daemon.
"""

__version__ = "0.1.0"
