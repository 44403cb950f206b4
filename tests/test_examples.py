"""Each example in examples/ runs as a user would run it: private redis-servers, real
``celery worker`` nodes, the example's own entry point; its report is checked."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

import pytest

from tests.examples_env import env_for, run, workers
from tests.redis_server import RedisServer

pytestmark = pytest.mark.celery


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    broker, limiter = RedisServer(), RedisServer()
    yield broker, limiter
    broker.close()
    limiter.close()


def test_quota_ingestion_spends_at_most_the_quota_per_sliding_day(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    env = env_for(*servers, YT_DAY_SECONDS="3", YT_SEARCHES="13", YT_PAGES="20")
    with workers("examples.quota_ingestion", env, count=2):
        result = run(sys.executable, "-m", "examples.quota_ingestion", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # 8 regions x (13 x 100 + 20 x 1) = 10,560 units: more than one day's 9,500
    assert "executed 104 search.list x 100 + 160 videos.list x 1 = 10560 units" in out
    days = [int(u) for u in re.findall(r"^day \d+ .*?(\d+) units spent", out, re.M)]
    assert sum(days) == 10560 and len(days) >= 2
    assert all(units <= 9500 for units in days)
    most = int(re.search(r"most units in any sliding day\s+(\d+) / 9500", out)[1])  # type: ignore[index]
    assert 9000 < most <= 9500  # the quota was the binding limit, and it held
    cap = int(re.search(r"most search.list in any sliding hour (\d+) / 25", out)[1])  # type: ignore[index]
    assert cap <= 25
    assert "result: the quota held" in out
