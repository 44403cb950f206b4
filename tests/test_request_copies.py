"""What the limiter keeps for a running task travels in no message: a retry, a stamp or
a copy of the request context carries it harmlessly (issue: a stamped task's
``self.retry()`` failed with "Object of type Decision is not JSON serializable").

Celery builds a new request context from the old one when a task's ``__call__`` runs
without the worker's optimization (Celery's own test worker, ``start_worker`` and the
``celery_worker`` fixtures), and every attribute that is not one of its own becomes a
header that ``self.retry()`` publishes. The worker test below runs on that path, on a
real broker and result backend; Celery's whole canvas suite is run the same way by
``tests/celery_canvas.py``.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.canvas import StampingVisitor
from celery.contrib.testing.worker import start_worker

from celery_ratelimit import Concurrency, Decision, Limit, install
from celery_ratelimit._celery.check import DECISION_ATTR
from celery_ratelimit._celery.slots import SLOT_ATTR
from tests.redis_server import RedisServer


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    # results and apps the test left in reference cycles unsubscribe from the backend
    # when collected: let them do it while the server is up (a later gc.collect() would
    # have them retry a closed port for seconds)
    gc.collect()
    server.close()


class _Stamp(StampingVisitor):  # type: ignore[misc]
    def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
        return {"stamp": 42}


@pytest.mark.celery
@pytest.mark.parametrize(
    "limits",
    [
        pytest.param([Limit("1/2s", key="copies")], id="rate"),
        pytest.param([Limit("1/2s", key="copies"), Concurrency(1, key="copies")], id="slot"),
    ],
)
def test_a_stamped_task_retries_under_a_limit_that_defers_the_retry(
    server: RedisServer, limits: list[Any]
) -> None:
    """The shape of Celery's ``test_stamps_remain_on_task_retry``, with every task
    limited by ``install()``: the first run is granted and calls ``self.retry()``; the
    retry is published (with the stamp), denied by the 1-per-2s limit, deferred, and
    runs. Each run reads its Decision; no message carries it or the concurrency slot."""
    app = Celery("copies_test", broker=server.url, backend=server.url, set_as_current=False)
    app.conf.update(
        ratelimit_redis_url=server.url,
        ratelimit_key_prefix="copies",
        ratelimit_rules={"copies_test.*": limits},
        worker_hijack_root_logger=False,
    )
    install(app)
    runs: list[dict[str, Any]] = []

    # shared=False: a shared task is added to every app finalized later (each other
    # test's), which warns of a duplicate name once this test has run twice
    @app.task(name="copies_test.retry_once", bind=True, max_retries=1, shared=False)
    def retry_once(self: Any) -> int:
        request = self.request
        decision = request.ratelimit_decision
        runs.append(
            {
                "retries": request.retries,
                "allowed": isinstance(decision, Decision) and decision.allowed,
                "deferrals": request.get("ratelimit_deferrals") or 0,
                "stamp": (request.stamps or {}).get("stamp"),
                # what a retry of this run publishes: it must be serializable
                "headers": json.loads(json.dumps(request.headers or {})),
            }
        )
        if not request.retries:
            raise self.retry(countdown=0.1)
        return int(request.retries)

    signature = retry_once.si()
    signature.stamp(visitor=_Stamp())
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert signature.delay().get(timeout=30) == 1
    first, retried = runs
    assert first["retries"] == 0 and retried["retries"] == 1
    assert first["allowed"] and retried["allowed"]
    assert retried["deferrals"] >= 1, "the retry came within 2 s of the first run"
    assert first["stamp"] in (42, [42]) and retried["stamp"] in (42, [42]), runs
    for run in runs:
        assert DECISION_ATTR not in run["headers"] and SLOT_ATTR not in run["headers"]


def test_a_copy_of_a_request_reads_the_same_decision_and_carries_only_a_string() -> None:
    """What ``Task.__call__`` does to a request (a new Context from the old one's
    attributes): the copy reads the Decision; its headers hold no trace of it; the
    handle it carries names nothing once the original request is gone."""
    decision = Decision(allowed=True, remaining=0, retry_after=0.0, reset_after=1.0)
    original = Context({"id": "t1", "task": "x", "retries": 0})
    assert getattr(original, DECISION_ATTR) is None
    setattr(original, DECISION_ATTR, decision)
    copy = Context(**vars(original))
    assert getattr(copy, DECISION_ATTR) is decision
    assert copy.headers is None  # nothing of the limiter's became a custom header
    assert json.dumps(vars(copy))  # every attribute on the request is serializable
    handle = vars(copy)[DECISION_ATTR]
    del original
    gc.collect()
    assert getattr(copy, DECISION_ATTR) is None
    assert getattr(Context({DECISION_ATTR: handle}), DECISION_ATTR) is None
