"""LMCache's own storage server for ``LMCacheConnectorV1`` engines: ``lmcache_server`` on loopback.

(Not named ``lmcache.py``: engine.py runs as a script, so this directory comes first on its
``sys.path`` and such a file would hide the ``lmcache`` package from the connector.)

``LMCacheServer(venv)`` starts ``lmcache_server 127.0.0.1 PORT`` (LMCache's
``lmcache.v1.server``: blocks kept in its process's memory, no size limit) on a
free port. ``env(i)`` gives an engine the variables that make its connector
store to it and look up in it besides its own local CPU backend
(``LMCACHE_REMOTE_URL=lm://127.0.0.1:PORT``, ``LMCACHE_REMOTE_SERDE=naive``),
so that a block engine A stored is found by engine B after A has exited.
``stop()`` kills the server and removes its temp dir (idempotent).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.engines.servers import HOST, free_port, start_listening, stop


class LMCacheServer:
    """One ``lmcache_server`` process (see the module). ``FileNotFoundError`` when ``venv`` has no
    ``bin/lmcache_server``, ``RuntimeError`` when it does not listen within ``timeout`` s."""

    def __init__(self, venv: Path, timeout: float = 60.0) -> None:
        binary = venv / "bin" / "lmcache_server"
        if not binary.exists():
            raise FileNotFoundError(f"no {binary} (scripts/setup-lmcache-vllm.sh)")
        self.work = Path(tempfile.mkdtemp(prefix="lmcache-engines-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        port = free_port()
        self.url = f"lm://{HOST}:{port}"
        try:
            self.procs.append(start_listening("lmcache_server", [str(binary), HOST, str(port)],
                                              self.work / "server.log", f"{HOST}:{port}", timeout))
        except BaseException:
            self.stop()
            raise

    def env(self, i: int) -> dict[str, str]:
        """Environment for engine ``i``: every engine shares the one server."""
        return {"LMCACHE_REMOTE_URL": self.url, "LMCACHE_REMOTE_SERDE": "naive"}

    def stop(self) -> None:
        stop(self.procs)
        shutil.rmtree(self.work, ignore_errors=True)
