"""Settings: every ``ratelimit_*`` option resolved in one place, and the per-process limiter.

Resolution order, for every option: call option (a message header of the same name,
``task.apply_async(..., headers={"ratelimit_max_deferrals": 3})``) > the task's own
option (``@app.task(base=RateLimitedTask, ratelimit_max_deferrals=3)`` or the
``ratelimit`` decorator's keyword) > ``app.conf`` > the library default.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from celery import signals

from .._engine.base import DEFAULT_PREFIX
from .._engine.client import check_url, host_list, redacted
from .._engine.exceptions import InvalidLimit, InvalidRedisURL
from .._engine.limit import REDIS_ERROR_POLICIES
from .._engine.limiter import Limiter

DEFAULT_REDIS_URL = "redis://localhost:6379/0"

#: Every setting and its default. ``ratelimit_redis_url`` None means: the broker URL
#: when it is redis:// or rediss://, else DEFAULT_REDIS_URL.
DEFAULTS: dict[str, Any] = {
    "ratelimit_redis_url": None,
    "ratelimit_key_prefix": DEFAULT_PREFIX,
    "ratelimit_rules": {},
    "ratelimit_on_redis_error": "defer",
    # Longest single deferral, seconds. An ETA message is held unacknowledged by the
    # worker that fetched it: past the Redis transport's visibility_timeout (1 h by
    # default) it is delivered a second time, past RabbitMQ's consumer_timeout (30 min)
    # the channel is closed. Ten minutes stays well inside both.
    "ratelimit_max_countdown": 600.0,
    "ratelimit_max_deferrals": None,
    "ratelimit_reserve": True,
    # Slack, seconds (at most 4% of a window): slots are placed in windows this much
    # wider, starts are checked in windows half of it wider (a body starts a varying
    # moment after its check), so a task starting a little after its slot costs no
    # wait (see lua/start.lua).
    "ratelimit_guard": 0.03,
    # Countdown of a deferral made because Redis could not be reached (policy "defer").
    "ratelimit_redis_error_countdown": 1.0,
    # Seconds between two "Redis unavailable, running unlimited" warnings (policy "allow").
    "ratelimit_warning_interval": 60.0,
    # Record Prometheus metrics (needs the `metrics` extra); see metrics.py.
    "ratelimit_metrics": False,
    # A deferral longer than this (seconds) waits in the limiter's Redis, not in a
    # worker's memory, until moments before it is due (see park.py); None: every copy
    # goes to the broker. "auto": PARK_AFTER when the limiter's Redis is the broker's
    # server (a parked copy is then as durable as a published one), else None.
    "ratelimit_park_after": "auto",
    # Lease of a concurrency slot (seconds) for a task without a time_limit: a body
    # renews it while it runs; a lost worker's slot comes back when it runs out.
    "ratelimit_concurrency_lease": 300.0,
}

#: ``ratelimit_park_after`` under "auto", when the limiter's Redis is the broker's.
PARK_AFTER = 2.0

#: Shortest ``ratelimit_park_after`` (seconds): a parked copy is published a second
#: before it is due by a mover that looks twice a second (see park.py).
MIN_PARK_AFTER = 1.5


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidLimit(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidLimit(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _max_deferrals(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidLimit(f"{name} must be None or an int >= 0, got {value!r}")
    return value


def _policy(name: str, value: Any) -> str:
    if value not in REDIS_ERROR_POLICIES:
        raise InvalidLimit(
            f"{name} must be one of {', '.join(REDIS_ERROR_POLICIES)}, got {value!r}"
        )
    return str(value)


def _string(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidLimit(f"{name} must be a non-empty string, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidLimit(f"{name} must be True or False, got {value!r}")
    return value


def _park_after(name: str, value: Any) -> float | str | None:
    if value is None or value == "auto":
        return value  # type: ignore[no-any-return]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not MIN_PARK_AFTER <= value < math.inf
    ):
        raise InvalidLimit(
            f"{name} must be 'auto', None or a number of seconds >= {MIN_PARK_AFTER:g}, "
            f"got {value!r}"
        )
    return float(value)


def _rules(name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidLimit(
            f"{name} must be a mapping of task name patterns to limits, got {value!r}"
        )
    return value


def _redis_url(name: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        check_url(value)
    except InvalidRedisURL as exc:
        raise InvalidRedisURL(f"{name}: {exc}") from None
    return str(value)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "ratelimit_redis_url": _redis_url,
    "ratelimit_key_prefix": _string,
    "ratelimit_rules": _rules,
    "ratelimit_on_redis_error": _policy,
    "ratelimit_max_countdown": _positive_number,
    "ratelimit_max_deferrals": _max_deferrals,
    "ratelimit_reserve": _flag,
    "ratelimit_guard": _non_negative,
    "ratelimit_redis_error_countdown": _positive_number,
    "ratelimit_warning_interval": _positive_number,
    "ratelimit_metrics": _flag,
    "ratelimit_park_after": _park_after,
    "ratelimit_concurrency_lease": _positive_number,
}

#: The options a task may set (``@app.task(ratelimit_max_deferrals=3)``, the decorator's
#: ``max_deferrals=3``), and but the last a call too (a message header of the same name);
#: the other settings are app-wide (``app.conf`` only).
TASK_OPTIONS = (
    "ratelimit_on_redis_error",
    "ratelimit_max_countdown",
    "ratelimit_max_deferrals",
    "ratelimit_reserve",
    "ratelimit_guard",
    "ratelimit_redis_error_countdown",
    "ratelimit_concurrency_lease",
)

_UNSET = object()


def setting(name: str, app: Any, task: Any = None, request: Any = None) -> Any:
    """The value of option ``name``: call option > task option > app.conf > default.

    Raises:
        InvalidLimit: the value found is invalid (naming the option and the value).
    """
    value: Any = _UNSET
    if request is not None:
        value = getattr(request, name, _UNSET)
    if value is _UNSET and task is not None:
        value = getattr(task, name, _UNSET)
    if value is _UNSET:
        value = app.conf.get(name, _UNSET)
    if value is _UNSET:
        value = DEFAULTS[name]
    return _CHECKS[name](name, value)


def check_app_settings(app: Any) -> None:
    """Validate every ``ratelimit_*`` key of ``app.conf`` (unknown names included)."""
    for name in list(app.conf.keys()):
        if name.startswith("ratelimit_"):
            if name not in DEFAULTS:
                raise InvalidLimit(
                    f"unknown setting {name!r}: expected one of {', '.join(sorted(DEFAULTS))}"
                )
            setting(name, app)


def check_task_options(cls: Any, what: str) -> None:
    """Validate the ``ratelimit_*`` options a task class sets itself
    (``@app.task(ratelimit_max_deferrals=3)``), when the class is built.

    Raises:
        InvalidLimit: an unknown option, or a bad value (naming ``what``, the option and
            the value).
    """
    for name, value in list(vars(cls).items()):
        if not name.startswith("ratelimit_"):
            continue
        if name not in TASK_OPTIONS:
            known = "an app-wide setting (app.conf)" if name in DEFAULTS else "unknown"
            raise InvalidLimit(
                f"{what}: option {name!r} is {known}: a task sets one of {', '.join(TASK_OPTIONS)}"
            )
        try:
            _CHECKS[name](name, value)
        except InvalidLimit as exc:
            raise InvalidLimit(f"{what}: {exc}") from None


def redis_url(app: Any) -> str:
    """``ratelimit_redis_url``, else the broker URL when it is Redis, else localhost."""
    url = setting("ratelimit_redis_url", app)
    if url:
        return str(url)
    broker = app.conf.broker_url
    if isinstance(broker, str) and broker.startswith(("redis://", "rediss://")):
        return broker.split(";")[0]
    return DEFAULT_REDIS_URL


def redis_url_source(app: Any) -> str:
    """Where :func:`redis_url` found the URL, for a message."""
    if setting("ratelimit_redis_url", app):
        return "from ratelimit_redis_url"
    if redis_url(app) == DEFAULT_REDIS_URL:
        return "ratelimit_redis_url is not set: the default"
    return "ratelimit_redis_url is not set: the broker's URL"


def park_after(app: Any) -> float | None:
    """``ratelimit_park_after`` in seconds, "auto" worked out (None: parking is off)."""
    value = setting("ratelimit_park_after", app)
    if value != "auto":
        return value  # type: ignore[no-any-return]
    return PARK_AFTER if _same_as_broker(app) else None


def park_undecided(app: Any) -> str | None:
    """Why "auto" could not tell whether the limiter's Redis is the broker's (parking is
    then off), or None when it could, or when ``ratelimit_park_after`` is set."""
    if setting("ratelimit_park_after", app) != "auto" or _same_as_broker(app) is not None:
        return None
    return (
        f"cannot tell whether the limiter's Redis {redacted(redis_url(app))} is the "
        f"broker's server {redacted(_broker(app))}, so deferred tasks are not parked in it; "
        f"set ratelimit_park_after = {PARK_AFTER:g} if it is, or None to silence this"
    )


def _broker(app: Any) -> Any:
    broker = app.conf.broker_url
    return ";".join(broker) if isinstance(broker, (list, tuple)) else broker


def _same_as_broker(app: Any) -> bool | None:
    options = app.conf.broker_transport_options or {}
    return same_server(redis_url(app), _broker(app), options.get("master_name"))


def same_server(url: str, broker: Any, master_name: Any = None) -> bool | None:
    """Is the Redis of ``url`` the server of the broker URL ``broker`` (any database)?

    Every URL form of ``client`` is compared by its parsed nodes: a Cluster is the
    broker's server when the broker is one of its nodes; Sentinel, when the broker asks
    the same sentinels for the same service (``master_name``, kombu's transport option).
    None: it cannot be told without asking the servers (a Sentinel service against a
    plain server URL, a Cluster none of whose listed nodes is the broker).
    """
    mine = servers(url)
    theirs = _broker_servers(broker, master_name)
    if mine is None or theirs is None:
        return False if theirs is None else None
    (kind, service, nodes), (their_kind, their_service, their_nodes) = mine, theirs
    shared = bool(nodes & their_nodes)
    if kind == their_kind == "sentinel":
        if service is None or their_service is None:
            return None
        return service == their_service and shared
    if kind == their_kind:
        return shared
    if kind == "cluster" and their_kind == "server":
        return True if shared else None
    if "unix" in (kind, their_kind):
        return False
    return None


Servers = tuple[str, "str | None", frozenset[Any]]


def servers(url: str) -> Servers | None:
    """``(kind, service, nodes)`` of a limiter URL: kind ``server``, ``unix``, ``cluster``
    or ``sentinel`` (whose service is the master's name); None if it is none of these."""
    try:
        scheme = check_url(url)
    except InvalidRedisURL:
        return None
    parts = urlsplit(url)
    if scheme == "unix":
        return ("unix", None, frozenset([parts.path]))
    if scheme in ("redis", "rediss"):
        return ("server", None, frozenset([(_host(parts.hostname), parts.port or 6379)]))
    _user, _password, hosts = host_list(parts.netloc, url)
    nodes = frozenset((_host(h), p) for h, p in hosts)
    if scheme.endswith("+cluster"):
        return ("cluster", None, nodes)
    service = next((p for p in parts.path.split("/") if p), None)
    return ("sentinel", service, nodes)


def _broker_servers(broker: Any, master_name: Any) -> Servers | None:
    """What :func:`servers` tells of a Celery broker URL (kombu's forms: ``redis://``,
    ``rediss://``, ``unix://``, ``redis+socket://``, ``sentinel://h:p;sentinel://h:p``
    with the service in the ``master_name`` transport option); None if not Redis."""
    if not isinstance(broker, str):
        return None
    urls = [part.strip() for part in broker.split(";") if part.strip()]
    if not urls:
        return None
    first = urls[0]
    if first.startswith("redis+socket://"):
        return ("unix", None, frozenset([urlsplit(first).path]))
    if first.startswith(("redis://", "rediss://", "unix://")):
        return servers(first)
    if not first.startswith("sentinel://"):
        return None
    nodes = set()
    for part in urls:
        parts = urlsplit(part)
        with contextlib.suppress(ValueError):
            nodes.add((_host(parts.hostname), parts.port or 26379))
    service = master_name if isinstance(master_name, str) and master_name else None
    return ("sentinel", service, frozenset(nodes))


def _host(name: str | None) -> str:
    host = (name or "localhost").lower()
    return "127.0.0.1" if host == "localhost" else host


_limiters: dict[tuple[int, str, str], Limiter] = {}


def limiter_for(app: Any) -> Limiter:
    """This process's limiter for ``app``, created on first use.

    Worker processes fork; a Redis connection must never be shared across a fork, so
    clients are keyed by process id and dropped by ``worker_process_init``.
    """
    url = redis_url(app)
    prefix = setting("ratelimit_key_prefix", app)
    key = (os.getpid(), url, prefix)
    limiter = _limiters.get(key)
    if limiter is None:
        limiter = _limiters[key] = Limiter.from_url(url, prefix=prefix)
    return limiter


def _fresh_clients_after_fork(**_: Any) -> None:
    _limiters.clear()


signals.worker_process_init.connect(_fresh_clients_after_fork, weak=False)
