"""Rates that change on real worker nodes: ``celery -A app ratelimit set KEY RATE``
while three nodes run the key's tasks (base class, decorator and rules) changes what
every node grants from its next decision, lowered and raised; a rate function gives
each tier its own budget through the three forms; nothing is lost."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.examples_env import run
from tests.measure import max_in_window
from tests.nodes import APP, Nodes

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]
CELERY = str(Path(sys.executable).parent / "celery")
FORMS = ("via_base", "via_decorator", "via_rules")


def set_rate(nodes: Nodes, rate: str) -> None:
    result = run(CELERY, "-A", APP, "ratelimit", "set", "shared", rate, env=nodes.env)
    assert result.returncode == 0, result.stdout + result.stderr


def drain(nodes: Nodes, count: int) -> list[int]:
    """Send ``count`` tasks of the key "shared" through the three forms; assert each ran
    once; return their body starts (µs)."""
    ids = [nodes.send(FORMS[i % 3], i).id for i in range(count)]
    runs = nodes.wait_for_runs(ids, timeout=90)
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == set(ids), f"{len(set(ids) - set(counted))} of {count} never ran"
    assert max(counted.values()) == 1, "a task ran twice"
    return [r["started"] for r in runs]


def test_set_changes_what_every_node_grants(shared_nodes: Nodes) -> None:
    """The key is declared at 10/s (``CRL_RATE``): set below it, then above it."""
    nodes = shared_nodes
    set_rate(nodes, "2/s")
    lowered = drain(nodes, 8)
    assert max_in_window(lowered, 1_000_000) <= 2
    set_rate(nodes, "12/s")
    raised = drain(nodes, 24)
    most = max_in_window(raised, 1_000_000)
    assert 2 < most <= 12, f"{most} starts in one second under 12/s"


def test_a_rate_function_gives_each_tier_its_budget(shared_nodes: Nodes) -> None:
    nodes = shared_nodes
    forms = ("tiered", "tiered_by_decorator", "tiered_by_rules")
    sent = [(tier, i) for i in range(24) for tier in ("free", "pro") if tier == "pro" or i < 8]
    ids = {nodes.send(forms[i % 3], tier, i).id: tier for tier, i in sent}
    runs = nodes.wait_for_runs(ids, timeout=90)
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == set(ids) and max(counted.values()) == 1
    for tier, limit in (("free", 2), ("pro", 6)):
        starts = [r["started"] for r in runs if ids[r["id"]] == tier]
        most = max_in_window(starts, 1_000_000)
        assert most <= limit, f"{most} {tier} starts in one second"
    pro = [r["started"] for r in runs if ids[r["id"]] == "pro"]
    assert max_in_window(pro, 1_000_000) > 2  # its own budget, not the free tier's
