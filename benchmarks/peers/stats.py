"""The plan of a run and the arithmetic on its timings: pure functions, no I/O.

A *cell* is one (block size, mode) pair measured on one system in one round;
mode "single" puts and gets one block per call, "batched" ``BATCH`` blocks per
call. Each cell moves ``volume // size`` blocks each way. Throughput of a cell
is bytes moved / the summed seconds of its calls (untimed work between calls
does not count); a system's figure is the median over rounds. Latency is per
call (one block, or one batch), p50 and p99 over every call of every round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 512 * KiB, 2 * MiB, 8 * MiB)
MODES = ("single", "batched")
OPS = ("put", "get")
BATCH = 32


def size_label(size: int) -> str:
    """``65536`` -> ``"64 KiB"``, ``2097152`` -> ``"2 MiB"``."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if size % MiB == 0:
        return f"{size // MiB} MiB"
    return f"{size // KiB} KiB" if size % KiB == 0 else f"{size} B"


def batch_for(mode: str) -> int:
    """Blocks per call in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return 1 if mode == "single" else BATCH


def rotated(items: Sequence[str], r: int) -> list[str]:
    """``items`` started at position ``r`` (mod len): no system always goes first in a round."""
    if not items:
        return []
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(rounds: Sequence[Sequence[float]], bytes_per_round: int) -> dict[str, float]:
    """Per-round call timings of one (system, size, mode, op) -> GB/s (median of rounds), p50/p99 in us."""
    if not rounds or any(not r for r in rounds):
        raise ValueError("summarize needs at least one round, each with at least one call")
    if bytes_per_round <= 0:
        raise ValueError(f"bytes_per_round must be positive, got {bytes_per_round}")
    calls = [t for r in rounds for t in r]
    return {"gbps": statistics.median(bytes_per_round / sum(r) / 1e9 for r in rounds),
            "p50_us": percentile(calls, 50) * 1e6, "p99_us": percentile(calls, 99) * 1e6,
            "round_p50_us": [percentile(r, 50) * 1e6 for r in rounds],
            "rounds": len(rounds), "calls": len(calls)}


def latency_goal(mine: dict[str, Any], other: dict[str, Any], bound: float) -> tuple[float, int, int]:
    """A goal that ``mine``'s p50 be at most ``bound`` times ``other``'s (two ``summarize``
    results of one cell): (the ratio of their p50s over all calls, the rounds in which the
    ratio of that round's p50s met it, the rounds compared)."""
    pairs = list(zip(mine["round_p50_us"], other["round_p50_us"], strict=False))
    met = sum(1 for a, b in pairs if a <= bound * b)
    return mine["p50_us"] / other["p50_us"], met, len(pairs)


def ratio(mine: float | None, other: float | None) -> float | None:
    """``mine / other``, or None when either side has no figure."""
    if mine is None or other is None or other <= 0:
        return None
    return mine / other
