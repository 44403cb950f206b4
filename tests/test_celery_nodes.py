"""Three real ``celery worker`` nodes sharing one budget in a real redis-server.

Every task of ``tests.apps.nodes`` records, first thing in its body, the instant it
started (``started``: the machine's clock, which is the limiter's redis-server's
clock too) and the slot the limiter granted it (``granted``: Redis server time chosen
atomically by the script). The tests hold grants *and* starts to the limit in every
window, strictly, and every start to "never before its slot": a start is what an
upstream API sees.

Run with ``-s`` (or ``-rP``) to see the measured figures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
from celery import chain, chord, group
from kombu import Connection

from celery_ratelimit import Limit, Limiter, Rate
from celery_ratelimit._celery import settings as _settings
from celery_ratelimit._celery.defer import ETA_MARGIN
from celery_ratelimit._engine.layout import PENDING
from tests.apps.nodes import CAP, FAIR_RATE, MATH, PUSHED, QUOTA
from tests.calls import RESTAMP, decide
from tests.log_reader import entries as log_entries
from tests.log_reader import sleep_until
from tests.measure import ideal_drain_us, max_in_window, percentiles, server_us, us
from tests.nodes import (
    RABBITMQ_URL,
    Nodes,
    evalsha_calls,
    node_set,
    require_rabbitmq,
    unique_prefix,
)

pytestmark = [pytest.mark.celery, pytest.mark.timeout(300)]

RATE = "10/s"
PARK_AFTER = _settings.PARK_AFTER  # under "auto", the limiter being the broker's server
DEFERRED = re.compile(r"ratelimit: deferred (\S+)\[([0-9a-f-]+)\]")


def _failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "rep_call", None)
    return report is None or not report.passed


@pytest.fixture(scope="module")
def redis_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """Three nodes on a private Redis broker with a Redis result backend, at 10/s; the
    limiter has a redis-server of its own, so its EVALSHA count is the limiter's."""
    with node_set(
        tmp_path_factory.mktemp("nodes"),
        unique_prefix("redis-nodes"),
        rate=RATE,
        separate_limiter=True,
    ) as nodes:
        yield nodes


def emptied(nodes: Nodes, request: pytest.FixtureRequest) -> Iterator[Nodes]:
    """``nodes`` with an empty runs list and no budget; their logs printed on failure."""
    marks = nodes.log_marks()
    nodes.clear_runs()
    nodes.clear_budgets()
    yield nodes
    if _failed(request):
        print(nodes.logs_since(marks))


@pytest.fixture
def nodes(redis_nodes: Nodes, request: pytest.FixtureRequest) -> Iterator[Nodes]:
    """The module's nodes with an empty runs list; their logs are printed on failure."""
    yield from emptied(redis_nodes, request)


def deferrals_logged(nodes: Nodes) -> Counter[str]:
    """How many ``deferred`` lines the nodes logged per task id."""
    counts: Counter[str] = Counter()
    for line in nodes.grep("ratelimit: deferred "):
        match = DEFERRED.search(line)
        if match:
            counts[match.group(2)] += 1
    return counts


def check_backlog(
    nodes: Nodes,
    ids: Sequence[str],
    runs: list[dict[str, Any]],
    rate: str,
    label: str,
) -> dict[str, Any]:
    """Assert what must hold for a drained backlog and return the measured figures.

    - every task ran exactly once;
    - no window of the rate holds more grants than the limit;
    - no body started before its granted slot;
    - no window of the rate holds more body starts than the limit;
    - deferrals consumed no retries, and the header's deferral count equals the
      number of deferrals the nodes logged for that task.
    """
    parsed = Rate.parse(rate)
    limit, window = parsed.limit, parsed.window_us
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == set(ids), (
        f"{label}: {len(set(ids) - set(counted))} of {len(ids)} tasks never ran"
    )
    assert max(counted.values()) == 1, (
        f"{label}: ran more than once: {[i for i, n in counted.items() if n > 1]}"
    )
    grants = [r["granted"] for r in runs]
    starts = [r["started"] for r in runs]
    assert None not in grants, f"{label}: a task ran without a grant"
    max_grants = max_in_window(grants, window)
    assert max_grants <= limit, f"{label}: {max_grants} grants in one window of {rate}"
    early = [r for r in runs if r["started"] < r["granted"]]
    assert not early, f"{label}: {len(early)} bodies started before their slot: {early[:3]}"
    max_starts = max_in_window(starts, window)
    assert max_starts <= limit, f"{label}: {max_starts} starts in one window of {rate}"
    assert all(r["retries"] == 0 for r in runs), f"{label}: a deferral consumed a retry"
    logged = deferrals_logged(nodes)
    mismatched = [r for r in runs if r["deferrals"] != logged.get(r["id"], 0)]
    assert not mismatched, f"{label}: header deferral count != logged deferrals: {mismatched[:3]}"
    lateness_ms = [(r["started"] - r["granted"]) / 1000 for r in runs]
    drain_us = max(grants) - min(grants)
    ideal_us = ideal_drain_us(len(ids), limit, window)
    figures = {
        "tasks": len(ids),
        "rate": rate,
        "max_grants_in_window": max_grants,
        "max_starts_in_window": max_starts,
        "drain_s": drain_us / 1e6,
        "ideal_s": ideal_us / 1e6,
        "drain_ratio": drain_us / ideal_us if ideal_us else float("nan"),
        "deferred_tasks": sum(1 for r in runs if r["deferrals"]),
        "deferrals": sum(r["deferrals"] for r in runs),
        "max_deferrals_per_task": max(r["deferrals"] for r in runs),
        "lateness_ms": {p: round(v, 1) for p, v in percentiles(lateness_ms).items()},
        "nodes": dict(Counter(r["hostname"].split("@")[0].split("-")[0] for r in runs)),
    }
    print(f"\n[{label}] " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    return figures


def drain(nodes: Nodes, name: str, count: int, timeout: float = 40.0) -> tuple[list[str], Any]:
    ids = [nodes.send(name, i).id for i in range(count)]
    return ids, nodes.wait_for_runs(ids, timeout)


# -- three nodes, each form ------------------------------------------------------------


@pytest.mark.parametrize("form", ["via_base", "via_decorator", "via_rules", "shared_decorated"])
def test_three_nodes_drain_a_backlog_without_exceeding_the_shared_limit(
    nodes: Nodes, form: str
) -> None:
    with nodes.redis() as client:
        before = evalsha_calls(client)
        ids, runs = drain(nodes, form, 40)
        calls = evalsha_calls(client) - before
    figures = check_backlog(nodes, ids, runs, RATE, f"redis broker, {form}")
    # calls per task, the drain's pace and deferrals per task move with the machine's
    # load: the benchmark measures them (rows 6 and 7); here they are printed
    print(f"[redis broker, {form}] limiter calls {calls} = {calls / len(runs):.2f} per task")
    assert figures["deferred_tasks"] > 0  # the limit deferred tasks, not only counted them


def test_each_node_says_at_its_start_which_rule_matches_no_task(nodes: Nodes) -> None:
    # tests.apps.nodes has a rule for "tests.apps.nodes.via_rule", a name no task has
    deadline = time.monotonic() + 30
    while len(nodes.grep("matches no task")) < len(nodes.logs) and time.monotonic() < deadline:
        time.sleep(0.2)
    said = nodes.grep("matches no task")
    assert len(said) == len(nodes.logs), said  # one line a node
    assert all(
        "WARNING" in line
        and "'tests.apps.nodes.via_rule'" in line
        and "did you mean 'tests.apps.nodes.via_rules'?" in line
        for line in said
    ), said


def test_a_paced_backlog_drains_one_call_an_interval_on_three_nodes(nodes: Nodes) -> None:
    """``Limit("20/2s", key="paced", burst=2)`` with 30 tasks sent at once: besides the
    window (20 in any 2 s, checked by check_backlog), never more than the burst in any
    100 ms (the emission interval) among the grants, nor more than the burst + 1 among
    the starts (a body begins a moment after its grant); nothing lost. The backlog
    drains about one call per interval instead of 20 at every window edge."""
    ids, runs = drain(nodes, "paced", 30)
    check_backlog(nodes, ids, runs, "20/2s", "paced, burst 2")
    grants = [r["granted"] for r in runs]
    starts = [r["started"] for r in runs]
    assert max_in_window(grants, 100_000) <= 2, sorted(grants)
    assert max_in_window(starts, 100_000) <= 3, sorted(starts)
    # reserved slots are paced: 2 at once, then one per 100 ms, so 30 grants span 2.8 s
    assert max(grants) - min(grants) >= 2_800_000 - 1_000


def park_figures(client: Any, prefix: str) -> tuple[int, int, int]:
    """Copies parked and published so far, and waiting now, in every park of ``prefix``."""
    parked = published = waiting = 0
    for key in client.scan_iter(match=f"{prefix}:{{park:*}}:counts"):
        counts = client.hgetall(key)
        parked += int(counts.get(b"park", 0))
        published += int(counts.get(b"published", 0))
        waiting += int(client.zcard(key.decode().rsplit(":", 1)[0] + ":due"))
    return parked, published, waiting


def test_a_backlog_waits_in_redis_and_nodes_hold_only_the_copies_due_within_seconds(
    start_nodes: Callable[..., Nodes],
) -> None:
    """A deferral longer than ``ratelimit_park_after`` (2 s under "auto", the limiter
    being the broker's Redis server here) is parked in Redis; the nodes' movers publish
    each copy a second before it is due. So no node holds an ETA message due later than
    about 2 s from when it arrived, however far the backlog reaches (60 tasks at 10/s:
    the last are due 5 s out), and none is lost."""
    nodes = start_nodes(rate=RATE, backend=False)
    with nodes.redis() as client:
        parked_before, published_before, _ = park_figures(client, nodes.prefix)
        ids, runs = drain(nodes, "via_base", 60)
        check_backlog(nodes, ids, runs, RATE, "parked deferrals")
        # a mover drops a copy (counting it published) after it published it: the last
        # copy can run before its mover's drop, so the counts are read once it is in
        deadline = time.monotonic() + 5
        while True:
            parked, published, waiting = park_figures(client, nodes.prefix)
            if waiting == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    parked -= parked_before
    assert parked > 0, "no deferral was parked"
    assert published - published_before == parked and waiting == 0
    held = nodes.held()
    print(f"[parked deferrals] {parked} parked; longest ETA wait in a node {max(held):.3f} s")
    assert held and max(held) <= PARK_AFTER + ETA_MARGIN + 0.25, sorted(held)[-5:]


@contextmanager
def busy_core() -> Iterator[None]:
    """Another process spinning on one core for the duration (a busy machine)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.parametrize(
    ("pool", "concurrency", "busy"),
    [
        ("prefork", 2, True),
        ("threads", 30, False),
        ("solo", 1, False),
        ("gevent", 50, False),
        ("gevent", 50, True),
        ("eventlet", 50, False),
        ("eventlet", 50, True),
    ],
    ids=lambda v: "busy" if v is True else "idle" if v is False else str(v),
)
def test_every_pool_starts_bodies_within_the_shared_limit(
    start_nodes: Callable[..., Nodes], pool: str, concurrency: int, busy: bool
) -> None:
    """What an upstream sees is when bodies start: on every pool, and with one core
    kept busy by another process, no window holds more starts than the limit, even
    where a grant's reply is read late (a green pool's hub busy with other tasks).
    The nodes are cold (fresh processes, fresh keys); on the green pools every task of
    the backlog is taken at once (the cold flood: 60 tasks at 10/s on 150 greenlets),
    and most of them are denied and publish their copies while the first bodies run.
    The backlog takes turns among the three forms (base class, decorator, rules), all
    keyed ``"shared"``: on every pool each form is enforced, and they share one budget."""
    nodes = start_nodes(rate=RATE, pool=pool, concurrency=concurrency)
    count = 60 if pool in ("gevent", "eventlet") else 40
    forms = ("via_base", "via_decorator", "via_rules")
    with busy_core() if busy else nullcontext():
        ids = [nodes.send(forms[i % len(forms)], i).id for i in range(count)]
        runs = nodes.wait_for_runs(ids, 60)
    label = f"{pool} -c {concurrency}{' with a busy core' if busy else ''}"
    check_backlog(nodes, ids, runs, RATE, label)
    deferred = Counter(r["task"].rsplit(".", 1)[-1] for r in runs if r["deferrals"])
    assert set(deferred) == set(forms), deferred  # each form deferred tasks: enforced
    # each body's first Redis command on the server's clock, as an upstream would see
    # its first request: a figure of the hub's latency (benchmarks/bench_flood.py)
    first_io = max_in_window([r["t"] for r in runs], Rate.parse(RATE).window_us)
    print(f"[{label}] most first I/Os in a window {first_io}")


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 2), ("threads", 4), ("solo", 1)])
def test_a_body_reads_its_deferrals_and_decision_on_every_pool_and_form(
    start_nodes: Callable[..., Nodes], pool: str, concurrency: int
) -> None:
    """The README's ``self.request.ratelimit_deferrals`` and ``ratelimit_decision``, read
    as attributes: 0 deferrals in a body that ran at its first try (the header comes with
    a deferral), the count after; a Decision always. Three calls of each form at once
    under 1/s (a key per form): the first runs at once, the others are deferred."""
    nodes = start_nodes(pool=pool, concurrency=concurrency, count=1)
    forms = ("by_base", "by_decorator", "by_rules")
    sent = {form: [nodes.send(f"reads_request_{form}") for _ in range(3)] for form in forms}
    for form, results in sent.items():
        read = [result.get(timeout=30) for result in results]  # raised: an AttributeError
        assert all(r["decision"] == "Decision" and r["allowed_or_reserved"] for r in read), read
        deferrals = sorted(r["deferrals"] for r in read)
        assert all(isinstance(d, int) for d in deferrals), read
        assert deferrals[0] == 0 and deferrals[-1] >= 1, (form, read)


@pytest.fixture(scope="module")
def public_only_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """Three nodes with CELERY_RATELIMIT_PUBLIC_ONLY=1, for both forms below."""
    with node_set(
        tmp_path_factory.mktemp("public-only"),
        unique_prefix("public-only"),
        rate=RATE,
        extra_env={"CELERY_RATELIMIT_PUBLIC_ONLY": "1"},
    ) as nodes:
        yield nodes


@pytest.fixture
def public_nodes(public_only_nodes: Nodes, request: pytest.FixtureRequest) -> Iterator[Nodes]:
    yield from emptied(public_only_nodes, request)


@pytest.mark.parametrize("form", ["via_decorator", "shared_decorated"])
def test_public_fallbacks_of_celery_internals_share_the_limit_the_same(
    public_nodes: Nodes, form: str
) -> None:
    """With CELERY_RATELIMIT_PUBLIC_ONLY=1 every private access of ``_compat`` takes its
    public path (a ``@shared_task`` found by its name at worker start, ETAs left as
    sent): the same invariants hold."""
    nodes = public_nodes
    ids, runs = drain(nodes, form, 40)
    figures = check_backlog(nodes, ids, runs, RATE, f"public paths only, {form}")
    assert figures["deferred_tasks"] > 0  # the limit was enforced, not skipped


@pytest.mark.rabbitmq
def test_three_nodes_on_a_rabbitmq_broker_share_the_limit(
    start_nodes: Callable[..., Nodes],
) -> None:
    require_rabbitmq()
    queue = f"crl-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        nodes = start_nodes(broker_url=RABBITMQ_URL, backend=False, queue=queue, rate=RATE)
        ids, runs = drain(nodes, "via_decorator", 40)
        figures = check_backlog(nodes, ids, runs, RATE, "rabbitmq broker, via_decorator")
        assert figures["deferred_tasks"] > 0
    finally:
        with Connection(RABBITMQ_URL, connect_timeout=5) as conn:
            conn.default_channel.queue_delete(queue)


# -- keys, costs, stacked limits -----------------------------------------------------


def test_a_tenant_behind_another_tenants_backlog_gets_its_fair_share(nodes: Nodes) -> None:
    """Tenant A's 40 tasks wait for a 5/s budget; tenant B's 3, sent after them, take
    every other slot (fair shares, equal weights) instead of waiting for A's backlog."""
    a_ids = [nodes.send("fair_tenant", "A", i).id for i in range(40)]
    time.sleep(0.5)  # A's tasks have their slots
    with nodes.redis() as client:
        sent_b = server_us(client)
    b_ids = [nodes.send("fair_tenant", "B", i).id for i in range(3)]
    runs = nodes.wait_for_runs(a_ids + b_ids, timeout=40)
    check_backlog(nodes, a_ids + b_ids, runs, FAIR_RATE, "fair shares")
    a_grants = sorted(r["granted"] for r in runs if r["tenant"] == "A")
    b_grants = sorted(r["granted"] for r in runs if r["tenant"] == "B")
    for k, granted in enumerate(b_grants, 1):
        before = sum(sent_b < t < granted for t in a_grants)
        # its share: about one of A's slots before each of B's (k * 2 slots in all),
        # and the slots held or promised within a window when B's call arrived
        assert before <= 2 * k + 5, f"B's task {k} came after {before} of A's slots"
    assert max(a_grants) > max(b_grants)  # B did not wait for A's backlog


def test_two_tenants_at_the_same_limit_do_not_share_a_budget(nodes: Nodes) -> None:
    ids = {tenant: [] for tenant in ("acme", "globex")}
    for i in range(30):
        for tenant, sent in ids.items():
            sent.append(nodes.send("per_tenant", tenant, i).id)
    runs = nodes.wait_for_runs([i for sent in ids.values() for i in sent], 40)
    for tenant, sent in ids.items():
        mine = [r for r in runs if r["tenant"] == tenant]
        check_backlog(nodes, sent, mine, RATE, f"tenant {tenant}")
    combined = max_in_window([r["granted"] for r in runs], 1_000_000)
    span = (max(r["granted"] for r in runs) - min(r["granted"] for r in runs)) / 1e6
    print(f"[two tenants] combined max grants in 1 s = {combined}, drain {span:.2f}s")
    # one shared budget would never allow more than 10 in a window
    assert combined > 10
    with nodes.redis() as client:
        keys = sorted(k.decode() for k in client.scan_iter(f"{nodes.prefix}:{{api:*}}:*"))
    # one key per tenant, each tagged with its tenant: a slot of its own on a Cluster
    assert [k.split(":")[2] for k in keys] == ["acme}", "globex}"], keys


def test_weighted_costs_and_a_stacked_cap_both_hold(nodes: Nodes) -> None:
    units = [5, 10, 2, 8, 15, 1] * 3
    ids = [nodes.send("weighted", u, i).id for i, u in enumerate(units)]
    runs = nodes.wait_for_runs(ids, 40)
    assert Counter(r["id"] for r in runs) == Counter(ids)
    grants = [r["granted"] for r in runs]
    starts = [r["started"] for r in runs]
    units_each = [r["units"] for r in runs]
    quota = max_in_window(grants, QUOTA.rate.window_us, units_each)
    calls = max_in_window(grants, CAP.rate.window_us)
    quota_started = max_in_window(starts, QUOTA.rate.window_us, units_each)
    calls_started = max_in_window(starts, CAP.rate.window_us)
    early = [r for r in runs if r["started"] < r["granted"]]
    drain_s = (max(grants) - min(grants)) / 1e6
    # the tighter of the two limits sets the ideal: 123 units at 40 per 2 s, 18 calls at 3/s
    print(
        f"\n[weighted + stacked] {len(runs)} calls, {sum(units)} units; max units in 2 s "
        f"= {quota} (limit 40), max calls in 1 s = {calls} (limit 3), drain {drain_s:.2f}s, "
        f"deferred {sum(1 for r in runs if r['deferrals'])}"
    )
    assert quota <= QUOTA.rate.limit and quota_started <= QUOTA.rate.limit
    assert calls <= CAP.rate.limit and calls_started <= CAP.rate.limit
    assert not early
    assert all(r["retries"] == 0 for r in runs)
    # the backlog pressed on the limits: some calls waited for their turn
    assert any(r["deferrals"] for r in runs)


# -- canvas and results ----------------------------------------------------------------


def test_chains_groups_and_chords_with_deferred_members_complete(nodes: Nodes) -> None:
    add = nodes.signature
    # second arguments tell the members apart: 1000 chain, x group, 2000 chord header
    a_chain = chain(add("add", 0, 1000), *(add("add", 1000) for _ in range(5))).apply_async()
    a_group = group(add("add", i, i) for i in range(10)).apply_async()
    a_chord = chord([add("add", i, 2000) for i in range(8)], add("total")).apply_async()
    assert a_chain.get(timeout=60) == 6000
    assert a_group.get(timeout=60) == [2 * i for i in range(10)]
    assert a_chord.get(timeout=60) == sum(i + 2000 for i in range(8))
    runs = nodes.runs()
    grants = [r["granted"] for r in runs]
    members = {
        "chain": [r for r in runs if r.get("y") == 1000],
        "group": [r for r in runs if "y" in r and r["x"] == r["y"] != 1000],
        "chord header": [r for r in runs if r.get("y") == 2000],
        "chord body": [r for r in runs if r["task"].endswith(".total")],
    }
    deferred = {part: sum(1 for r in rs if r["deferrals"]) for part, rs in members.items()}
    most = max_in_window(grants, MATH.rate.window_us)
    most_started = max_in_window([r["started"] for r in runs], MATH.rate.window_us)
    print(
        f"\n[canvas] {len(runs)} executions at {MATH.rate}; deferred per part {deferred}; "
        f"max grants in 1 s = {most}"
    )
    assert {part: len(rs) for part, rs in members.items()} == {
        "chain": 6,
        "group": 10,
        "chord header": 8,
        "chord body": 1,
    }
    assert len(runs) == 25 and len({r["id"] for r in runs}) == 25
    assert all(deferred[part] for part in ("chain", "group", "chord header")), deferred
    assert most <= MATH.rate.limit and most_started <= MATH.rate.limit
    assert all(r["started"] >= r["granted"] for r in runs)


def test_a_deferred_task_is_retry_while_deferred_and_success_after(nodes: Nodes) -> None:
    results = [nodes.send("add", i, 100) for i in range(12)]
    last = results[-1]
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = last.state
        if not seen or seen[-1] != state:
            seen.append(state)
        if state == "SUCCESS":
            break
        time.sleep(0.02)
    print(f"\n[states] last of 12 at 4/s went through {seen}")
    assert "RETRY" in seen
    assert seen[-1] == "SUCCESS"
    assert seen.index("RETRY") < seen.index("SUCCESS")
    assert [r.get(timeout=30) for r in results] == [i + 100 for i in range(12)]
    runs = {r["id"]: r for r in nodes.runs()}
    assert runs[last.id]["deferrals"] >= 1
    assert runs[last.id]["retries"] == 0


# -- failures that must end the task ---------------------------------------------------


def test_a_key_template_naming_a_keyword_the_call_lacks_fails_the_task(nodes: Nodes) -> None:
    result = nodes.send("missing_argument", 1)
    result.get(timeout=20, propagate=False)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "InvalidLimit"
    assert "'missing'" in str(result.result)
    assert result.id not in deferrals_logged(nodes)
    assert not [r for r in nodes.runs() if r["id"] == result.id]


def test_a_call_option_header_overrides_the_settings_in_the_worker(nodes: Nodes) -> None:
    # fill the budget for the next seconds (the tasks' grants, then reservations made
    # here), then send one more that may not be deferred at all
    _ids, runs = drain(nodes, "via_base", 10, timeout=20)
    assert len(runs) == 10
    rate = Limit(RATE, key="shared")
    key = f"{nodes.prefix}:{{shared}}:log:1000000"
    with nodes.redis() as client:
        limiter = Limiter(client, prefix=nodes.prefix)
        for _ in range(30):
            decision = limiter.acquire("shared", rate, reserve=True)
            assert decision.allowed or decision.reserved
        before = set(log_entries(client, key))
        result = nodes.send("via_base", 99, headers={"ratelimit_max_deferrals": 0})
        result.get(timeout=20, propagate=False)
        assert result.state == "FAILURE"
        assert type(result.result).__name__ == "RateLimitExceeded"
        assert "ratelimit_max_deferrals=0" in str(result.result)
        assert result.id not in {r["id"] for r in nodes.runs()}
        # the slot it had reserved before giving up was released: the log holds no
        # entry that was not there before it
        assert set(log_entries(client, key)) <= before


# -- no retry storms -----------------------------------------------------------------


BACKLOG_RATE = "5/500ms"
BACKLOG = 40  # 8x the limit


@pytest.mark.timeout(240)
def test_reservations_hand_every_deferred_task_a_slot_of_its_own(
    start_nodes: Callable[..., Nodes],
) -> None:
    """With reservations on, every deferral reserves the task's slot (its copy confirms
    it instead of competing again); with them off, none does. How many limiter calls
    that spares moves with the machine's load: the benchmark measures it (row 7)."""
    for reserve in (True, False):
        nodes = start_nodes(
            rate=BACKLOG_RATE, reserve=reserve, separate_limiter=True, backend=False
        )
        with nodes.redis() as client:
            client.config_resetstat()
            ids, runs = drain(nodes, "via_base", BACKLOG, timeout=90)
            calls = evalsha_calls(client)
        label = f"reservations {'on' if reserve else 'off'}"
        figures = check_backlog(nodes, ids, runs, BACKLOG_RATE, label)
        print(f"[{label}] limiter calls {calls} = {calls / len(runs):.2f} per executed task")
        deferrals = nodes.grep("ratelimit: deferred ")
        assert len(deferrals) == figures["deferrals"] > 0
        reserved = [line for line in deferrals if "slot reserved" in line]
        # (a task whose grants a starved process read late, again and again, competes
        # afresh on purpose: see MAX_RESTAMPS)
        busy = [line for line in deferrals if "too busy" in line]
        assert len(reserved) == (len(deferrals) - len(busy) if reserve else 0), deferrals[:3]


def test_max_deferrals_counts_denials_not_a_reserved_slot_moved_later(nodes: Nodes) -> None:
    """With ``ratelimit_max_deferrals=1`` a task denied once holds a slot; a start moved
    into the window before that slot (as a late start is) pushes it later: a second
    deferral, the library's doing and not the budget's, so the task still runs."""
    first = nodes.send("pushed", 0)
    [run0] = nodes.wait_for_runs([first.id], 20, settle=0)
    second = nodes.send("pushed", 1, headers={"ratelimit_max_deferrals": 1})
    limiter = Limiter.from_url(nodes.limiter_url, prefix=nodes.prefix)
    keys = limiter.keys_for("pushed", PUSHED)
    with nodes.redis() as client:
        deadline = time.monotonic() + 20
        while not (slots := client.zrange(keys[0] + PENDING, 0, -1, withscores=True)):
            assert time.monotonic() < deadline, "the second task was not deferred"
            time.sleep(0.05)
        [(_, slot)] = slots
        sleep_until(client, int(slot) - 1_000_000)
    # the first task's start moves a second before the slot: it fits there, and the
    # slot's window now holds a start, so the second task is pushed a window later
    moved = decide(limiter, keys, (PUSHED,), 1, RESTAMP, token=run0["token"], guard=0.03)
    assert moved.allowed and moved.retry_after == 0
    assert second.get(timeout=30) == 1
    [run1] = [r for r in nodes.runs() if r["id"] == second.id]
    assert run1["deferrals"] == 2 and run1["denials"] == 1
    assert run1["started"] >= us(moved.at) + PUSHED.rate.window_us


# -- retries and expiry ------------------------------------------------------------------


def test_deferrals_never_use_up_max_retries_and_self_retry_still_works(nodes: Nodes) -> None:
    """``flaky`` has max_retries=1 and retries itself once: each of 6 calls at 2/s is
    deferred (most of them more than once counting the retry's own deferral), yet all
    succeed, and the retry count the body sees is Celery's, untouched by deferrals."""
    results = [nodes.send("flaky", i) for i in range(6)]
    values = [r.get(timeout=40) for r in results]
    assert values == ["ok after 1 retry"] * 6
    runs = nodes.runs()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_id.setdefault(run["id"], []).append(run)
    assert len(by_id) == 6
    logged = deferrals_logged(nodes)
    for task_id, attempts in by_id.items():
        # one failing run (retries 0), one succeeding run (retries 1); deferrals between
        assert sorted(r["retries"] for r in attempts) == [0, 1]
        # each run counts its own deferrals: the retry's count starts afresh, so that
        # a retry never uses up ratelimit_max_deferrals with its first run's deferrals
        assert sum(r["deferrals"] for r in attempts) == logged[task_id], attempts
    assert sum(r["deferrals"] for r in runs) >= 4, "the backlog should have been deferred"
    assert max_in_window([r["granted"] for r in runs], 1_000_000) <= 2
    # one INFO line per deferral, ours: Celery's "retry:" line is logged for the body's
    # own retry of each task, never for a deferral
    retried = Counter(
        task_id for line in nodes.grep(" retry: ") for task_id in by_id if task_id in line
    )
    assert retried == Counter(dict.fromkeys(by_id, 1)), retried
    assert all("first run fails" in line for line in nodes.grep(" retry: ") if "flaky" in line)


def test_a_task_whose_expires_passes_while_deferred_ends_expired_not_looping(
    nodes: Nodes,
) -> None:
    """At 1/s, 5 tasks that expire 3.5 s after they are sent: the first runs at once,
    up to three in their slots, the others (the fifth's slot is 4 s after the first
    start) expire while deferred and end as Celery ends an expired task (REVOKED), each
    after at most one deferral."""
    results = [nodes.send("expiring", i, expires=3.5) for i in range(5)]
    deadline = time.monotonic() + 20
    states: list[str] = []
    while time.monotonic() < deadline:
        states = [r.state for r in results]
        if all(s in ("SUCCESS", "REVOKED") for s in states):
            break
        time.sleep(0.2)
    assert set(states) <= {"SUCCESS", "REVOKED"}, states
    assert 1 <= states.count("SUCCESS") <= 4 and states.count("REVOKED") >= 1, states
    runs = nodes.runs()
    assert len(runs) == states.count("SUCCESS")
    assert len(nodes.grep("ratelimit: deferred tests.apps.nodes.expiring")) >= 2
