"""The disk tier's persistent index (emsd.tier.ledger): rows and names survive a reopen."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.tier.ledger import DiskLedger, LedgerBusy


def test_rows_and_names_survive_reopen(tmp_path: Path) -> None:
    led, outcome = DiskLedger.open(tmp_path / "i", 1 << 30, 1 << 26)
    assert outcome == "new"
    assert led.set_name(3, "tenant:a/model")
    led.record(5000, np.array([1, 2, 3, 4], dtype="<u8"), 255, 3, 8192, 4000, 77)
    led.record(1, np.array([9, 0, 0, 0], dtype="<u8"), 255, 3, 0, 4096, 78)
    led.forget(1)
    led.close()
    led, outcome = DiskLedger.open(tmp_path / "i", 1 << 30, 1 << 26)
    assert outcome == "attached"
    ids, rows = led.committed()
    assert ids.tolist() == [5000]
    assert rows[0]["words"].tolist() == [1, 2, 3, 4] and rows[0]["offset"] == 8192
    assert rows[0]["length"] == 4000 and rows[0]["sum"] == 77 and rows[0]["tag"] == 255
    assert led.names() == {3: "tenant:a/model"}
    led.close()


def test_another_geometry_or_garbage_is_rebuilt_empty(tmp_path: Path) -> None:
    led, _ = DiskLedger.open(tmp_path / "i", 1 << 30, 1 << 26)
    led.record(0, np.zeros(4, dtype="<u8"), 0, 0, 0, 1, 1)
    led.close()
    led, outcome = DiskLedger.open(tmp_path / "i", 2 << 30, 1 << 26)
    assert outcome.startswith("rebuilt") and led.committed()[0].size == 0
    led.close()
    (tmp_path / "i").write_bytes(b"x" * 5000)
    led, outcome = DiskLedger.open(tmp_path / "i", 2 << 30, 1 << 26)
    assert outcome.startswith("rebuilt")
    led.close()


def test_a_second_opener_is_refused(tmp_path: Path) -> None:
    led, _ = DiskLedger.open(tmp_path / "i", 1 << 30, 1 << 26)
    with pytest.raises(LedgerBusy):
        DiskLedger.open(tmp_path / "i", 1 << 30, 1 << 26)
    led.close()


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.integers(0, 3000), st.integers(1, 1 << 20), max_size=40))
def test_committed_rows_are_exactly_those_recorded(tmp_path_factory: pytest.TempPathFactory,
                                                   rows: dict[int, int]) -> None:
    path = tmp_path_factory.mktemp("led") / "i"
    led, _ = DiskLedger.open(path, 1 << 30, 1 << 26)
    for row, length in rows.items():
        led.record(row, np.array([row, 0, 0, 0], dtype="<u8"), 255, 0, row * 4096, length, row + 1)
    led.close()
    led, _ = DiskLedger.open(path, 1 << 30, 1 << 26)
    ids, got = led.committed()
    assert ids.tolist() == sorted(rows)
    assert got["length"].tolist() == [rows[r] for r in sorted(rows)]
    led.close()
