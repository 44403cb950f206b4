"""Limiter: a Redis client plus the Lua scripts, answering with a :class:`Decision`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from ._base import (
    ACQUIRE,
    CONFIRM,
    DEFAULT_PREFIX,
    PEEK,
    RELEASE,
    RESERVE,
    LimiterBase,
    ScriptCall,
)
from ._client import HeldConnection, client_from_url
from ._decision import Decision, token_bytes_of
from ._exceptions import LimiterUnavailable, RateLimitError
from ._failures import check_versions, not_redis_error, translate
from ._layout import companions, keys_of
from ._limit import Concurrency, Limit, LimitSpec, to_limits
from ._rate import Rate
from ._scripts import DEFAULT_HORIZON, Shape, shape

#: Client defaults: a hung or refused Redis costs a task at most about this long.
DEFAULT_SOCKET_TIMEOUT = 2.0
DEFAULT_CONNECT_TIMEOUT = 2.0

Client = Any  # redis.Redis or redis.cluster.RedisCluster
#: What a redis-py client raises (its Cluster client's own errors are no RedisError).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class Limiter(LimiterBase):
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
        super().__init__(client, prefix=prefix)
        held = HeldConnection.for_client(client)
        # the script's EVALSHA: on a connection held for it when the client allows
        self._send = held.call if held is not None else client.execute_command

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

    def settle(
        self,
        token: str,
        key: str | tuple[str, ...],
        limits: LimitSpec,
        cost: int | Sequence[int],
        *,
        was: int | Sequence[int] = 1,
    ) -> Decision:
        """Replace the cost counted for the call ``token`` (a granted or reserved
        :class:`Decision`'s) with its real one, known after the call: an LLM call's
        tokens, a quota charged for a failed request.

        A refund (less than it was) frees budget at once; a surcharge may put a window
        over its limit, which the next calls wait out (the settled call itself is never
        undone). The entry keeps its instant; where it has already left its window
        there is nothing to change. The counter (``algorithm="counter"``) keeps no
        entries: the difference is counted in its current window if the call was.

        Args:
            token, key, limits: as given to (and returned by) :meth:`acquire`.
            cost: the real cost, an int of 0 or more (it may exceed a limit), or one
                per limit.
            was: the cost the call was acquired with (``acquire``'s ``cost``), or one
                per limit.

        Returns:
            A Decision: ``allowed`` when the call's entry was found and changed, with
            the ``remaining`` weight after it.

        Raises:
            InvalidLimit / TypeError: a bad token, cost or ``was``.
        """
        call = self._settle_call(token, key, limits, cost, was)
        decision = self._decision(call, self._script_reply(call))
        assert decision is not None  # a settle never answers SPENT
        return decision

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
        call = self._renew_call(token, key, limits, lease)
        return call is None or bool(self._script_reply(call)[0] == 1)

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
        call = self._pause_call(key, seconds)
        return 0.0 if call is None else float(self._script_reply(call)[2]) / 1_000_000

    def pause_keys(self, escaped: Sequence[str], seconds: float) -> float:
        """:meth:`pause` for keys already escaped (one script call for all of them)."""
        call = self._pause_keys_call(escaped, seconds)
        return 0.0 if call is None else float(self._script_reply(call)[2]) / 1_000_000

    def override(self, key: str, rate: str | Rate | None, *, ttl: float | None = None) -> None:
        """Use ``rate`` (``"50/s"``) for ``key`` from now on, on every worker, in place of
        the rate its calls give: for the key's rate limit of the same window, or for its
        only one whatever its window. ``ttl``: seconds until the override lapses (None:
        until removed). ``override(key, None)`` removes it. Read by the same script call
        that decides; what was counted stays counted. A call whose cost is above the
        new limit counts as the whole limit (it runs alone in its window).

        Raises:
            InvalidRate, InvalidLimit: a bad rate, key or ``ttl``, naming it.
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``_failures``).
        """
        self._script_reply(self._override_call(key, rate, ttl))

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
            check_versions(info)
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

    def _call(
        self,
        key: str | tuple[str, ...],
        shape: Shape,
        *,
        token: str | None = None,
        redis_keys: list[str] | None = None,
    ) -> Decision:
        """One decision of ``shape`` for ``key`` (see :meth:`_script_call`)."""
        call = self._script_call(key, shape, token, redis_keys)
        decision = self._decision(call, self._script_reply(call))
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

    def _script_reply(self, call: ScriptCall) -> Any:
        """The script's reply to ``call`` (on the held connection).

        Raises:
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``_failures``).
        """
        script = self._scripts[call.script]
        if not self._checked:
            with self._check_lock:
                if not self._checked:  # not checked by the call it waited for
                    self.check()
        keys, token, numbers = call.keys, call.token, call.numbers
        try:
            try:
                return self._send("EVALSHA", script.sha, len(keys), *keys, token, numbers)
            except redis.exceptions.NoScriptError:
                # loads the script, then runs it
                return script(keys=keys, args=[token, numbers])
        except REDIS_ERRORS as exc:
            raise self.translate(exc, "a rate-limit decision") from exc
