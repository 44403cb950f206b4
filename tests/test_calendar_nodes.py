"""A calendar-aligned limit on three real worker nodes: a task limited to 4 starts per
UTC minute (stacked with a sliding 20/s), sent 6 times at once, runs 4 now and the
rest at the next minute's start, on whichever node, each once; no minute of the clock
holds more than 4 starts."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.nodes import Nodes

pytestmark = [pytest.mark.celery, pytest.mark.timeout(300)]
MINUTE = 60_000_000


def test_no_minute_of_the_clock_holds_more_than_the_limit_across_nodes(
    shared_nodes: Nodes,
) -> None:
    nodes = shared_nodes
    ids = [nodes.send("aligned", i).id for i in range(6)]
    runs = nodes.wait_for_runs(ids, timeout=200)
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == set(ids), f"{len(set(ids) - set(counted))} of 6 never ran"
    assert max(counted.values()) == 1, "a task ran twice"
    per_minute = Counter(r["t"] // MINUTE for r in runs)
    assert max(per_minute.values()) <= 4, per_minute
    assert len(per_minute) >= 2  # 6 starts at 4 a minute need two minutes
