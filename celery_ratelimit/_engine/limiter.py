"""Limiter: a Redis client plus the Lua scripts, answering with a :class:`Decision`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import redis

from .base import DEFAULT_PREFIX, KEY_CACHE_SIZE, ScriptCall
from .client import HeldConnection, client_from_url, run_script
from .controls import KeyControls
from .decision import TOKEN_BYTES, Decision, parse_token, token_of
from .exceptions import InvalidLimit, LimiterUnavailable
from .failures import check_versions, not_redis_error
from .layout import handoff_list, keys_of, stored_with
from .limit import Concurrency, LimitSpec, to_limits
from .scripts import ACQUIRE_FULL, DEFAULT_HORIZON, FULL, PLAIN, PRELOADED, Prepared, shape

#: Client defaults: a hung or refused Redis costs a task at most about this long.
DEFAULT_SOCKET_TIMEOUT = 2.0
DEFAULT_CONNECT_TIMEOUT = 2.0

Client = Any  # redis.Redis or redis.cluster.RedisCluster
#: What a redis-py client raises (its Cluster client's own errors are no RedisError).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class Limiter(KeyControls):
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
        or ``redis+cluster://h:p,h:p`` (see ``client``). Timeouts are bounded by default
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
        key: str | Sequence[str],
        limits: LimitSpec,
        cost: int | Sequence[int] = 1,
        *,
        reserve: bool = False,
        horizon: float = DEFAULT_HORIZON,
        guard: float = 0.0,
        hold: float = 0.0,
        lease: float | None = None,
        fair: str | None = None,
        fair_weight: float | None = None,
        lead: float = 0.0,
    ) -> Decision:
        """Count ``cost`` against every limit for ``key`` now, if all of them allow it.

        All or nothing: a denial by one limit consumes nothing from the others.

        Args:
            key: what shares the budget (``"yt:quota:key1"``); a limit with a plain
                string ``key`` of its own uses that instead. Or escaped keys, one per
                limit (as the Celery layer resolves them).
            limits: a rate string, a :class:`Limit` or a list of them.
            cost: weight of this call, a positive int no greater than any limit (or one
                per limit).
            reserve: when denied, reserve the earliest future slot at which the cost
                fits (``Decision.reserved``), unless it lies beyond ``horizon`` seconds
                (more than 0, at most a year). The counter algorithm reserves nothing.
            guard, hold: seconds; the options the Celery layer runs with
                (``ratelimit_guard``, and the longest wait it makes in-process): see
                docs/timing.md. ``lease``: seconds a concurrency slot is held when its
                limit gives no lease.
            fair, fair_weight: for a Limit with a ``fair_key``, the call's value of it
                (its plain ``fair_key`` when not given) and its weight (the Limit's
                when not given): a reservation takes its place among the waiting calls
                by weighted fair shares (docs/timing.md, "Fair shares").
            lead: seconds after now at which a grant is counted, for a body whose
                first request is expected that much after its start (the Celery layer
                on gevent and eventlet: docs/timing.md, "A cold start on a green pool").

        Raises:
            InvalidLimit / InvalidRate / TypeError: bad limits or cost.
            LimiterUnavailable: Redis could not be reached (for now).
            LimiterMisconfigured: Redis refuses the limiter (a permission, a password,
                its version): the message names the fix.
        """
        call = shape(to_limits(limits), cost, horizon, guard, hold, lease, lead=lead)
        how = "reserve" if reserve else "now"
        return self._decide(self._acquire_call(key, call, how, fair=fair, fair_weight=fair_weight))

    def peek(
        self,
        key: str | Sequence[str],
        limits: LimitSpec,
        cost: int | Sequence[int] = 1,
        *,
        guard: float = 0.0,
        redis_keys: list[str] | None = None,
    ) -> Decision:
        """What :meth:`acquire` would answer now, without counting anything.
        ``redis_keys``: the limits' Redis keys as found by a scan (``key`` is then
        ignored)."""
        call = shape(to_limits(limits), cost, guard=guard)
        return self._decide(self._acquire_call(key, call, "peek", redis_keys=redis_keys))

    def confirm(
        self,
        token: str,
        key: str | Sequence[str],
        limits: LimitSpec,
        cost: int | Sequence[int] = 1,
        *,
        horizon: float = DEFAULT_HORIZON,
        guard: float = 0.0,
        hold: float = 0.0,
        lease: float | None = None,
        fair: str | None = None,
        fair_weight: float | None = None,
    ) -> Decision:
        """Start the call holding the reservation ``token`` (from ``acquire(...,
        reserve=True)``).

        Allowed if its slot has come; ``reserved`` with the time left if not yet; if the
        reservation is gone (Redis restarted, key reset), competes again as ``acquire``
        with ``reserve=True``, as it does when a call already started on it (a message
        delivered twice). A call so late that it is placed anew, past ``horizon``, is
        denied and holds no slot: it competes again later, as a new call.

        Raises:
            InvalidLimit: ``token`` is not a token the limiter wrote, or a bad horizon.
        """
        call = shape(to_limits(limits), cost, horizon, guard, hold, lease)
        started = self._start_call(token, key, call, reserved=True)
        decision = self._decision(started, self._script_reply(started))
        if decision is None:  # started on already: compete as a new call
            return self._decide(
                self._acquire_call(key, call, "reserve", fair=fair, fair_weight=fair_weight)
            )
        return decision

    def restamp(
        self,
        token: str,
        key: str | Sequence[str],
        limits: LimitSpec,
        cost: int | Sequence[int] = 1,
        *,
        horizon: float = DEFAULT_HORIZON,
        guard: float = 0.0,
        hold: float = 0.0,
        lease: float | None = None,
    ) -> Decision:
        """Start anew the call ``token`` that :meth:`acquire` granted, whose reply was read
        too late to start on (a busy event loop, a descheduled process): its entry moves
        to where it really starts, as a late reservation's does (see docs/timing.md).

        Raises:
            InvalidLimit: ``token`` is not a token the limiter wrote.
        """
        call = shape(to_limits(limits), cost, horizon, guard, hold, lease)
        return self._decide(self._start_call(token, key, call, reserved=False))

    def release(
        self,
        token: str,
        key: str | Sequence[str],
        limits: LimitSpec,
        cost: int | Sequence[int] = 1,
    ) -> None:
        """Give back a reservation that will not be used (a revoked or expired task),
        and the concurrency slots (or turns in line) of ``token``: its body has ended.

        Raises:
            InvalidLimit: ``token`` is not a token the limiter wrote.
        """
        self.release_handing(token, key, limits, cost)

    def release_handing(
        self,
        token: str,
        key: str | Sequence[str],
        limits: LimitSpec,
        cost: int | Sequence[int] = 1,
    ) -> tuple[str, ...]:
        """:meth:`release`, returning the tokens of the waiting calls it handed a
        concurrency slot to (a copy of theirs waiting elsewhere is to be called in)."""
        reply = self._script_reply(self._release_call(token, key, limits, cost))
        return tuple(t.decode() if isinstance(t, bytes) else str(t) for t in reply[6:])  # hex

    def settle(
        self,
        token: str,
        key: str | Sequence[str],
        limits: LimitSpec,
        cost: int | Sequence[int],
    ) -> Decision:
        """Replace the cost counted for the call ``token`` (a granted or reserved
        :class:`Decision`'s) with its real one, known after the call: an LLM call's
        tokens, a quota charged for a failed request. What the call was counted at, the
        token says.

        A refund (less than it was) frees budget at once; a surcharge may put a window
        over its limit, which the next calls wait out (the settled call itself is never
        undone). The entry keeps its instant; where it has already left its window
        there is nothing to change. The counter (``algorithm="counter"``) keeps no
        entries: the difference is counted in its current window if the call was.

        Args:
            token, key, limits: as given to (and returned by) :meth:`acquire`.
            cost: the real cost, an int of 0 or more (it may exceed a limit), or one
                per limit.

        Returns:
            A Decision: ``allowed`` when the call's entry was found and changed, with
            the ``remaining`` weight after it, and the token to settle it again by.

        Raises:
            InvalidLimit / TypeError: a bad token or cost.
        """
        return self._decide(self._settle_call(token, key, limits, cost))

    def handed(
        self, token: str, key: str | Sequence[str], limits: LimitSpec, timeout: float
    ) -> float | None:
        """Wait up to ``timeout`` seconds (at most 1) for the turn of the waiting call
        ``token``, whose only limit is one ``Concurrency``, to be handed over to it
        (``lua/lib/concurrency.lua``): when a body ends, its slot goes to the first waiter
        in line. Returns when the handed slot's lease runs out (Redis time, seconds since
        the epoch): the slot is the call's, its body may start now (renew the lease to
        keep it longer); or None: no turn came (confirm the reservation as usual).

        Raises:
            InvalidLimit: ``token`` is not a token the limiter wrote, or the limits are
                not one ``Concurrency``.
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``failures``).
        """
        normalized = to_limits(limits)
        if len(normalized) != 1 or not isinstance(normalized[0], Concurrency):
            raise InvalidLimit(f"a handed turn is one Concurrency's, not {normalized!r}")
        name = handoff_list(self.keys_for(key, normalized)[0], parse_token(token)[0])
        popped = self._pop_waiting(name, timeout, "waiting for a handed turn")
        return None if popped is None else int(popped) / 1_000_000

    def _pop_waiting(self, name: str, timeout: float, doing: str) -> Any:
        """The first item of the list ``name``, waited for up to ``timeout`` seconds (at
        most 1, and half the client's socket timeout, which would take the wait for a
        hung Redis); None if none came.

        Raises:
            LimiterUnavailable, LimiterMisconfigured: Redis failed while ``doing``.
        """
        pool = getattr(self.client, "connection_pool", None)
        socket_timeout = getattr(pool, "connection_kwargs", {}).get("socket_timeout") or 2.0
        timeout = min(max(timeout, 0.01), 1.0, socket_timeout / 2)
        try:
            popped = self.client.blpop([name], timeout=timeout)
        except REDIS_ERRORS as exc:
            raise self.translate(exc, doing) from exc
        return None if popped is None else popped[1]

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
        return call is None or bool(self._script_reply(call) == 1)

    def reset(self, key: str, limits: LimitSpec | None = None) -> list[str]:
        """Forget everything counted for ``key`` under ``limits``, or under every window
        and algorithm of ``key`` when ``limits`` is None (what ``celery ratelimit reset
        KEY`` does). Returns the Redis keys deleted (their pending sets go with them).

        Raises:
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``failures``).
        """
        try:
            if limits is None:
                keys = keys_of(self.client, self.prefix, key)
            else:
                keys = self.keys_for(key, limits)
            deleted = []
            for k in keys:
                self.client.delete(*stored_with(k))
                if self.client.delete(k):
                    deleted.append(k)
            return deleted
        except REDIS_ERRORS as exc:
            raise self.translate(exc, "a reset") from exc

    def check(self) -> None:
        """Check that Redis can serve this limiter: reachable, the credentials accepted,
        version 6.2 or newer (when the user may read ``INFO``), the scripts of
        ``scripts.PRELOADED`` loaded (the others load at their first call).

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
            for name in PRELOADED:
                self.client.script_load(self._scripts[name].script)
        except REDIS_ERRORS as exc:
            error = self.translate(exc, self.failed_check())
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
        return run_script(self._scripts[name], keys, args)

    def _prepare_acquire(
        self, limits: LimitSpec, cost: int | Sequence[int] = 1, **options: Any
    ) -> Prepared | None:
        """What :meth:`acquire` with these arguments (``horizon``, ``guard``, ``hold``,
        ``lease``; no ``fair``, no ``lead``) sends on every call but its keys and token,
        checked once; None when that changes by the call (aligned limits' windows move).

        Raises:
            InvalidLimit / InvalidRate / TypeError: bad limits, cost or options.
        """
        call = shape(to_limits(limits), cost, **options)
        if call.fixed_arguments is None:
            return None
        script = call.script("counter" if call.counter else "acquire")
        return Prepared(call, script, call.fixed_arguments, token_of(b"", call.costs), {})

    def _acquire_prepared(
        self, prepared: Prepared, keys: tuple[str, ...], reserve: bool = False
    ) -> Decision:
        """:meth:`acquire` of escaped ``keys`` (one per limit) as :meth:`_prepare_acquire`d: only
        the keys' Redis names (remembered) and a token are worked out here."""
        shape = prepared.shape
        sends = prepared.sends.get(keys)
        if sends is None:
            if len(prepared.sends) >= KEY_CACHE_SIZE:
                prepared.sends.clear()
            sends = prepared.sends[keys] = self._prepared(keys, shape)
        token = os.urandom(TOKEN_BYTES)
        args = [token, "reserve" if reserve else "now", *prepared.arguments]
        call = ScriptCall(prepared.script, sends, args, shape.limits, shape.costs)
        return self._decided(call, self._script_reply(call), prepared.suffix)

    # -- the calls ------------------------------------------------------------------

    def _decide(self, call: ScriptCall) -> Decision:
        """The Decision of a decision script's call that starts no reservation."""
        return self._decided(call, self._script_reply(call))

    def _script_reply(self, call: ScriptCall) -> Any:
        """The script's reply to ``call``, sent on the held connection (the script
        loaded first if Redis lost it).

        Raises:
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``failures``).
        """
        script = self._scripts[call.script]
        if not self._checked:
            with self._check_lock:
                if not self._checked:  # not checked by the call it waited for
                    self.check()
        try:
            try:
                reply = self._send("EVALSHA", script.sha, len(call.keys), *call.keys, *call.args)
            except redis.exceptions.NoScriptError:
                reply = run_script(script, call.keys, call.args)  # loads it, then runs it
        except REDIS_ERRORS as exc:
            raise self.translate(exc, "a rate-limit decision") from exc
        if call.script in PLAIN and reply[0] == FULL:
            return self._script_reply(call._replace(script=ACQUIRE_FULL))
        return reply
