"""The namespace names log (ledger format 3): the latest name per id, torn tails cut off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.namelog import MAX_NAME, NameLog, header, parse, record

EPOCH = 0x1234_5678_9ABC_DEF1

names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
adds = st.lists(st.tuples(st.integers(0, 10_000), names), max_size=40)


def replay(ops: list[tuple[int, str]]) -> dict[int, str]:
    out: dict[int, str] = {}
    for ns, name in ops:
        out[ns] = name
    return out


@settings(max_examples=60, deadline=None)
@given(ops=adds, cut=st.integers(0, 1 << 16), more=adds)
def test_a_log_cut_anywhere_reads_as_a_prefix_of_its_records_and_appends_after_it(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[int, str]], cut: int,
        more: list[tuple[int, str]]) -> None:
    path = tmp_path_factory.mktemp("names") / "names"
    log, why = NameLog.open(path, EPOCH)
    assert why == "no namespace log" and log.names == {}
    for ns, name in ops:
        assert log.add(ns, name)
    log.close()
    raw = path.read_bytes()
    assert parse(raw, EPOCH)[0] == replay(ops)
    ends = [len(header(EPOCH))]
    for ns, name in ops:
        ends.append(ends[-1] + len(record(ns, name.encode())))
    cut = min(cut, len(raw))
    os.truncate(path, cut)  # a crash that left only ``cut`` bytes of the appends
    log, why = NameLog.open(path, EPOCH)
    kept = sum(1 for e in ends[1:] if e <= cut)
    if cut < ends[0]:  # not even the header: a new, empty log
        assert why is not None and log.names == {}
        kept = 0
    else:
        assert why is None and log.names == replay(ops[:kept])
    for ns, name in more:
        assert log.add(ns, name)
    log.close()
    again, why = NameLog.open(path, EPOCH)
    assert why is None and again.names == replay(ops[:kept] + more)
    again.close()


def test_a_log_of_another_epoch_or_a_corrupt_record_is_not_believed(tmp_path: Path) -> None:
    path = tmp_path / "names"
    log, _ = NameLog.open(path, EPOCH)
    log.add(1, "a")
    log.add(2, "b")
    log.close()
    other, why = NameLog.open(path, EPOCH + 2)
    assert why == "the namespace log belongs to another ledger" and other.names == {}
    other.add(3, "c")
    other.close()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last record's name changed: its CRC fails, it ends the log
    path.write_bytes(bytes(raw))
    log, why = NameLog.open(path, EPOCH + 2)
    assert why is None and log.names == {}
    log.close()
    path.write_bytes(b"not a log at all")
    log, why = NameLog.open(path, EPOCH)
    assert why == "not a namespace log" and log.names == {}
    log.close()


def test_a_log_of_many_renames_is_compacted_at_open(tmp_path: Path) -> None:
    path = tmp_path / "names"
    log, _ = NameLog.open(path, EPOCH)
    for i in range(2000):
        log.add(i % 20, f"name-{i}")
    assert not log.add(-1, "x") and not log.add(1 << 32, "x") and not log.add(0, "y" * (MAX_NAME + 1))
    log.close()
    before = path.stat().st_size
    log, why = NameLog.open(path, EPOCH)
    assert why is None and log.names == {i: f"name-{1980 + i}" for i in range(20)}
    log.close()
    assert path.stat().st_size < before / 50
    assert not path.with_name("names.new").exists()
