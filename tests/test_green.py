"""The green pools' timing helpers (``_green``): which decisions are led, and by how much."""

from __future__ import annotations

from celery_ratelimit import Concurrency, Limit
from celery_ratelimit._celery.green import COLD_LEAD, cold_lead, lead


def test_the_first_window_of_decisions_after_a_quiet_spell_is_led() -> None:
    never = float("-inf")
    ahead, since = cold_lead(100.0, 1.0, never, never)  # the process's first decision
    assert (ahead, since) == (COLD_LEAD, 100.0)
    # every decision within a window of the spell's beginning is led, however close
    assert cold_lead(100.5, 1.0, 100.0, since) == (COLD_LEAD, 100.0)
    assert cold_lead(100.99, 1.0, 100.5, since) == (COLD_LEAD, 100.0)
    # decisions going on past that window: warm, not led
    assert cold_lead(101.2, 1.0, 100.99, since) == (0.0, 100.0)
    assert cold_lead(105.0, 1.0, 104.5, since) == (0.0, 100.0)
    # a window without any decision: the next one begins a cold spell again
    assert cold_lead(107.0, 1.0, 105.0, since) == (COLD_LEAD, 107.0)


def test_a_call_without_a_sliding_window_is_never_led() -> None:
    assert cold_lead(100.0, 0.0, float("-inf"), float("-inf"))[0] == 0.0


def test_off_the_green_pools_nothing_is_led() -> None:
    # this test process has patched no sockets: prefork, threads and solo
    assert lead((Limit("10/s"),)) == 0.0
    assert lead((Concurrency(2),)) == 0.0
