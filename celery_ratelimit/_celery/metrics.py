"""Metrics: Prometheus counters and a Celery ``task-ratelimited`` event, both optional.

Prometheus (``pip install 'celery-ratelimit[metrics]'``, then
``app.conf.ratelimit_metrics = True``): every decision a worker makes is recorded in
``prometheus_client``'s default registry, labelled by limit name (``Limit.label``):

- ``celery_ratelimit_allowed_total`` (a concurrency turn handed over included),
  ``celery_ratelimit_denied_total``, ``celery_ratelimit_deferred_total``,
  ``celery_ratelimit_redis_errors_total``, ``celery_ratelimit_paused_total``,
  ``celery_ratelimit_late_starts_total`` (grants read too late to start on, restamped)
- ``celery_ratelimit_decision_seconds``: latency of one limiter call (one round trip),
  failed and timed-out calls included
- ``celery_ratelimit_backlog_drains_at_seconds``: when the last slot reserved under a
  limit is due, in Redis time (the drain time is that minus ``time()``)
- ``celery_ratelimit_reservations``: slots reserved and not yet used. A reservation is
  made by the worker that deferred a task and used by whichever worker runs it, so one
  process's value can be negative; ``sum by (limit)`` over all workers is the count.
- ``celery_ratelimit_parked``, ``celery_ratelimit_paused_keys``,
  ``celery_ratelimit_overrides``: copies waiting in the park, keys paused, keys with a
  rate override in force; read from Redis by each node every ``gauges.EVERY`` seconds
  (no label: counts, never a series per key)
- ``celery_ratelimit_declared_rate`` and ``celery_ratelimit_effective_rate``: an
  adapting limit's (``Limit(adapt=True)``) declared rate and the rate in force on every
  worker (lower after an upstream's 429s), in units a second. A process reads the
  effective rate from Redis on a decision of that limit at most once every
  :data:`RATE_REFRESH` seconds (one ``HGET``; a limit that does not adapt costs none).

``prometheus_client`` is imported the first time a worker with the setting on makes a
decision, never otherwise; when it is not installed, one warning is logged and the
metrics are off. With the setting off (the default) a decision costs one ``is None``
check more. Exposing the registry is the application's choice (``start_http_server``
in a ``worker_init`` handler; prefork pools need prometheus_client's multiprocess
mode, ``PROMETHEUS_MULTIPROC_DIR``).

The ``task-ratelimited`` event (fields ``key``, ``countdown``, ``deferrals``,
``reserved``) is sent through ``Task.send_event`` on every deferral, so that Flower and
other event monitors see deferrals, but only when the worker sends task events
(``celery worker -E`` or ``worker_send_task_events = True``) and the task's
``send_events`` is true: ``Task.send_event`` itself publishes whether or not anyone
listens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

from celery import signals

from .._engine.base import ACQUIRE, CONFIRM, RESERVE, RESTAMP
from .._engine.decision import Decision
from .._engine.layout import EFF_FIELD, effective, settings_of
from .._engine.limit import AnyLimit, Limit

logger = logging.getLogger("celery_ratelimit")

#: Event type sent on each deferral.
EVENT = "task-ratelimited"
#: Histogram buckets for one decision (one Redis round trip), seconds.
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

#: A process reads an adapting limit's effective rate at most this often (seconds).
RATE_REFRESH = 1.0

#: The app attribute caching whether the app records metrics (a Metrics or False).
_APP_ATTR = "_ratelimit_metrics"


class Metrics:
    """The Prometheus collectors, created once per process in the default registry."""

    def __init__(self, prometheus: Any) -> None:
        # each name is celery_ratelimit_ and the name given (the module's docstring lists
        # them whole); most collectors count per limit
        named = {"namespace": "celery_ratelimit"}
        counter = partial(prometheus.Counter, labelnames=["limit"], **named)
        gauge = partial(prometheus.Gauge, labelnames=["limit"], **named)
        self.allowed = counter("allowed", "Calls the shared limit let run.")
        self.denied = counter("denied", "Calls denied by the shared limit (reserved or not).")
        self.deferred = counter("deferred", "Tasks published again for later.")
        self.late_starts = counter(
            "late_starts", "Grants read too late to start on, and checked again (restamped)."
        )
        self.paused = counter(
            "paused", "Pauses of a limit's keys: a task body raised UpstreamRateLimited."
        )
        self.redis_errors = counter("redis_errors", "Decisions that failed on Redis.")
        self.latency = prometheus.Histogram(
            "decision_seconds",
            "Latency of one limiter decision (one Redis round trip).",
            buckets=LATENCY_BUCKETS,
            **named,
        )
        self.reservations = gauge(
            "reservations",
            "Reserved slots not yet used (sum over all workers).",
            multiprocess_mode="livesum",
        )
        self.drains_at = gauge(
            "backlog_drains_at_seconds",
            "When the last slot reserved under a limit is due (Redis time, seconds since "
            "the epoch): its backlog has drained then. Minus time(): the drain time.",
            multiprocess_mode="max",
        )
        # what was read last, by any node: the rates in force, and (with no label) what
        # Redis holds, read by each node every few seconds (see ``gauges``)
        latest = partial(gauge, multiprocess_mode="livemostrecent")
        self.declared_rate = latest(
            "declared_rate", "The declared rate of an adapting limit, units a second."
        )
        self.effective_rate = latest(
            "effective_rate",
            "The rate in force of an adapting limit (Limit(adapt=True)) on every worker: "
            "the declared rate, or less after an upstream's 429s; units a second.",
        )
        held = partial(latest, labelnames=())
        self.parked = held(
            "parked",
            "Deferred copies waiting in the park (the limiter's Redis), all brokers' nodes.",
        )
        self.paused_keys = held(
            "paused_keys",
            "Keys paused now (an upstream's 429, Limiter.pause, the CLI or the page).",
        )
        self.overrides = held(
            "overrides",
            "Keys with a rate override in force (the CLI, the page, Limiter.override).",
        )
        self._rates_read: dict[str, float] = {}  # label -> time.monotonic() of the read
        self._drains_at: dict[str, float] = {}  # label -> the latest slot reserved here

    def decision(
        self, limits: Iterable[AnyLimit], decision: Decision, seconds: float, runs: bool, mode: str
    ) -> None:
        """Record one decision: its latency, and allowed (``runs``) or denied per limit.

        ``mode`` is what was asked (``base.CONFIRM``, ...): a confirmed reservation that
        runs is no longer
        pending; a held one not yet due is no denial.
        """
        self.latency.observe(seconds)
        if mode == RESTAMP:
            return  # the same call again: counted by its first decision (and late_start)
        if decision.reserved and mode in (ACQUIRE, RESERVE):
            # a new reservation: it leaves the gauge when its call runs (confirmed, or
            # handed its turn) or gives it back; the latest one is when the backlog drains
            for limit in limits:
                self.reservations.labels(limit.label).inc()
                last = max(decision.at, self._drains_at.get(limit.label, 0.0))
                self._drains_at[limit.label] = last
                self.drains_at.labels(limit.label).set(last)
        confirmed = mode == CONFIRM
        if runs:
            for limit in limits:
                self.allowed.labels(limit.label).inc()
                if confirmed:
                    self.reservations.labels(limit.label).dec()
        elif not (confirmed and decision.reserved):
            for limit in (decision.limit,) if decision.limit is not None else limits:
                self.denied.labels(limit.label).inc()

    def rates(self, limiter: Any, keys: Sequence[str], limits: Sequence[AnyLimit]) -> None:
        """Set the declared and effective rates of the adapting ``limits`` (on the escaped
        ``keys``, one per limit) from Redis, each at most every :data:`RATE_REFRESH`
        seconds in this process. Never raises: a metric must not cost the task."""
        now = time.monotonic()
        due = [
            (limit, i)
            for i, limit in enumerate(limits)
            if isinstance(limit, Limit)
            and limit.adapt
            and now - self._rates_read.get(limit.label, -RATE_REFRESH) >= RATE_REFRESH
        ]
        if not due:
            return
        try:
            names = limiter.keys_for(list(keys), limits)
            for limit, i in due:
                self._rates_read[limit.label] = now
                rate = limit.fixed_rate
                algorithm, window = names[i].rsplit(":", 2)[1:]
                field = f"{EFF_FIELD}{algorithm}:{window}"
                value = limiter.client.hget(settings_of(names[i]), field)
                most = rate.limit
                if value is not None:
                    at = int(time.time() * 1_000_000)
                    most = max(min(most, effective(value, rate.window_us, at)), 1)
                per_second = 1_000_000 / rate.window_us
                self.declared_rate.labels(limit.label).set(rate.limit * per_second)
                self.effective_rate.labels(limit.label).set(most * per_second)
        except Exception as exc:  # a metric must never cost the task
            logger.debug("ratelimit: could not read the effective rates: %s", exc)

    def handed(self, limits: Iterable[AnyLimit]) -> None:
        """A waiting call was handed its turn (no decision asked for): it runs, on the
        reservation its deferral made."""
        for limit in limits:
            self.allowed.labels(limit.label).inc()
            self.reservations.labels(limit.label).dec()

    def deferral(self, limits: Iterable[AnyLimit], denied_by: AnyLimit | None) -> None:
        """Record one deferral, against the limit that denied it (else every limit)."""
        _count(self.deferred, (denied_by,) if denied_by is not None else limits)

    def released(self, limits: Iterable[AnyLimit]) -> None:
        """A reservation given back unused (its task expires first, or gives up)."""
        for limit in limits:
            self.reservations.labels(limit.label).dec()

    def pause(self, limits: Iterable[AnyLimit]) -> None:
        _count(self.paused, limits)

    def late_start(self, limits: Iterable[AnyLimit]) -> None:
        _count(self.late_starts, limits)

    def redis_error(self, limits: Iterable[AnyLimit]) -> None:
        _count(self.redis_errors, limits)


def _count(counter: Any, limits: Iterable[AnyLimit]) -> None:
    """One more on the per-limit ``counter`` for each of ``limits``."""
    for limit in limits:
        counter.labels(limit.label).inc()


_metrics: Metrics | None = None


def _load() -> Metrics | None:
    global _metrics
    if _metrics is None:
        try:
            import prometheus_client
        except ImportError:
            logger.warning(
                "ratelimit_metrics is on but prometheus_client is not installed "
                "(pip install 'celery-ratelimit[metrics]'); metrics are off"
            )
            return None
        _metrics = Metrics(prometheus_client)
    return _metrics


def metrics_for(app: Any) -> Metrics | None:
    """The collectors if ``app.conf.ratelimit_metrics`` is on, else None (cached per app)."""
    cached = app.__dict__.get(_APP_ATTR)
    if cached is None:
        from .settings import setting

        cached = (_load() if setting("ratelimit_metrics", app) else None) or False
        app.__dict__[_APP_ATTR] = cached
    return cached or None


#: Whether this worker sends task events (``-E``); set by ``worker_init``, inherited
#: by the pool's forked processes. None outside a worker: ``worker_send_task_events``.
_task_events: bool | None = None


def _record_task_events(sender: Any = None, **_: Any) -> None:
    global _task_events
    _task_events = bool(getattr(sender, "task_events", False))


signals.worker_init.connect(_record_task_events, weak=False)


def send_deferral_event(
    task: Any, key: str, countdown: float, deferrals: int, reserved: bool, why: str = "limit"
) -> None:
    """Send ``task-ratelimited`` if the worker sends task events; never raises.

    ``why``: ``"limit"`` (a rate limit), ``"concurrency"`` (waiting for a slot),
    ``"paused"`` (its key is paused), ``"upstream"`` (its body raised
    ``UpstreamRateLimited``) or ``"redis"`` (the limiter's Redis failed: the policy
    ``"defer"``)."""
    enabled = _task_events
    if enabled is None:
        enabled = bool(task.app.conf.worker_send_task_events)
    if not enabled or not getattr(task, "send_events", True):
        return
    try:
        task.send_event(
            EVENT,
            retry=False,
            key=key,
            countdown=round(countdown, 6),
            deferrals=deferrals,
            reserved=reserved,
            why=why,
        )
    except Exception as exc:  # a monitoring event must never cost the task
        logger.debug("ratelimit: could not send %s for %s: %s", EVENT, task.name, exc)


__all__ = ["EVENT", "Metrics", "metrics_for", "send_deferral_event"]
