"""The fault seam's rules: parsed strictly, decided by a seeded source."""

from __future__ import annotations

import pytest

from emsd.faults import Faults


def test_rules_parse_and_decisions_repeat_for_a_seed() -> None:
    spec = "peer.get=error:0.5,peer.serve=delay:0.25:0.01,seed=3"
    a, b = Faults.parse(spec), Faults.parse(spec)
    seq_a = [a.at("peer.get") is not None for _ in range(200)]
    assert seq_a == [b.at("peer.get") is not None for _ in range(200)]
    assert 60 < sum(seq_a) < 140  # about half
    assert a.at("pool.reserve") is None  # no rule: never
    assert a.rules["peer.serve"].seconds == 0.01 and a.fired["peer.get"] == sum(seq_a)


@pytest.mark.parametrize("bad", ["peer.nope=error:0.1", "peer.get=explode:0.1", "peer.get=error:1.5",
                                 "peer.get=error", "seed=x"])
def test_a_bad_rule_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError):
        Faults.parse(bad)


def test_an_empty_spec_injects_nothing() -> None:
    assert Faults.parse("").rules == {}
