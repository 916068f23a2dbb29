"""Several clients of one node under steady eviction pressure never load a wrong byte.

Each client saves batches whose every byte encodes its key and loads random
earlier batches back (the chaos test's worker, without the chaos). The pool
holds a fraction of what is saved, so every save evicts. This caught a chunk
freed twice when an eviction outran the LRU queue (two blocks then shared it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chaos import WORKER  # noqa: E402

CLIENTS = 3
SECONDS = 10.0


def test_concurrent_clients_under_eviction_pressure_load_only_their_own_bytes(emsd_factory: Any) -> None:
    d = emsd_factory(pool={"size": "64MiB"})
    env = {**os.environ, "EMS_SOCKET_DIR": str(d.socket_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(SECONDS), "2000"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(CLIENTS)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=SECONDS + 60)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["wrong"] == 0 for r in results), results
    assert all(r["hits"] > 0 and r["hits"] < r["asked"] for r in results), results  # pressure, and hits
    assert d.alive()
