"""A calendar-aligned limit on three real worker nodes: a task limited to 4 starts per
UTC minute (stacked with a sliding 20/s), sent 6 times at once, runs 4 now and the
rest at the next minute's start, on whichever node, each once; no minute of the
limiter's clock holds more than 4 starts.

The limiter's redis-server has a clock whose next minute starts seconds after the
tasks are sent (tests/minute_clock.py); without faketime the test takes the session's
nodes and waits for the real clock's next minute (up to one)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests import minute_clock
from tests.nodes import Nodes, unique_prefix
from tests.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.celery, pytest.mark.timeout(300)]
MINUTE = 60_000_000


def six_tasks_over_two_minutes(nodes: Nodes) -> None:
    ids = [nodes.send("aligned", i).id for i in range(6)]
    runs = nodes.wait_for_runs(ids, timeout=200)
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == set(ids), f"{len(set(ids) - set(counted))} of 6 never ran"
    assert max(counted.values()) == 1, "a task ran twice"
    per_minute = Counter(r["t"] // MINUTE for r in runs)
    assert max(per_minute.values()) <= 4, per_minute
    assert len(per_minute) >= 2  # 6 starts at 4 a minute need two minutes


def test_no_minute_of_the_clock_holds_more_than_the_limit_across_nodes(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if minute_clock.binary() is None:
        six_tasks_over_two_minutes(request.getfixturevalue("shared_nodes"))
        return
    port = free_port()
    with RedisServer() as broker:
        nodes = Nodes(
            tmp_path,
            limiter_url=f"redis://127.0.0.1:{port}/0",
            broker_url=f"redis://127.0.0.1:{broker.port}/1",
            prefix=unique_prefix("calendar"),
        )
        # the limiter's server starts once the nodes are up (they say once that it did
        # not answer yet), so that its minute ends a few seconds after the tasks are sent
        nodes.start()
        try:
            with minute_clock.minute_soon(port):
                six_tasks_over_two_minutes(nodes)
        except BaseException:
            print(nodes.logs_since([0] * len(nodes.logs)))
            raise
        finally:
            nodes.stop()
