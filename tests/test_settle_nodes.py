"""Settling real costs on three real worker nodes: tasks of one key (base class,
decorator, rules) are counted at an estimate of 10 units before their bodies and
settle at the units they used; the key's log ends holding every call at its real
weight, and no window holds more real units than the limit; each task runs once."""

from __future__ import annotations

from collections import Counter

import pytest
import redis

from tests.nodes import Nodes

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]
FORMS = ("llm", "llm_by_decorator", "llm_by_rules")
LIMIT, WINDOW_US = 30, 2_000_000


def test_three_nodes_settle_every_call_at_its_real_cost(shared_nodes: Nodes) -> None:
    nodes = shared_nodes
    used = [2 + i % 5 for i in range(12)]  # 2..6 units each, estimated at 10
    ids = [nodes.send(FORMS[i % 3], i, used[i]).id for i in range(12)]
    runs = nodes.wait_for_runs(ids, timeout=120)
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == set(ids), f"{len(set(ids) - set(counted))} of 12 never ran"
    assert max(counted.values()) == 1, "a task ran twice"
    assert all(r["settled"] for r in runs), "a settle did not find its grant"
    # every entry still in the key's log weighs what its call used
    client = redis.Redis.from_url(nodes.env["CRL_REDIS"])
    key = f"{nodes.env['CRL_PREFIX']}:{{llm}}:log:{WINDOW_US}"
    used_by_token = {r["token"].partition(".")[0]: r["used"] for r in runs}
    log = client.zrangebyscore(key, 10**13, "+inf")
    for member in log:
        weight = int(member[9:]) if len(member) > 8 else 1
        assert weight == used_by_token[member[:8].hex()]
    # no window of the limit holds more real units than the limit, by the instants the
    # calls were counted at (each was granted with its estimate, at most the real cost)
    counted = sorted((r["granted"], r["used"]) for r in runs)
    for j, (t, _) in enumerate(counted):
        inside = sum(u for s, u in counted[: j + 1] if s > t - WINDOW_US)
        assert inside <= LIMIT, (t, inside)
