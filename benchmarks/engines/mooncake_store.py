"""Mooncake Store for vLLM's ``MooncakeStoreConnector`` on CPU engines: master, store, config.

(Not named ``mooncake.py``: engine.py runs as a script, so this directory comes first on its
``sys.path`` and such a file would hide the ``mooncake`` package from the connector.)

``MooncakeStore(segment)`` starts, on free loopback ports, what the connector
needs so that a KV block saved by one engine process can be loaded by a later
one after the first has exited:

- ``mooncake_master`` (RPC and metrics on 127.0.0.1; no HTTP metadata server:
  every transfer engine uses the P2P handshake, ``P2PHANDSHAKE``);
- ``clients`` Mooncake "real clients" (``mooncake_client``), each holding a
  global segment of ``segment`` bytes: the store's memory. The engines run the
  connector in its ``standalone-store`` mode (they contribute no segment of
  their own), so what they put lives in these processes and outlives them.
  In the connector's default ``embedded`` mode an engine's puts go to its own
  segment and vanish with it: engine B could find nothing engine A saved.

``env(i)`` gives engine ``i`` the variables the connector reads:
``MOONCAKE_CONFIG_PATH`` (a JSON file in this object's own temp dir: master
address, ``P2PHANDSHAKE``, protocol ``tcp``, ``mode: standalone-store``,
``global_segment_size`` 0, ``local_buffer_size``),
``MOONCAKE_REQUESTER_LOCAL_HOSTNAME=127.0.0.1`` (else vLLM names the engine by
the address of its default route) and, with several clients,
``MOONCAKE_PREFERRED_SEGMENT`` (engine i's puts go to client ``i % clients``;
gets find a key in whichever segment holds it, through the master).

``stop()`` kills every process this object started (by pid) and removes its
temp dir; it is idempotent, and a failed start stops what it had started.

Caveat: Mooncake's transfer engine listens on all addresses whatever host it
is told (benchmarks/peers runs it in a private network namespace for that
reason); the master and the clients here bind their own RPC ports to
127.0.0.1, but each transfer engine (clients' and engines') also opens a
port on every address.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.engines.servers import HOST, free_port, start_listening, stop, tail

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-mcvllm"  # scripts/setup-mooncake-vllm.sh


class MooncakeStore:
    """A mooncake_master and ``clients`` mooncake_client processes holding ``segment`` bytes each.

    ``venv`` is where the binaries of mooncake-transfer-engine-non-cuda are
    (``bin/mooncake_master``, ``bin/mooncake_client``). ``local_buffer`` is
    each engine's Mooncake local buffer (bytes, > 0; the connector moves KV
    straight from the engine's registered KV cache, so it can stay small).
    ``lease`` is the master's ``--default_kv_lease_ttl`` (a key read less than
    a lease ago cannot be evicted). Raises ``FileNotFoundError`` when the
    binaries are missing and ``RuntimeError`` (with the log's tail) when a
    process exits or does not listen within ``timeout`` seconds.
    """

    def __init__(self, segment: int, clients: int = 1, venv: Path = VENV, local_buffer: int = 64 << 20,
                 lease: str = "2s", timeout: float = 60.0) -> None:
        if segment < 1 << 20 or clients < 1 or local_buffer <= 0:
            raise ValueError(f"segment {segment} (>= 1 MiB), clients {clients} (>= 1), "
                             f"local_buffer {local_buffer} (> 0)")
        master_bin, client_bin = venv / "bin" / "mooncake_master", venv / "bin" / "mooncake_client"
        for binary in (master_bin, client_bin):
            if not binary.exists():
                raise FileNotFoundError(f"no {binary} (scripts/setup-mooncake-vllm.sh)")
        self.work = Path(tempfile.mkdtemp(prefix="mooncake-engines-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.timeout = timeout
        try:
            port = free_port()
            self.master = f"{HOST}:{port}"
            self._start("master", [str(master_bin), "--enable_http_metadata_server=false",
                                   f"--rpc_address={HOST}", f"--rpc_port={port}",
                                   f"--metrics_host={HOST}", f"--metrics_port={free_port()}",
                                   f"--default_kv_lease_ttl={lease}"], self.master)
            # Segment names: a client's transfer engine is named HOST:port (P2P handshake)
            self.segments: list[str] = []
            for c in range(clients):
                port = free_port()
                self._start(f"client{c}", [str(client_bin), "--metadata_server=P2PHANDSHAKE",
                                           "--protocol=tcp", f"--host={HOST}", f"--port={port}",
                                           f"--master_server_address={self.master}",
                                           f"--global_segment_size={segment >> 20}MB"], f"{HOST}:{port}")
                self.segments.append(self._segment_name(c))
            self.config = self.work / "mooncake.json"
            self.config.write_text(json.dumps({
                "metadata_server": "P2PHANDSHAKE", "master_server_address": self.master, "protocol": "tcp",
                "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
                "local_buffer_size": local_buffer}))
        except BaseException:
            self.stop()
            raise

    def env(self, i: int) -> dict[str, str]:
        """Environment for engine ``i`` (0, 1, ...): the connector's config file and hostname, and
        with several clients the segment its puts go to (client ``i % clients``)."""
        env = {"MOONCAKE_CONFIG_PATH": str(self.config), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": HOST}
        if len(self.segments) > 1:
            env["MOONCAKE_PREFERRED_SEGMENT"] = self.segments[i % len(self.segments)]
        return env

    def stop(self) -> None:
        """Kill every process started here (by pid, clients before the master), remove the temp dir."""
        stop(self.procs)
        shutil.rmtree(self.work, ignore_errors=True)

    def log(self, name: str) -> Path:
        """The log file of process ``name`` (``master``, ``client0``, ...)."""
        return self.work / f"{name}.log"

    def _start(self, name: str, argv: list[str], address: str) -> None:
        """Start ``argv`` logging to ``log(name)``; return once ``address`` accepts connections."""
        self.procs.append(start_listening(f"mooncake {name}", argv, self.log(name), address, self.timeout))

    def _segment_name(self, c: int) -> str:
        """The segment client ``c`` mounted, named by its transfer engine's ``HOST:port`` (a port it
        picks itself in the P2P handshake mode), as its log gives it once it serves."""
        text = self.log(f"client{c}").read_text(errors="replace")
        found = re.search(r"Successfully created client on port (\d+)", text)
        if found is None:
            log = self.log(f"client{c}")
            raise RuntimeError(f"mooncake client{c}: no segment port in its log: {tail(log)}")
        return f"{HOST}:{found.group(1)}"
