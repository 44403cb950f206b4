"""One key name, one budget: a key's Redis names depend on the key's string alone,
however it is reached (a task's template, a key function, a string given to
``Limiter``/``AsyncLimiter``, the CLI), and every door acts on the same budget."""

from __future__ import annotations

import asyncio
import string
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_ratelimit import AsyncLimiter, Limit, Limiter, Rate, RateLimitedTask
from celery_ratelimit._celery.plan import plan_for
from celery_ratelimit._engine.keys import escape_key, hash_tag
from celery_ratelimit._engine.layout import (
    OVERRIDES_INDEX,
    PAUSED_INDEX,
    index_key,
    key_base,
    settings_of,
)
from celery_ratelimit._tools.cli import run_set
from celery_ratelimit._tools.explain import explain, format_explanation
from celery_ratelimit._tools.ops import key_settings, known_limits, status
from celery_ratelimit._tools.report import format_status

RATE = Limit("5/m")
SHAPES = ("api:{k}", "yt:quota:{k}", "{k}:erp")


def names_under(client: redis.Redis, prefix: str) -> set[str]:
    return {k.decode() for k in client.scan_iter(f"{prefix}:*")}


def task_keys(limiter: Limiter, template: str, values: dict[str, Any]) -> tuple[str, list[str]]:
    """(the key as rendered, the Redis keys) of a task's decision for ``values``."""
    app = Celery(f"keys-{uuid.uuid4().hex[:6]}", set_as_current=False)

    def body(**kwargs: Any) -> None: ...

    task = app.task(
        body,
        name="keys.t",
        base=RateLimitedTask,
        ratelimit=Limit("5/m", key=template),
        shared=False,
    )
    app.finalize()
    plan = plan_for(task)
    assert plan is not None
    call = plan.resolve((), values)
    return call.keys[0], limiter.keys_for(list(call.keys), call.limits)


segment = st.text(string.ascii_lowercase + string.digits + "_.-", min_size=1, max_size=8)
value = st.one_of(
    st.text(string.ascii_letters + string.digits, min_size=1, max_size=10),
    st.text(min_size=1, max_size=30),
)


@st.composite
def templates(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A template of 1-4 segments, some of them fields, and values for its fields."""
    parts = draw(st.lists(st.one_of(segment, st.none()), min_size=1, max_size=4))
    if all(p is not None for p in parts):
        parts[draw(st.integers(0, len(parts) - 1))] = None
    names = [f"f{i}" for i, p in enumerate(parts) if p is None]
    template = ":".join(p if p is not None else f"{{f{i}}}" for i, p in enumerate(parts))
    return template, {n: draw(value) for n in names}


@pytest.fixture(scope="module")
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=templates())
def test_every_limiter_method_given_the_rendered_key_touches_the_tasks_keys(
    case: tuple[str, dict[str, Any]], redis_url: str
) -> None:
    template, values = case
    prefix = f"kn-{uuid.uuid4().hex[:8]}"
    limiter = Limiter.from_url(redis_url, prefix=prefix)
    try:
        rendered, keys = task_keys(limiter, template, values)
        # the string a user gives: the key as status shows it; escaping it again is itself
        assert escape_key(rendered) == rendered
        if all(c.isascii() and c.isalnum() for v in values.values() for c in str(v)):
            assert rendered == template.format(**values)  # plain values: as written
        assert limiter.keys_for(rendered, RATE) == keys
        settings_key = settings_of(keys[0])
        assert keys[0].startswith(key_base(prefix, rendered) + ":")
        assert f"{{{hash_tag(rendered)}}}" in keys[0]
        # and the prefix's own indexes of paused and overridden keys (for the metrics)
        indexes = {index_key(prefix, which) for which in (PAUSED_INDEX, OVERRIDES_INDEX)}
        allowed = set(keys) | {k + ":r" for k in keys} | {settings_key} | indexes

        decision = limiter.acquire(rendered, RATE)
        assert decision.allowed and decision.token
        limiter.settle(decision.token, rendered, RATE, 2)
        assert not limiter.peek(rendered, RATE, cost=4).allowed  # 2 of 5 counted, 4 > 3
        assert not limiter.peek(list((rendered,)), RATE, cost=4).allowed
        limiter.override(rendered, "1/m", ttl=30)
        limiter.pause(rendered, 300)  # past the budget's next room
        limiter.observe(rendered, {"Retry-After": "1"}, RATE)
        assert names_under(limiter.client, prefix) <= allowed
        # the task's decision (its escaped keys) sees the pause set through the string
        assert limiter.peek([rendered], RATE).paused
        asyncio.run(_async_doors(redis_url, prefix, rendered, allowed))
        assert set(limiter.reset(rendered)) == {keys[0]}
    finally:
        for name in limiter.client.scan_iter(f"{prefix}:*"):
            limiter.client.delete(name)
        limiter.client.close()


async def _async_doors(url: str, prefix: str, rendered: str, allowed: set[str]) -> None:
    limiter = AsyncLimiter.from_url(url, prefix=prefix)
    try:
        assert (await limiter.peek(rendered, RATE)).paused
        await limiter.override(rendered, None)
        await limiter.pause(rendered, 30)
        await limiter.acquire(rendered, RATE)
        found = {k.decode() async for k in limiter.client.scan_iter(f"{prefix}:*")}
        assert found <= allowed
    finally:
        # redis-py 5.0.0 has close() only; later ones deprecate it for aclose()
        await getattr(limiter.client, "aclose", limiter.client.close)()


@pytest.mark.parametrize("override", ["3/m", "2/s"])  # of the limit's window, of another
@pytest.mark.parametrize("shape", SHAPES)
def test_the_cli_status_and_explain_see_the_tasks_budget_override_and_pause(
    shape: str, override: str, redis_url: str, limiter: Limiter
) -> None:
    app = Celery("keys-cli", set_as_current=False)
    app.conf.update(ratelimit_redis_url=redis_url, ratelimit_key_prefix=limiter.prefix)

    def call(k: str) -> None: ...

    task = app.task(call, base=RateLimitedTask, ratelimit=Limit("100/m", key=shape), shared=False)
    app.finalize()
    rendered, keys = task_keys(limiter, shape, {"k": "KEY1"})
    assert rendered == shape.format(k="KEY1")
    for _ in range(5):
        assert limiter.acquire([rendered], Limit("100/m")).allowed  # as the task's calls do
    run_set(app, None, None, rendered, override, None)
    limiter.pause(rendered, 30)
    (row,) = [r for r in status(limiter, known_limits(app)) if r.name.key == rendered]
    (settings_row,) = [r for r in key_settings(limiter) if r.key == rendered]
    peek_on = Limiter.from_url(redis_url, prefix=limiter.prefix)
    (line,) = explain(app, task.name, ["KEY1"], {}, peek_on).limits
    assert line.key == rendered and line.redis_key == keys[0] == row.name.redis_key
    assert row.override == line.state.override == settings_row.override == Rate.parse(override)
    assert row.remaining == line.state.remaining == 0
    assert settings_row.paused_for > 0
    if override == "3/m":  # counted over the same minute (5 used); a second's count moves
        assert (row.used, line.state.used) == (5, 5)
    # and both print it: used against the override, and the override named
    table = "\n".join(format_status([row], limiter.prefix, redis_url))
    lines = "\n".join(format_explanation(explain(app, task.name, ["KEY1"], {}, peek_on)))
    limit = Rate.parse(override).limit
    for text in (table, lines):
        assert f"/{limit} " in text and f"overridden {Rate.parse(override)}" in text.replace(
            "overridden:", "overridden"
        )
