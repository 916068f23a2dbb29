"""The request path's counters (``RequestCounts``): what a scrape of /metrics shows."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from emsd.metrics import LATENCY_BUCKETS, Metrics

OPS = ("pin", "put", "exists")
requests = st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(("ok", "error")),
                              st.floats(0, 20) | st.sampled_from(LATENCY_BUCKETS)), max_size=40)


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(m.render().decode())
            for s in family.samples}


@given(requests)
def test_requests_are_counted_by_op_and_result_and_timed_in_buckets(
        reqs: list[tuple[str, str, float]]) -> None:
    m = Metrics()
    for op, result, seconds in reqs:
        m.observe_op(op, result, seconds)
    got = samples(m)
    for op in OPS:
        mine = [seconds for o, _, seconds in reqs if o == op]
        for result in ("ok", "error"):
            n = sum(1 for o, r, _ in reqs if (o, r) == (op, result))
            assert got.get(("emsd_ops_total", (("op", op), ("result", result))), 0) == n
        if not mine:
            assert ("emsd_op_duration_seconds_count", (("op", op),)) not in got
            continue
        assert got["emsd_op_duration_seconds_count", (("op", op),)] == len(mine)
        assert abs(got["emsd_op_duration_seconds_sum", (("op", op),)] - sum(mine)) < 1e-9
        for bound in (*LATENCY_BUCKETS, float("inf")):  # a bucket counts the times <= its bound
            le = "+Inf" if bound == float("inf") else repr(bound)
            key = ("emsd_op_duration_seconds_bucket", tuple(sorted((("le", le), ("op", op)))))
            assert got[key] == sum(1 for s in mine if s <= bound), (le, mine)


def test_keys_bytes_and_failed_saves_add_up() -> None:
    m = Metrics()
    m.looked_up("pin", 3, 1, 3000)
    m.looked_up("pin", 2, 0, 2000)
    m.looked_up("exists", 0, 4, 0)
    m.reserved(2, 500, 1, "put")
    m.reserved(1, 100, 0)
    got = samples(m)
    assert got["emsd_lookup_keys_total", (("op", "pin"), ("result", "hit"))] == 5
    assert got["emsd_lookup_keys_total", (("op", "pin"), ("result", "miss"))] == 1
    assert got["emsd_lookup_keys_total", (("op", "exists"), ("result", "miss"))] == 4
    assert ("emsd_lookup_keys_total", (("op", "exists"), ("result", "hit"))) not in got
    assert got["emsd_op_bytes_total", (("op", "pin"),)] == 5000
    assert got["emsd_op_bytes_total", (("op", "put"),)] == 500
    assert got["emsd_op_bytes_total", (("op", "reserve"),)] == 100
    assert got["emsd_reserve_failed_keys_total", ()] == 1
