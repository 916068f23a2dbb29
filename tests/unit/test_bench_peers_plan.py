"""benchmarks/peers: the plan and arithmetic (stats.py) and the worker's cell loop (worker.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks.peers import stats, worker
from benchmarks.peers.clients.memmove_client import MemmoveClient

MiB = 1 << 20


def test_size_labels_name_the_four_block_sizes() -> None:
    assert [stats.size_label(s) for s in stats.SIZES] == ["64 KiB", "512 KiB", "2 MiB", "8 MiB"]
    assert stats.size_label(1000) == "1000 B"
    with pytest.raises(ValueError, match="-1"):
        stats.size_label(-1)


def test_batch_for_maps_modes_and_names_a_bad_one() -> None:
    assert stats.batch_for("single") == 1
    assert stats.batch_for("batched") == stats.BATCH
    with pytest.raises(ValueError, match="'bulk'"):
        stats.batch_for("bulk")


def test_rotated_starts_each_round_with_the_next_system() -> None:
    names = ["a", "b", "c"]
    assert [stats.rotated(names, r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert sorted(stats.rotated(names, 2)) == names
    assert stats.rotated([], 3) == []


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert stats.percentile(values, 0) == 1.0
    assert stats.percentile(values, 50) == 2.5
    assert stats.percentile(values, 100) == 4.0
    with pytest.raises(ValueError, match="no values"):
        stats.percentile([], 50)
    with pytest.raises(ValueError, match="101"):
        stats.percentile(values, 101)


def test_summarize_takes_the_median_round_and_per_call_percentiles() -> None:
    rounds = [[0.001, 0.001], [0.002, 0.002], [0.004, 0.004]]  # 2 calls a round
    s = stats.summarize(rounds, 8_000_000)
    assert s["gbps"] == pytest.approx(8_000_000 / 0.004 / 1e9)  # the middle round
    assert s["p50_us"] == pytest.approx(2000)
    assert s["calls"] == 6 and s["rounds"] == 3
    with pytest.raises(ValueError, match="at least one round"):
        stats.summarize([[0.1], []], 10)


def test_a_latency_goal_compares_the_p50s_over_all_calls_and_round_by_round() -> None:
    mine = stats.summarize([[0.0001, 0.0003], [0.0002, 0.0002], [0.0009, 0.0009]], 1000)
    other = stats.summarize([[0.0001, 0.0001], [0.0002, 0.0002], [0.0002, 0.0002]], 1000)
    assert mine["round_p50_us"] == pytest.approx([200, 200, 900])
    r, met, rounds = stats.latency_goal(mine, other, 1.5)
    assert r == pytest.approx(250 / 200)  # p50s of all six calls
    assert (met, rounds) == (1, 3)  # round by round: 2x, 1x, 4.5x
    assert stats.latency_goal(mine, other, 5.0)[1:] == (3, 3)


def test_ratio_is_none_without_both_figures() -> None:
    assert stats.ratio(3.0, 1.5) == 2.0
    assert stats.ratio(None, 1.0) is None
    assert stats.ratio(1.0, None) is None
    assert stats.ratio(1.0, 0.0) is None


def test_calls_cover_every_block_once_in_batches() -> None:
    assert worker.calls(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert worker.calls(3, 1) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="batch=0"):
        worker.calls(3, 0)


@pytest.mark.parametrize("batch", [1, 3])
def test_run_cell_times_every_call_and_checks_the_bytes(batch: int) -> None:
    client = MemmoveClient(4 * MiB)
    out = worker.run_cell(client, MiB, batch, 4 * MiB, tag=7, state={})
    calls = -(-4 // batch)
    assert len(out["put"]) == calls and len(out["get"]) == calls
    assert all(t > 0 for t in out["put"] + out["get"])
    dst = client.buffer[4 * MiB : 8 * MiB].reshape(4, MiB)
    assert dst[2, :8].view(np.uint64)[0] == 2  # block index stamp
    assert dst[2, 8:16].view(np.uint64)[0] == 7  # the cell's tag


class _StaleGet(MemmoveClient):
    """Answers every get with what it held before this cell: the check must catch it."""

    def get(self, keys: list[int], first: int) -> None:
        pass


class _FlippedByte(MemmoveClient):
    def get(self, keys: list[int], first: int) -> None:
        super().get(keys, first)
        self.buffer[self.buffer.size // 2 + first * self.size + 100] ^= 0xFF


@pytest.mark.parametrize("bad", [_StaleGet, _FlippedByte])
def test_run_cell_fails_when_a_get_returns_wrong_bytes(bad: type[MemmoveClient]) -> None:
    with pytest.raises(RuntimeError, match="came back different"):
        worker.run_cell(bad(2 * MiB), MiB, 1, 2 * MiB, tag=3, state={})


def test_run_cell_refuses_a_size_larger_than_the_volume() -> None:
    with pytest.raises(ValueError, match="size 4194304"):
        worker.run_cell(MemmoveClient(2 * MiB), 4 * MiB, 1, 2 * MiB, tag=1, state={})


def test_serve_answers_each_cell_line_and_reports_errors_as_replies() -> None:
    cells = [{"cmd": "cell", "size": MiB, "batch": 2, "volume": 2 * MiB, "tag": 5},
             {"cmd": "cell", "size": 8 * MiB, "batch": 1, "volume": 2 * MiB, "tag": 6},
             {"cmd": "quit"}]
    out = io.StringIO()
    worker.serve(MemmoveClient(2 * MiB), io.StringIO("".join(json.dumps(c) + "\n" for c in cells)), out)
    ready, ok, err = (json.loads(line) for line in out.getvalue().splitlines())
    assert ready == {"ready": True}
    assert len(ok["put"]) == 1 and len(ok["get"]) == 1
    assert "ValueError" in err["error"] and "8388608" in err["error"]


def test_background_charges_a_systems_cpu_only_while_another_is_measured() -> None:
    from benchmarks.peers.__main__ import Background

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        bg = Background()
        bg.owned = {"spinner": {spin.pid}, "idle": set()}
        time.sleep(0.2)  # the interpreter is up and spinning
        with bg.around("idle"):  # the spinner is charged
            time.sleep(0.5)
        with bg.around("spinner"):  # its own cell: not charged
            time.sleep(0.3)
        cores = bg.cores()
        # charged (its share of a core depends on what else runs: 0.24 beside four test workers)
        assert 0.05 < cores["spinner"] <= 1.05, cores
        assert cores.get("idle", 0.0) == 0.0
        assert bg.wall["spinner"] == pytest.approx(0.5, abs=0.2)
    finally:
        spin.kill()
        spin.wait()
