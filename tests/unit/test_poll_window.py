"""``emsd.transport.pollwindow``: the busy-poll window of the SDK and the daemon grows while
polling pays and shrinks when it does not."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from emsd.transport.pollwindow import FLOOR, next_window

caps = st.floats(FLOOR, 0.01)
waits = st.floats(0, 1.0)


@given(caps, st.floats(0, 1), st.booleans(), waits)
def test_the_window_stays_between_zero_and_the_cap(cap: float, share: float, caught: bool,
                                                   waited: float) -> None:
    window = next_window(share * cap, cap, caught, waited)
    assert 0.0 <= window <= cap


@given(caps, st.floats(0, 1), st.data())
def test_answers_caught_or_soon_after_never_shrink_it(cap: float, share: float, data: st.DataObject) -> None:
    window = share * cap
    caught = data.draw(st.booleans())
    waited = data.draw(st.floats(0, 1.0)) if caught else data.draw(st.floats(0, 2 * cap))
    assert next_window(window, cap, caught, waited) >= min(window, cap)


@given(caps, st.floats(0, 1))
def test_slow_answers_stop_the_polling_within_a_few_calls_and_quick_ones_restore_it(
        cap: float, share: float) -> None:
    window, calls = share * cap, 0
    while window > 0:  # every answer slower than twice the cap, none caught
        window = next_window(window, cap, False, 2 * cap + 1e-3)
        calls += 1
    assert calls <= 12  # halving from at most 10 ms to below FLOOR (10 us)
    for _ in range(12):  # answers that come at once again
        window = next_window(window, cap, window > 0, FLOOR / 2)
    assert window == cap
