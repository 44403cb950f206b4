"""AsyncLimiter: the :class:`Limiter`'s methods as coroutines, on ``redis.asyncio``.

The same scripts, keys and :class:`Decision` (``base`` works the calls out): a producer
(FastAPI, aiohttp) can check the budget a worker will use before it enqueues.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio

from .base import DEFAULT_PREFIX, LimiterBase, ScriptCall
from .client import arun_script, check_url
from .decision import Decision
from .exceptions import InvalidRedisURL
from .failures import check_versions
from .headers import parse
from .layout import (
    OVERRIDES_INDEX,
    PAUSED_INDEX,
    key_glob,
    keys_among,
    settings_of,
    stored_with,
)
from .limit import CostSpec, KeySpec, LimitSpec, to_limits
from .limiter import DEFAULT_CONNECT_TIMEOUT, DEFAULT_SOCKET_TIMEOUT, REDIS_ERRORS
from .rate import Rate
from .scripts import ACQUIRE_FULL, DEFAULT_HORIZON, FULL, PLAIN, PRELOADED, shape

logger = logging.getLogger("celery_ratelimit")


class AsyncLimiter(LimiterBase):
    """Shared rate limits kept in Redis, for asyncio code: every method of
    :class:`Limiter` that talks to Redis, as a coroutine.

    Args:
        client: a ``redis.asyncio.Redis`` (or its ``RedisCluster``) client.
        prefix: first part of every key, as the workers' (``ratelimit`` by default).

    Example::

        limiter = AsyncLimiter.from_url("redis://localhost:6379/0")
        d = await limiter.acquire("api:acme", "100/m")
        if not d.allowed:
            raise HTTPException(429, headers={"Retry-After": str(math.ceil(d.retry_after))})
    """

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, **options: Any) -> AsyncLimiter:
        """A limiter on a new ``redis.asyncio`` client for a ``redis://``, ``rediss://``
        or ``unix://`` URL (for Sentinel or Cluster, pass a client of your own). The
        timeouts default to :class:`Limiter`'s; ``options`` go to the client.

        Raises:
            InvalidRedisURL: a malformed URL, or another scheme, naming it.
        """
        scheme = check_url(url)
        if scheme not in ("redis", "rediss", "unix"):
            raise InvalidRedisURL(
                f"AsyncLimiter.from_url takes redis://, rediss:// or unix:// URLs, got "
                f"{scheme!r}: for Sentinel or Cluster give AsyncLimiter a redis.asyncio client"
            )
        options.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
        options.setdefault("socket_connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        return cls(redis.asyncio.Redis.from_url(url, **options), prefix=prefix)

    async def acquire(
        self,
        key: KeySpec,
        limits: LimitSpec,
        cost: CostSpec = 1,
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
        """As :meth:`Limiter.acquire`."""
        call = shape(to_limits(limits), cost, horizon, guard, hold, lease, lead=lead)
        how = "reserve" if reserve else "now"
        return await self._decide(
            self._acquire_call(key, call, how, fair=fair, fair_weight=fair_weight)
        )

    async def peek(
        self, key: KeySpec, limits: LimitSpec, cost: CostSpec = 1, *, guard: float = 0.0
    ) -> Decision:
        """As :meth:`Limiter.peek`: what ``acquire`` would answer, counting nothing."""
        call = shape(to_limits(limits), cost, guard=guard)
        return await self._decide(self._acquire_call(key, call, "peek"))

    async def confirm(
        self,
        token: str,
        key: KeySpec,
        limits: LimitSpec,
        cost: CostSpec = 1,
        *,
        horizon: float = DEFAULT_HORIZON,
        guard: float = 0.0,
        hold: float = 0.0,
        lease: float | None = None,
        fair: str | None = None,
        fair_weight: float | None = None,
    ) -> Decision:
        """As :meth:`Limiter.confirm`: start the call holding the reservation ``token``."""
        call = shape(to_limits(limits), cost, horizon, guard, hold, lease)
        started = self._start_call(token, key, call, reserved=True)
        decision = self._decision(started, await self._script_reply(started))
        if decision is None:  # started on already: compete as a new call
            return await self._decide(
                self._acquire_call(key, call, "reserve", fair=fair, fair_weight=fair_weight)
            )
        return decision

    async def release(
        self, token: str, key: KeySpec, limits: LimitSpec, cost: CostSpec = 1
    ) -> None:
        """As :meth:`Limiter.release`: give back a reservation, or concurrency slots."""
        await self._script_reply(self._release_call(token, key, limits, cost))

    async def settle(self, token: str, key: KeySpec, limits: LimitSpec, cost: CostSpec) -> Decision:
        """As :meth:`Limiter.settle`: replace the call's counted cost with its real one."""
        return await self._decide(self._settle_call(token, key, limits, cost))

    async def renew(
        self,
        token: str,
        key: str | tuple[str, ...],
        limits: LimitSpec,
        *,
        lease: float | None = None,
    ) -> bool:
        """As :meth:`Limiter.renew`: extend the leases of ``token``'s slots."""
        call = self._renew_call(token, key, limits, lease)
        return call is None or await self._script_reply(call) == 1

    async def pause(self, key: str, seconds: float | str | Any) -> float:
        """As :meth:`Limiter.pause`: grant nothing on ``key`` for ``seconds``."""
        call = self._pause_call(key, seconds)
        if call is None:
            return 0.0
        paused = float(await self._script_reply(call)) / 1_000_000
        await self._index(PAUSED_INDEX, call.keys, paused)
        return paused

    async def resume(self, key: str) -> float:
        """As :meth:`Limiter.resume`: end ``key``'s pause now."""
        call = self._resume_call(key)
        left = float(await self._script_reply(call)) / 1_000_000
        await self._index(PAUSED_INDEX, call.keys, None)
        return left

    async def override(
        self, key: str, rate: str | Rate | None, *, ttl: float | None = None
    ) -> None:
        """As :meth:`Limiter.override`: use ``rate`` for ``key`` on every worker."""
        call = self._override_call(key, rate, ttl)
        await self._script_reply(call)
        seconds = None if rate is None else math.inf if ttl is None else float(ttl)
        await self._index(OVERRIDES_INDEX, call.keys, seconds)

    async def observe(
        self, key: KeySpec, headers: Any, limits: LimitSpec, *, since: float | None = None
    ) -> bool:
        """As :meth:`Limiter.observe`: what the upstream's ``headers`` say, for every
        worker."""
        seen = parse(headers)
        call = self._observe_call(key, seen, limits, since)
        if call is None:
            return False
        await self._script_reply(call)
        if seen.retry_after:
            names = sorted({settings_of(name) for name in self.keys_for(key, limits)})
            await self._index(PAUSED_INDEX, names, seen.retry_after)
        return True

    async def _index(self, which: str, names: Sequence[str], seconds: float | None) -> None:
        """:meth:`Limiter._index <.controls.KeyControls._index>`: the metrics' count."""
        if names:
            try:
                await self._script_reply(self._index_call(which, names, seconds))
            except Exception as exc:  # the metrics' count only
                logger.debug("ratelimit: could not write the index %s: %s", which, exc)

    async def reset(self, key: str, limits: LimitSpec | None = None) -> list[str]:
        """As :meth:`Limiter.reset`: forget what was counted for ``key``."""
        try:
            if limits is None:
                found = [raw async for raw in self.client.scan_iter(key_glob(self.prefix, key))]
                keys = keys_among(found, self.prefix, key)
            else:
                keys = self.keys_for(key, limits)
            deleted = []
            for k in keys:
                await self.client.delete(*stored_with(k))
                if await self.client.delete(k):
                    deleted.append(k)
            return deleted
        except REDIS_ERRORS as exc:
            raise self.translate(exc, "a reset") from exc

    async def check(self) -> None:
        """As :meth:`Limiter.check`: Redis reachable, recent enough, scripts loaded.

        Raises:
            LimiterMisconfigured: a cause that retrying cannot change, and its fix.
            LimiterUnavailable: Redis could not be reached (for now).
        """
        try:
            try:
                info = await self.client.info("server")
            except redis.ResponseError:
                info = {}  # a least-privilege user: the scripts' errors tell a server too old
            check_versions(info)
            for name in PRELOADED:
                await self.client.script_load(self._scripts[name].script)
        except REDIS_ERRORS as exc:
            raise self.translate(exc, self.failed_check()) from exc
        self._checked = True

    async def aclose(self) -> None:
        """Close the client's connections."""
        close = getattr(self.client, "aclose", None) or self.client.close  # redis-py < 5.0.1
        await close()

    async def _decide(self, call: ScriptCall) -> Decision:
        """As :meth:`Limiter._decide`."""
        return self._decided(call, await self._script_reply(call))

    async def _script_reply(self, call: ScriptCall) -> Any:
        if not self._checked:
            await self.check()
        try:
            reply = await arun_script(self._scripts[call.script], call.keys, call.args)
            if call.script in PLAIN and reply[0] == FULL:
                return await arun_script(self._scripts[ACQUIRE_FULL], call.keys, call.args)
            return reply
        except REDIS_ERRORS as exc:
            raise self.translate(exc, "a rate-limit decision") from exc


__all__: Sequence[str] = ["AsyncLimiter"]
