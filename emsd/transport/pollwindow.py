"""How long to busy-poll before sleeping: a window that adapts to what polling buys.

The SDK polls for an answer (``ems.client.busy_poll_budget``) and the daemon
for its clients' next requests (``emsd.transport.busypoll``) instead of
sleeping at once: a sleeper's wake-up costs tens of microseconds on a virtual
machine. Polling is worth its CPU only when what it waits for comes within the
window. When it does not (more busy processes than cores, the daemon busy with
peers, a slow call), the spinning only takes CPU from the daemon and the other
clients: on the 2-core development VM four clients of one daemon made 20-24%
fewer single-block calls a second with the SDK's fixed 200 us poll than
without it.

So the window follows the rule of KVM's halt polling (``halt_poll_ns``): after
each wait, if the answer came while polling, or soon after the caller went to
sleep (a longer window would have caught it), the window grows (doubling from
``FLOOR``, up to the cap); if the answer took longer, the window shrinks
(halving, and to 0 below ``FLOOR``). "Soon" is within twice the cap: a wait
that slept includes the wake-up the poll would have saved. A client alone on
a quiet machine keeps polling for the whole cap; a poller that would spin in
vain stops within a few waits, and starts again once answers (or requests)
come quickly.
"""

from __future__ import annotations

FLOOR = 10e-6  # seconds: the smallest window worth polling for


def next_window(window: float, cap: float, caught: bool, waited: float) -> float:
    """The window for the next wait, after one that polled for ``window`` seconds (at most
    ``cap``) and got its answer after ``waited`` seconds (``caught``: while polling)."""
    if caught or waited <= 2 * cap:
        return min(cap, max(2 * window, FLOOR))
    return window / 2 if window / 2 >= FLOOR else 0.0
