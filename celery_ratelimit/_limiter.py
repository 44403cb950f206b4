"""Limiter: a Redis client plus the Lua scripts, answering with a :class:`Decision`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import redis

from ._client import HeldConnection, client_from_url
from ._decision import TOKEN_BYTES, Decision, token_bytes_of
from ._exceptions import InvalidLimit, LimiterUnavailable, RateLimitError
from ._failures import not_redis_error, redis_versions, translate, version_error
from ._keys import escape_key
from ._keys import escape_key as _escape
from ._layout import companions, keys_of, redis_key, script_keys, settings_key
from ._limit import Concurrency, Limit, LimitSpec, describe, rate_algorithm, to_limits
from ._scripts import DEFAULT_HORIZON, Shape, pause_numbers, shape, source
from ._upstream import seconds_from

#: Script modes (the first of the packed numbers, ARGV[2]); see the header of
#: lua/sliding_log.lua (and lua/gate.lua for RENEW and PAUSE).
ACQUIRE, RESERVE, PEEK, CONFIRM, RELEASE, RESTAMP, RENEW, PAUSE = 0, 1, 2, 3, 4, 5, 6, 7
#: Reply statuses.
DENIED, ALLOWED, RESERVED, NOT_YET_DUE, RELEASED, SPENT, STARTS_AT = 0, 1, 2, 3, 4, 5, 6

DEFAULT_PREFIX = "ratelimit"
#: Client defaults: a hung or refused Redis costs a task at most about this long.
DEFAULT_SOCKET_TIMEOUT = 2.0
DEFAULT_CONNECT_TIMEOUT = 2.0
#: How many call shapes (key, limits, cost, options) a limiter remembers what it sends for.
KEY_CACHE_SIZE = 4096

Client = Any  # redis.Redis or redis.cluster.RedisCluster
#: What a redis-py client raises (its Cluster client's own errors are no RedisError).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class Limiter:
    """Shared rate limits kept in Redis, decided atomically by one Lua script per call.

    Args:
        client: a ``redis.Redis`` (or ``RedisCluster``) client. Replies are read as
            integers, so ``decode_responses`` does not matter.
        prefix: first part of every key (``ratelimit`` by default), for ACLs and scans.

    Example::

        limiter = Limiter.from_url("redis://localhost:6379/0")
        d = limiter.acquire("yt:quota:key1", [Limit("9500/d"), Limit("100/m")], cost=100)
        if not d.allowed:
            time.sleep(d.retry_after)
    """

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        if not isinstance(prefix, str) or not prefix or escape_key(prefix) != prefix:
            raise InvalidLimit(f"key prefix must be a plain non-empty string, got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self._scripts = {
            "log": client.register_script(source("sliding_log")),
            "counter": client.register_script(source("sliding_counter")),
            "concurrency": client.register_script(source("concurrency")),
            "park": client.register_script(source("park")),  # see _park
        }
        self._cluster = hasattr(client, "get_nodes")
        self._checked = False
        held = HeldConnection.for_client(client)
        # the script's EVALSHA: on a connection held for it when the client allows
        self._send = held.call if held is not None else client.execute_command
        # the script's keys for (key, shape), worked out and checked once: escaping and
        # formatting are most of a decision's Python, and a process decides for few
        # distinct keys and shapes
        self._sends: dict[tuple[Any, Shape], tuple[list[str], bytes]] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
        socket_connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        **client_options: Any,
    ) -> Limiter:
        """A limiter on a new client for ``url``.

        ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://h:p,h:p/master/db``
        or ``redis+cluster://h:p,h:p`` (see ``_client``). Timeouts are bounded by default
        so that a hung Redis never hangs a worker; one retry (no backoff) absorbs a
        pooled connection that a Redis restart closed. Extra keyword arguments go to
        the redis-py client.
        """
        client = client_from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            **client_options,
        )
        return cls(client, prefix=prefix)

    # -- public API -----------------------------------------------------------------

    def acquire(
        self,
        key: str,
        limits: LimitSpec,
        cost: int = 1,
        *,
        reserve: bool = False,
        horizon: float = DEFAULT_HORIZON,
    ) -> Decision:
        """Count ``cost`` against every limit for ``key`` now, if all of them allow it.

        All or nothing: a denial by one limit consumes nothing from the others.

        Args:
            key: what shares the budget (``"yt:quota:key1"``); a limit with a plain
                string ``key`` of its own uses that instead.
            limits: a rate string, a :class:`Limit` or a list of them.
            cost: weight of this call, a positive int no greater than any limit.
            reserve: when denied, reserve the earliest future slot at which the cost
                fits (``Decision.reserved``), unless it lies beyond ``horizon`` seconds
                (more than 0, at most a year). Only the ``"log"`` algorithm reserves.

        Raises:
            InvalidLimit / InvalidRate / TypeError: bad limits or cost.
            LimiterUnavailable: Redis could not be reached (for now).
            LimiterMisconfigured: Redis refuses the limiter (a permission, a password,
                its version): the message names the fix.
        """
        mode = RESERVE if reserve else ACQUIRE
        return self._call(key, shape(to_limits(limits), cost, mode, horizon))

    def peek(self, key: str, limits: LimitSpec, cost: int = 1) -> Decision:
        """What :meth:`acquire` would answer now, without counting anything."""
        return self._call(key, shape(to_limits(limits), cost, PEEK))

    def confirm(
        self,
        token: str,
        key: str,
        limits: LimitSpec,
        cost: int = 1,
        *,
        horizon: float = DEFAULT_HORIZON,
    ) -> Decision:
        """Use the reservation ``token`` got from ``acquire(..., reserve=True)``.

        Allowed if its slot has come; ``reserved`` with the time left if not yet; if the
        reservation is gone (Redis restarted, key reset), competes again as ``acquire``
        with ``reserve=True``.

        Raises:
            InvalidLimit: ``token`` is not a token the limiter wrote, or a bad horizon.
        """
        token_bytes_of(token)
        return self._call(key, shape(to_limits(limits), cost, CONFIRM, horizon), token=token)

    def release(self, token: str, key: str, limits: LimitSpec, cost: int = 1) -> None:
        """Give back a reservation that will not be used (a revoked or expired task),
        and the concurrency slots (or turns in line) of ``token``: its body has ended.

        Raises:
            InvalidLimit: ``token`` is not a token the limiter wrote.
        """
        token_bytes_of(token)
        self._call(key, shape(to_limits(limits), cost, RELEASE), token=token)

    def renew(
        self,
        token: str,
        key: str | tuple[str, ...],
        limits: LimitSpec,
        *,
        lease: float | None = None,
    ) -> bool:
        """Extend the leases of the concurrency slots ``token`` holds to ``lease``
        seconds from now (default: each limit's own, else 300 s). False if a slot was
        no longer held (its lease had run out: another call may have taken it).

        Raises:
            InvalidLimit: ``token`` is not a token the limiter wrote.
        """
        token_bytes_of(token)
        slots = tuple(limit for limit in to_limits(limits) if isinstance(limit, Concurrency))
        if not slots:
            return True
        call = shape(slots, 1, RENEW, lease=lease)
        every, numbers = self._prepared(key, call)
        reply = self._script_reply("concurrency", every, token_bytes_of(token), numbers)
        return bool(reply[0] == 1)

    def pause(self, key: str, seconds: float | str | Any) -> float:
        """Grant nothing on ``key`` (every limit and concurrency limit of it) for
        ``seconds`` on every worker: an upstream answered 429. A number of seconds, a
        ``Retry-After`` value (seconds or an HTTP-date) or a datetime. Calls are then
        answered denied, or placed past the pause, with ``retry_after`` = the time left.
        A longer pause already in place stays. Returns the seconds the key is paused for.

        Raises:
            InvalidLimit: a bad key or ``seconds``.
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``_failures``).
        """
        if not isinstance(key, str) or not key:
            raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
        return self.pause_keys([_escape(key)], seconds_from(seconds))

    def pause_keys(self, escaped: Sequence[str], seconds: float) -> float:
        """:meth:`pause` for keys already escaped (one script call for all of them)."""
        keys = sorted({settings_key(self.prefix, k) for k in escaped})
        if seconds <= 0:
            return 0.0
        numbers = pause_numbers(min(seconds, 366 * 86_400.0), len(keys))
        reply = self._script_reply("concurrency", keys, os.urandom(TOKEN_BYTES), numbers)
        return float(reply[2]) / 1_000_000

    def reset(self, key: str, limits: LimitSpec | None = None) -> list[str]:
        """Forget everything counted for ``key`` under ``limits``, or under every window
        and algorithm of ``key`` when ``limits`` is None (what ``celery ratelimit reset
        KEY`` does). Returns the Redis keys deleted (their pending sets go with them).

        Raises:
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``_failures``).
        """
        try:
            if limits is None:
                keys = keys_of(self.client, self.prefix, key)
            else:
                keys = self.keys_for(key, limits)
            deleted = []
            for k in keys:
                self.client.delete(*companions(k))
                if self.client.delete(k):
                    deleted.append(k)
            return deleted
        except REDIS_ERRORS as exc:
            raise self.translate(exc, "a reset") from exc

    def check(self) -> None:
        """Check that Redis can serve this limiter: reachable, the credentials accepted,
        version 6.2 or newer (when the user may read ``INFO``), both scripts loaded.

        Run by the first decision of every limiter (so a worker meets a misconfigured
        Redis at its first task, with one clear error); again after a failure.

        Raises:
            LimiterMisconfigured: a cause that retrying cannot change, and its fix.
            LimiterUnavailable: Redis could not be reached (for now).
        """
        try:
            try:
                info = self.client.info("server")
            except redis.ResponseError:
                # a least-privilege user, or a service that renamed INFO: the scripts'
                # own errors will tell a server too old
                info = {}
            for version in redis_versions(info):
                too_old = version_error(version)
                if too_old is not None:
                    raise too_old
            for script in self._scripts.values():
                self.client.script_load(script.script)
        except REDIS_ERRORS as exc:
            error = self.translate(exc, "the limiter's first call")
            if isinstance(error, LimiterUnavailable) and isinstance(exc, redis.ConnectionError):
                # a reset or a garbled reply: is that port another service's?
                pool = getattr(self.client, "connection_pool", None)
                kwargs = getattr(pool, "connection_kwargs", None)
                timeout = (kwargs or {}).get("socket_connect_timeout") or 2.0
                error = not_redis_error(kwargs, timeout) or error
            raise error from exc
        self._checked = True

    def run_script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """The reply of a script of this limiter's besides the decision (``"park"``).

        Raises:
            redis.RedisError: as the script's call raised it (see :meth:`translate`).
        """
        return self._scripts[name](keys=keys, args=args)

    def translate(self, exc: Exception, doing: str) -> RateLimitError:
        """The library's exception for a redis-py one (see ``_failures``)."""
        kwargs = getattr(getattr(self.client, "connection_pool", None), "connection_kwargs", {})
        return translate(exc, doing, kwargs.get("username"), self.prefix)

    # -- shared by the Celery layer -------------------------------------------------

    def keys_for(self, key: str | Sequence[str], limits: LimitSpec) -> list[str]:
        """Redis keys for ``limits``. ``key`` is one code-given key for all limits (a
        limit's own plain ``key`` wins) or a list of already escaped keys, one per limit.
        """
        normalized = to_limits(limits)
        if not isinstance(key, str):
            if not isinstance(key, (list, tuple)):
                raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
            escaped = list(key)
            if len(escaped) != len(normalized):
                raise InvalidLimit(f"got {len(escaped)} keys for {len(normalized)} limits")
        else:
            escaped = []
            for limit in normalized:
                own = limit.key if isinstance(limit.key, str) else None
                if own is not None and limit.fields:
                    raise InvalidLimit(
                        f"Limit key {own!r} is a template; outside a task pass the "
                        "rendered key to acquire() instead"
                    )
                chosen = own or key
                if not isinstance(chosen, str) or not chosen:
                    raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
                escaped.append(escape_key(chosen))
        keys = [
            redis_key(self.prefix, k, limit) for k, limit in zip(escaped, normalized, strict=True)
        ]
        if len(set(keys)) != len(keys):
            # one sorted set cannot hold two budgets: the second would overwrite the first
            raise InvalidLimit(
                f"limits {describe(normalized)} put two budgets on the same Redis key "
                f"({', '.join(keys)}): give them different keys or windows"
            )
        return keys

    def _call(
        self,
        key: str | tuple[str, ...],
        shape: Shape,
        *,
        token: str | None = None,
        redis_keys: list[str] | None = None,
    ) -> Decision:
        """One decision of ``shape`` for ``key``: a code-given key, or a tuple of escaped
        keys, one per limit (as :meth:`keys_for` takes them); or, when ``redis_keys``
        are given (from :meth:`keys_for`, or found by a scan), for them (``key`` is
        then ``()``). What a shape's cost, guard and hold mean: see ``_scripts.Shape``.
        """
        if redis_keys is None:
            every, numbers = self._prepared(key, shape)
        else:
            every, numbers = self._every(redis_keys, shape.limits), shape.numbers
        token_bytes = token_bytes_of(token) if token else os.urandom(TOKEN_BYTES)
        decision = self._run(every, numbers, shape.limits, token_bytes)
        if decision is None:
            # the reservation was already started on (a message delivered twice):
            # this execution competes like a new call, with a token of its own
            return self._call(key, shape.with_mode(RESERVE), redis_keys=redis_keys)
        return decision

    def decide(
        self,
        keys: list[str],
        limits: tuple[Limit | Concurrency, ...],
        cost: int | Sequence[int],
        mode: int,
        *,
        token: str | None = None,
        horizon: float = DEFAULT_HORIZON,
        guard: float = 0.0,
        hold: float = 0.0,
    ) -> Decision:
        """:meth:`_call` for callers that hold Redis ``keys`` (from :meth:`keys_for`, or
        found by a scan): worked out afresh on every call."""
        return self._call(
            (), shape(limits, cost, mode, horizon, guard, hold), token=token, redis_keys=keys
        )

    def _prepared(self, key: str | tuple[str, ...], shape: Shape) -> tuple[list[str], bytes]:
        """The script's keys and packed numbers for ``key`` under ``shape``, worked out
        and checked on their first call and remembered for the last few thousand."""
        remembered = (key, shape) if shape.cacheable else None
        if remembered is not None:
            try:
                return self._sends[remembered]
            except KeyError:
                pass
            except TypeError:  # an unhashable key
                remembered = None
        sends = self._every(self.keys_for(key, shape.limits), shape.limits), shape.numbers
        if remembered is not None:
            if len(self._sends) >= KEY_CACHE_SIZE:
                self._sends.clear()
            self._sends[remembered] = sends
        return sends

    def _every(self, keys: list[str], limits: tuple[Any, ...]) -> list[str]:
        """The script's KEYS for the limits' ``keys`` (see ``_layout.script_keys``).

        Raises:
            InvalidLimit: on Redis Cluster, keys that do not share one hash tag.
        """
        if self._cluster and len({k.partition("}")[0] for k in keys}) > 1:
            raise InvalidLimit(
                f"limits checked together must share their hash tag (the key's first "
                f"segment) on Redis Cluster, got keys {keys}"
            )
        return script_keys(keys, limits)

    def _run(
        self,
        every: list[str],
        numbers: bytes,
        limits: tuple[Limit | Concurrency, ...],
        token_bytes: bytes,
    ) -> Decision | None:
        """One script call and its Decision; None if the reservation ``token_bytes``
        names was already started on (``SPENT``)."""
        algorithm = rate_algorithm(limits)
        reply = self._script_reply(algorithm, every, token_bytes, numbers)
        # the log's entries and concurrency slots are named by their token; the counter
        # keeps no entries
        logged = algorithm != "counter" or isinstance(limits[-1], Concurrency)
        if len(reply) == 3:  # allowed now by its one limit: the script's short reply
            remaining, reset_us, at_us = reply
            return Decision(
                allowed=True,
                remaining=remaining,
                retry_after=0.0,
                reset_after=reset_us / 1_000_000,
                token=token_bytes.hex() if logged else None,
                at=at_us / 1_000_000,
            )
        status, remaining, retry_us, reset_us, denied_by, at_us = reply  # integers
        if status == SPENT:
            return None
        reserved = status in (RESERVED, NOT_YET_DUE)
        allowed = status in (ALLOWED, STARTS_AT)
        paused = denied_by == len(limits) + 1
        return Decision(
            allowed=allowed,
            remaining=remaining,
            retry_after=retry_us / 1_000_000,
            reset_after=reset_us / 1_000_000,
            limit=limits[denied_by - 1] if denied_by and not paused else None,
            reserved=reserved,
            token=token_bytes.hex() if reserved or (allowed and logged) else None,
            at=at_us / 1_000_000,
            paused=paused,
        )

    def _script_reply(self, name: str, every: list[str], token: bytes, numbers: bytes) -> Any:
        """The reply of one call of the script ``name`` (on the held connection).

        Raises:
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``_failures``).
        """
        script = self._scripts[name]
        if not self._checked:
            self.check()
        try:
            try:
                return self._send("EVALSHA", script.sha, len(every), *every, token, numbers)
            except redis.exceptions.NoScriptError:
                # loads the script, then runs it
                return script(keys=every, args=[token, numbers])
        except REDIS_ERRORS as exc:
            raise self.translate(exc, "a rate-limit decision") from exc
