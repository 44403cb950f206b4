"""Limits that follow the upstream, on real worker nodes: three nodes run tasks declared
at twice what a real HTTP upstream (tests/upstream.py, its own sliding limit) allows;
each body observes the upstream's headers (IETF ``RateLimit``, ``X-RateLimit-*`` with an
epoch reset, LLM-style ``x-ratelimit-*-requests``). Once the first answer was observed,
no window of the upstream's holds more requests than its limit, and every task gets its
one accepted call: nothing lost, nothing run twice. And a ``Limit(adapt=True)`` cut by
one node's 429 holds on every node."""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable

import pytest

from tests.measure import max_in_window
from tests.nodes import Nodes
from tests.upstream import FAMILIES, Upstream

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]
LIMIT, WINDOW = 10, 1.0
DECLARED = f"{2 * LIMIT}/s"
PER_FAMILY = 30
#: How much narrower than the upstream's window its arrivals are counted in (seconds).
ARRIVAL_SLACK = 0.1


def test_no_window_above_the_upstreams_limit_once_observed(
    start_nodes: Callable[..., Nodes],
) -> None:
    with Upstream(LIMIT, WINDOW) as upstream:
        nodes = start_nodes(rate=DECLARED)
        sent = {
            nodes.send("calls_http", family, i, upstream.url(family)).id: family
            for i in range(PER_FAMILY)
            for family in FAMILIES
        }
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            accepted = Counter(a.task for a in upstream.arrivals if a.status == 200)
            if set(accepted) >= set(sent):
                break
            time.sleep(0.2)
        time.sleep(0.5)  # a second acceptance of a task would come now
        arrivals = list(upstream.arrivals)
    accepted = Counter(a.task for a in arrivals if a.status == 200)
    lost = set(sent) - set(accepted)
    assert not lost, f"{len(lost)} of {len(sent)} tasks never got an accepted call"
    assert max(accepted.values()) == 1, "a task's call was accepted twice"
    runs = nodes.runs()
    for family in FAMILIES:
        mine = [a for a in arrivals if a.family == family]
        observed = min(a.at for a in mine)  # its answer is observed right after
        # the limiter's side, exact: the grants (Redis time, this machine's clock)
        grants = [r["granted"] / 1e6 for r in runs if r["family"] == family]
        most = max_in_window([g for g in grants if g > observed], WINDOW)
        assert most <= LIMIT, f"{family}: {most} grants in one window of {LIMIT}/s"
        # the upstream's side: a call arrives a moment after its grant (the body starts,
        # connects); on a busy machine that moment varies by more than the guard the
        # grants are spaced by, so the windows counted here are ARRIVAL_SLACK narrower
        later = [a.at for a in mine if a.at > observed]
        most = max_in_window(later, WINDOW - ARRIVAL_SLACK)
        rejected = sum(a.status == 429 for a in mine)
        assert most <= LIMIT, (
            f"{family}: {most} requests in {WINDOW - ARRIVAL_SLACK:g} s at the upstream "
            f"of {LIMIT}/s ({rejected} answered 429)"
        )
    hosts = {run["hostname"] for run in runs}
    assert len(hosts) > 1, "one node ran every task: nothing was shared"


def test_an_adapting_rate_cut_by_one_node_holds_on_every_node(shared_nodes: Nodes) -> None:
    """Task 0's 429 on one node halves the key's 20/s to 10/s; the tasks sent after it
    are granted on every node at no more than the effective rate: 10 a window, and 2
    (a tenth of 20) more for each whole window since the cut."""
    nodes = shared_nodes
    first = nodes.send("adapts_upstream", 0).id
    settings = f"{nodes.prefix}:{{adapting}}:settings"
    deadline = time.monotonic() + 30
    while not nodes.redis().hget(settings, "eff:log:1000000"):
        assert time.monotonic() < deadline, "the 429 never cut the rate"
        time.sleep(0.05)
    cut = min(r["t"] for r in nodes.runs())  # the cut came after this run began
    ids = [nodes.send("adapts_upstream", i).id for i in range(1, 61)]
    runs = nodes.wait_for_runs([first, *ids], timeout=90)
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == {first, *ids}, "a task never ran"
    assert counted[first] == 2 and max(counted[i] for i in ids) == 1
    grants = sorted(r["granted"] for r in runs if r["id"] != first)
    for k, at in enumerate(grants):
        allowed = min(20, 10 + 2 * ((at - cut) // 1_000_000))
        in_window = k + 1 - bisect.bisect_right(grants, at - 1_000_000)
        assert in_window <= allowed, f"{in_window} grants in the second before {at}"
    assert len({r["hostname"] for r in runs if r["id"] != first}) > 1
