"""What an operator or an upstream's answer changes on a key, for every worker: pauses,
rate overrides, observed budgets. A part of :class:`~.limiter.Limiter` (its base).

Each pause and override is also noted in an index (``layout.index_key``), written
after the script call that makes it: what the metrics count without a scan. The index
only informs; a write to it that fails costs the operation nothing."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from .base import LimiterBase, ScriptCall
from .headers import Observation, parse
from .layout import OVERRIDES_INDEX, PAUSED_INDEX, index_key, settings_of
from .limit import KeySpec, LimitSpec
from .rate import Rate

logger = logging.getLogger("celery_ratelimit")


class KeyControls(LimiterBase):
    """The limiter's calls that change a key's settings (``lua/pause.lua``,
    ``resume.lua``, ``override.lua``, ``observe.lua``)."""

    def _script_reply(self, call: ScriptCall) -> Any:
        """The script's reply to ``call`` (the limiter's, on its held connection)."""
        raise NotImplementedError

    def _index(self, which: str, names: Sequence[str], seconds: float | None) -> None:
        """Note in the index ``which`` that the settings hashes ``names`` are paused or
        overridden for ``seconds`` (``math.inf``: until removed), or (None) no more."""
        if names:
            try:
                self._script_reply(self._index_call(which, names, seconds))
            except Exception as exc:  # the metrics' count only
                logger.debug("ratelimit: could not write the index %s: %s", which, exc)

    def _indexed(self, which: str) -> int:
        """How many keys the index ``which`` (``layout.PAUSED_INDEX``,
        ``OVERRIDES_INDEX``) holds now, its lapsed entries dropped.

        Raises:
            redis.RedisError: as the client raised it.
        """
        index = index_key(self.prefix, which)
        seconds, micros = self.client.time()
        self.client.zremrangebyscore(index, "-inf", seconds * 1_000_000 + micros)
        return int(self.client.zcard(index))

    def pause(self, key: str, seconds: float | str | Any) -> float:
        """Grant nothing on ``key`` (every limit and concurrency limit of it) for
        ``seconds`` on every worker: an upstream answered 429. A number of seconds, a
        ``Retry-After`` value (seconds or an HTTP-date) or a datetime. Calls are then
        answered denied, or placed past the pause, with ``retry_after`` = the time left.
        A longer pause already in place stays. Returns the seconds the key is paused for.

        Raises:
            InvalidLimit: a bad key or ``seconds``.
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``failures``).
        """
        return self._paused(self._pause_call(key, seconds))

    def pause_keys(self, escaped: Sequence[str], seconds: float) -> float:
        """:meth:`pause` for keys already escaped (one script call for all of them)."""
        return self._paused(self._pause_keys_call(escaped, seconds))

    def _paused(self, call: ScriptCall | None) -> float:
        if call is None:
            return 0.0
        seconds = float(self._script_reply(call)) / 1_000_000
        self._index(PAUSED_INDEX, call.keys, seconds)
        return seconds

    def resume(self, key: str) -> float:
        """End ``key``'s pause now (:meth:`pause`, ``UpstreamRateLimited``), on every
        worker from its next decision. Calls already placed past the pause keep their
        slots. Returns the seconds the pause had left (0.0: it was not paused).

        Raises:
            InvalidLimit: a bad key.
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``failures``).
        """
        call = self._resume_call(key)
        left = float(self._script_reply(call)) / 1_000_000
        self._index(PAUSED_INDEX, call.keys, None)
        return left

    def override(self, key: str, rate: str | Rate | None, *, ttl: float | None = None) -> None:
        """Use ``rate`` (``"50/s"``) for ``key`` from now on, on every worker, in place of
        the rate its calls give: for the key's rate limit of the same window, or for its
        only one whatever its window. ``ttl``: seconds until the override lapses (None:
        until removed). ``override(key, None)`` removes it. Read by the same script call
        that decides; what was counted stays counted. A call whose cost is above the
        new limit counts as the whole limit (it runs alone in its window).

        Raises:
            InvalidRate, InvalidLimit: a bad rate, key or ``ttl``, naming it.
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``failures``).
        """
        self._overridden(self._override_call(key, rate, ttl), rate, ttl)

    def override_keys(
        self, escaped: Sequence[str], rate: str | Rate | None, *, ttl: float | None = None
    ) -> None:
        """:meth:`override` for keys already escaped (as ``status`` lists them, a
        templated key's hash tag marked: see ``keys``), one script call each."""
        for key in escaped:
            self._overridden(self._override_call(key, rate, ttl, escaped=True), rate, ttl)

    def _overridden(self, call: ScriptCall, rate: Any, ttl: float | None) -> None:
        self._script_reply(call)
        seconds = None if rate is None else math.inf if ttl is None else float(ttl)
        self._index(OVERRIDES_INDEX, call.keys, seconds)

    def observe(
        self, key: KeySpec, headers: Any, limits: LimitSpec, *, since: float | None = None
    ) -> bool:
        """Bring ``key``'s shared budget in line with what the upstream's response
        ``headers`` say (one script call; the decisions read it with no extra round trip).

        ``Retry-After`` pauses the key as :meth:`pause` does. When the upstream says r
        units remain until its reset, no worker is granted more than r before then; a
        quota it states (``X-RateLimit-Limit``, the IETF policy, ``x-ratelimit-limit-*``)
        lowers the limit to it while it is said again, for an hour past its reset (a quota
        of another window, as the IETF policy's ``w`` tells, changes only the budget). A
        limit counted in calls (cost 1) takes the budget in requests, a limit that weighs
        its calls (another cost, a cost function) the budget in tokens
        (``x-ratelimit-*-tokens``). Headers it does not understand change nothing (one
        DEBUG line).

        Args:
            key, limits: as given to :meth:`acquire` for the call that got this answer.
            headers: a dict, a list of (name, value) pairs, or a requests / httpx /
                urllib response's headers.
            since: the call's ``Decision.at``: what was granted after it, before the
                reset, is taken from the budget too (the upstream had not seen those
                calls yet). None: only what is granted from now on.

        Returns:
            True when the headers said something the limiter wrote.

        Raises:
            TypeError: ``headers`` is not headers.
            InvalidLimit: a bad key or limits.
            LimiterUnavailable, LimiterMisconfigured: Redis failed (see ``failures``).
        """
        return self.observed(key, parse(headers), limits, since=since)

    def observed(
        self, key: KeySpec, seen: Observation, limits: LimitSpec, *, since: float | None = None
    ) -> bool:
        """:meth:`observe` for headers already read (the Celery layer's
        ``UpstreamRateLimited`` is an observation of a ``Retry-After``)."""
        call = self._observe_call(key, seen, limits, since)
        if call is None:
            return False
        self._script_reply(call)
        if seen.retry_after:
            names = sorted({settings_of(name) for name in self.keys_for(key, limits)})
            self._index(PAUSED_INDEX, names, seen.retry_after)
        return True
