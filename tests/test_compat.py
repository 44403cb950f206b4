"""The private accesses of ``_compat``: each is found on every Celery the matrix runs
(so a release that moves one fails here first), and each public fallback gives a task
the same limits. Real Celery apps; the worker-level fallbacks run on three real nodes
in test_celery_nodes.py (``CELERY_RATELIMIT_PUBLIC_ONLY=1``)."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import pytest
from celery import Celery, shared_task
from celery.worker.request import Request

from celery_ratelimit import Limit, ratelimit
from celery_ratelimit._celery import compat as _compat
from celery_ratelimit._celery.plan import plan_for


def test_every_private_path_is_found_on_this_celery() -> None:
    @shared_task
    def probe() -> None: ...

    assert _compat.shared_task_function(probe) is probe.__wrapped__
    assert _compat.task_proxy_parts(probe) == (probe.__wrapped__, None, None)
    lazy = Celery(f"lazy-{uuid.uuid4().hex[:6]}", set_as_current=False)

    def body(self: Any) -> None: ...

    promise = lazy.task(bind=True, name="probe.bound", shared=False)(body)
    assert _compat.task_proxy_parts(promise) == (body, "probe.bound", True)
    assert not lazy.finalized
    assert _compat.finalized_apps() is not None
    app = Celery(f"probe-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.finalize()
    assert app in _compat.finalized_apps()  # type: ignore[operator]


def _shared_limited_task(name: str) -> Any:
    def body(i: int) -> int:
        return i

    body.__name__ = name
    body.__qualname__ = name
    return ratelimit("7/s", key=f"{name}:{{i}}")(shared_task(body))


@pytest.mark.parametrize("public_only", [False, True])
def test_ratelimit_above_shared_task_gives_every_app_the_same_limits(
    monkeypatch: pytest.MonkeyPatch, public_only: bool
) -> None:
    monkeypatch.setattr(_compat, "PUBLIC_ONLY", public_only)
    name = f"shared_{uuid.uuid4().hex[:8]}"
    _shared_limited_task(name)
    app = Celery(f"compat-{name}")  # the current app, as a worker's is
    app.loader.import_default_modules()  # what a worker (and the CLI) do at start
    task = next(t for n, t in app.tasks.items() if n.endswith(name))
    plan = plan_for(task)
    assert plan is not None
    assert plan.limits == (Limit("7/s", key=f"{name}:{{i}}"),)
    keys, costs, _ = plan.resolve((3,), {})
    assert (list(keys), costs) == ([f"{name}:3"], (1,))


def test_a_received_eta_is_moved_only_through_the_private_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = Celery(f"eta-{uuid.uuid4().hex[:6]}", set_as_current=False)

    @app.task
    def noop() -> None: ...

    sent = datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)
    message = _message(app, noop.name, sent)
    moved = sent - datetime.timedelta(seconds=2)

    request = Request(message, app=app, task=noop)
    assert _compat.set_received_eta(request, moved)
    assert request.eta == moved

    monkeypatch.setattr(_compat, "PUBLIC_ONLY", True)
    request = Request(message, app=app, task=noop)
    assert not _compat.set_received_eta(request, moved)
    assert request.eta == sent  # left as the sender wrote it


def _message(app: Celery, name: str, eta: datetime.datetime) -> Any:
    from kombu.message import Message

    headers = {
        "lang": "py",
        "task": name,
        "id": str(uuid.uuid4()),
        "eta": eta.isoformat(),
        "retries": 0,
        "ratelimit_deferrals": 1,
    }
    return Message(
        body=b'[[], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]',
        headers=headers,
        content_type="application/json",
        content_encoding="utf-8",
        delivery_info={"exchange": "", "routing_key": "celery"},
    )
