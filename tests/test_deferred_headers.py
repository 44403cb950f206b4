"""A deferred copy is the same task: every header its message was sent with (custom
ones, a ``traceparent``, stamps) reaches the body of every copy, whether the copy went
straight back to the broker or waited in the park, on the Redis and RabbitMQ brokers,
inside a chain and a chord, and after several deferrals in a row; ours never replace
a user's."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import chain, chord
from celery.canvas import StampingVisitor

from tests.nodes import RABBITMQ_URL, Nodes, require_rabbitmq

pytestmark = [pytest.mark.celery, pytest.mark.timeout(240)]


def sent_headers(i: int) -> dict[str, str]:
    """A user's headers: a tracing context, a correlation id, and names that our own
    headers' (``ratelimit_deferrals``, ``ratelimit_token``) could be mistaken for."""
    return {
        "traceparent": f"00-{uuid.uuid4().hex}-{i:016x}-01",
        "x_custom": f"v{i}",
        "deferrals": "the user's",
        "token": "the user's",
    }


def check(nodes: Nodes, sent: dict[str, dict[str, str]], timeout: float = 120) -> list[Any]:
    """Every task ran once, each with every header it was sent with; returns the runs."""
    runs = nodes.wait_for_runs(sent, timeout=timeout)
    counted = Counter(r["id"] for r in runs)
    assert set(counted) == set(sent), f"{len(set(sent) - set(counted))} never ran"
    for run in runs:
        assert run["headers"] == {**run["headers"], **sent[run["id"]]}, run
    assert any(r["deferrals"] for r in runs), "no copy was deferred: nothing was tested"
    return runs


@pytest.mark.parametrize(
    ("broker", "park"),
    [("redis", "none"), ("redis", "1.5"), ("rabbitmq", "none"), ("rabbitmq", "1.5")],
)
def test_every_copy_carries_the_headers_it_was_sent_with(
    start_nodes: Callable[..., Nodes], broker: str, park: str
) -> None:
    """Four at once under 1/s: three are deferred, 1, 2 and 3 s (parked past 1.5 s); a
    cap of 1.6 s on a deferral (``ratelimit_max_countdown``) defers the last one twice
    or more."""
    options: dict[str, Any] = {}
    if broker == "rabbitmq":
        require_rabbitmq()
        options["broker_url"] = RABBITMQ_URL
        options["queue"] = f"headers-{uuid.uuid4().hex[:8]}"
    nodes = start_nodes(
        count=1,
        rate="1/s",
        extra_env={"CRL_PARK_AFTER": park, "CRL_MAX_COUNTDOWN": "1.6"},
        **options,
    )
    sent = {}
    for i in range(4):
        headers = sent_headers(i)
        sent[nodes.send("via_base", i, headers=headers, queue=nodes.queue).id] = headers
    runs = check(nodes, sent)
    assert max(r["deferrals"] for r in runs) >= 2  # several deferrals in a row
    with nodes.redis() as client:
        counts = [client.hget(k, "park") for k in client.scan_iter(f"{nodes.prefix}:{{park:*}}:*")]
        parked = sum(int(n) for n in counts if n)
    # the path under test was taken: copies parked, or none when the park is off
    assert (parked > 0) == (park != "none"), parked


class _Stamp(StampingVisitor):  # type: ignore[misc]
    def __init__(self, value: str) -> None:
        self.value = value

    def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
        return {"tenant_stamp": self.value}


def test_copies_in_a_chain_a_chord_and_stamped_keep_their_headers(
    start_nodes: Callable[..., Nodes],
) -> None:
    """The ``math`` limit (4/s) defers members of a chain and a chord sent at once."""
    nodes = start_nodes(count=1, extra_env={"CRL_PARK_AFTER": "none"})
    sent: dict[str, dict[str, str]] = {}

    def member(i: int, *args: Any, task: str = "add") -> Any:
        headers = sent_headers(i)
        sig = nodes.signature(task, *args).set(headers=headers)
        sig.freeze()
        sent[sig.id] = headers
        return sig

    a_chain = chain(member(0, 0, 1), *(member(i, 1) for i in range(1, 5)))
    a_chord = chord([member(10 + i, i, 100) for i in range(8)], member(20, task="total"))
    stamped = [member(30 + i, i, 1000) for i in range(6)]
    for sig in stamped:
        sig.stamp(visitor=_Stamp("acme"))
    a_chain.apply_async()
    a_chord.apply_async()
    for sig in stamped:
        sig.apply_async()
    runs = check(nodes, sent)
    stamped_ids = {sig.id for sig in stamped}
    for run in runs:
        if run["id"] in stamped_ids:
            assert run["stamps"].get("tenant_stamp") == "acme", run
