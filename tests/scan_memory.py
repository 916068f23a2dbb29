"""A tenant's client that scans its own address space for bytes it must not see.

``python tests/scan_memory.py SOCKET_DIR ACCESS_ID ACCESS_KEY`` connects to
the emsd at SOCKET_DIR as that tenant through the SDK, saves and loads
blocks of its own (so that its mapping of the pool is live and used) and
prints ``ready``. Then, for each line MARKER_HEX it reads on stdin, it reads
every readable mapping of its own process (``/proc/self/maps`` and
``/proc/self/mem``) and counts the places where MARKER occurs, printing one
JSON line: ``{"hits": {mapping name: count}, "mapped": bytes scanned}``. Its
connection stays open (and its mapping live) until stdin ends.

The marker's only copy this process makes is the needle itself, whose
address is left out of the count, so any hit is a copy of someone else's
bytes. Used by tests/integration/test_tenant_memory.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import torch

from ems import CcConfig, Ems, EmsConfig

CHUNK = 16 << 20


def scan(needle: bytes) -> tuple[dict[str, int], int]:
    """Hits of ``needle`` per mapping name in this process's readable memory, and bytes read."""
    own = ctypes.cast(ctypes.c_char_p(needle), ctypes.c_void_p).value  # the needle's own bytes
    hits: dict[str, int] = {}
    total = 0
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5] if len(fields) > 5 else "[anon]"
            if "r" not in fields[1] or name in ("[vvar]", "[vsyscall]", "[vvar_vclock]"):
                continue
            at = lo
            while at < hi:
                n = min(CHUNK + len(needle), hi - at)
                try:
                    data = os.pread(fd, n, at)
                except OSError:
                    break
                total += len(data)
                pos = data.find(needle)
                while pos >= 0:
                    if at + pos != own:
                        hits[name] = hits.get(name, 0) + 1
                    pos = data.find(needle, pos + 1)
                del data
                at += CHUNK
    finally:
        os.close(fd)
    return hits, total


def main(socket_dir: str, access_id: str, access_key: str) -> None:
    os.environ["EMS_SOCKET_DIR"] = socket_dir
    Ems.init(EmsConfig(access_id=access_id, access_key=access_key,
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    blocks, tokens = 16, 4
    kv = [[torch.full((blocks, tokens, 8, 32), 7.0) for _ in range(2)]]
    cc.register_kvcache(kv)
    slots, keys = list(range(blocks * tokens)), [9_000_000 + i for i in range(blocks)]  # not the tests' keys
    saved = cc.save(slots, hashes=keys, offsets=[tokens] * blocks).success
    loaded = cc.load(slots, hashes=keys, offsets=[tokens] * blocks).success
    print(json.dumps({"ready": True, "saved": saved, "loaded": loaded}), flush=True)
    for line in sys.stdin:
        hits, total = scan(bytes.fromhex(line.strip()))
        print(json.dumps({"hits": hits, "mapped": total}), flush=True)
    Ems._reset()


if __name__ == "__main__":
    main(*sys.argv[1:4])
