"""A deferral as Celery's own tracer runs it in a pool process: real Redis, real publish.

Celery turns the ``Retry`` that ends a deferred execution into an ``ExceptionInfo``
that copies every frame of its traceback, listing each frame's code positions: the
``Retry`` is raised again from ``before_start`` with a fresh traceback, so that the
copy holds the tracer's frame and ``before_start`` only.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.app.trace import build_tracer

from celery_ratelimit import Limit, RateLimitedTask, install, ratelimit


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    app = Celery("trace", broker=redis_url, set_as_current=False)
    app.conf.ratelimit_redis_url = redis_url
    app.conf.ratelimit_key_prefix = f"trace-{uuid.uuid4().hex[:8]}"
    app.conf.task_default_queue = f"trace-{uuid.uuid4().hex[:8]}"
    # copies go to the broker at once (no mover runs here), as the test reads them there
    app.conf.ratelimit_park_after = None
    yield app
    redis.Redis.from_url(app.conf.broker_url).delete(app.conf.task_default_queue)


def run_in_tracer(app: Celery, task: Any) -> Any:
    """Run one call of ``task`` through the tracer a pool process uses."""
    tracer = build_tracer(task.name, task, app=app, hostname="node@test")
    task_id = str(uuid.uuid4())
    request = {
        "id": task_id,
        "task": task.name,
        "args": [],
        "kwargs": {},
        "delivery_info": {"routing_key": app.conf.task_default_queue, "exchange": ""},
        "hostname": "node@test",
        "headers": {},
        "retries": 0,
        "is_eager": False,
    }
    return tracer(task_id, (), {}, request)


@pytest.mark.parametrize("form", ["base class", "decorator", "install"])
def test_a_denied_call_is_published_again_and_its_retry_carries_two_frames(
    app: Celery, form: str
) -> None:
    if form == "base class":

        @app.task(base=RateLimitedTask, ratelimit=Limit("1/h", key="k"), shared=False)
        def limited() -> None: ...

    elif form == "decorator":

        @ratelimit(Limit("1/h", key="k"))
        @app.task(shared=False)
        def limited() -> None: ...

    else:
        app.conf.ratelimit_rules = {"*limited": Limit("1/h", key="k")}

        @app.task(shared=False)
        def limited() -> None: ...

        install(app)
    app.finalize()
    task = app.tasks[limited.name]
    seen: list[Any] = []

    def on_retry(einfo: Any = None, **_: Any) -> None:
        seen.append(einfo)

    signals.task_retry.connect(on_retry, weak=False)
    try:
        first = run_in_tracer(app, task)
        second = run_in_tracer(app, task)
    finally:
        signals.task_retry.disconnect(on_retry)
    assert first.info is None  # ran
    assert second.info.state == "RETRY"
    broker = redis.Redis.from_url(app.conf.broker_url)
    assert broker.llen(app.conf.task_default_queue) == 1  # the copy, for later
    (einfo,) = seen
    frames = []
    tb = einfo.tb
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames == ["trace_task", "before_start"]
