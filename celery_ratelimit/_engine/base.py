"""What a limiter works out without Redis: a script call's keys and numbers, and the
Decision its reply means. :class:`Limiter` (redis-py) and :class:`AsyncLimiter`
(``redis.asyncio``) send the same calls to the same scripts."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from .decision import TOKEN_BYTES, Decision, parse_token, token_of
from .exceptions import InvalidLimit, RateLimitError
from .failures import translate
from .headers import Observation, budget_numbers
from .keys import escape_key, fixed_key
from .layout import (
    FAIR_STATE,
    FAIR_TAGS,
    index_key,
    redis_key,
    script_keys,
    settings_key,
    settings_of,
)
from .limit import Concurrency, Limit, LimitSpec, check_weight, describe, to_limits
from .rate import Rate
from .scripts import MAX_HORIZON, NAMES, Shape, is_counter, shape, source
from .upstream import seconds_from

#: An adapting limit (``Limit(adapt=True)``) gives back this share of its declared rate
#: (1 / ADAPT_SHARE) per window without a 429.
ADAPT_SHARE = 10
#: ... and keeps this share (per mille) of its effective rate on a 429 (halved).
ADAPT_KEEP = 500

#: Reply statuses (see ``lua/lib/call.lua``).
DENIED, ALLOWED, RESERVED, NOT_YET_DUE, RELEASED, SPENT, STARTS_AT, SETTLED = range(8)

#: What a decision asks, as the Celery layer's metrics name it.
ACQUIRE, RESERVE, PEEK, CONFIRM, RESTAMP = "acquire", "reserve", "peek", "confirm", "restamp"

DEFAULT_PREFIX = "ratelimit"
#: How many call shapes (key, limits, cost, options) a limiter remembers what it sends for.
KEY_CACHE_SIZE = 4096


class ScriptCall(NamedTuple):
    """One call of a script: its name (one of ``scripts.NAMES``), KEYS and ARGV, and,
    for a decision, the call's limits and costs (to read the reply)."""

    script: str
    keys: list[str]
    args: list[Any]
    limits: tuple[Any, ...] = ()
    costs: tuple[int, ...] = ()

    @property
    def token(self) -> bytes:
        return bytes(self.args[0])


def _per_limit(cost: int | Sequence[int], count: int, name: str) -> tuple[int, ...]:
    """``cost`` as one int per limit (one int stands for every limit)."""
    if isinstance(cost, int):
        return (cost,) * count
    if not isinstance(cost, Sequence) or isinstance(cost, (str, bytes)):
        raise TypeError(f"{name} must be an int or one int per limit, got {cost!r}")
    if len(cost) != count:
        raise InvalidLimit(f"got {len(cost)} values of {name} for {count} limits")
    return tuple(cost)


class LimiterBase:
    """The part of a limiter that sends nothing: its client's scripts, key names,
    script calls and what their replies mean."""

    def __init__(self, client: Any, *, prefix: str = DEFAULT_PREFIX) -> None:
        if (
            not isinstance(prefix, str)
            or not prefix
            or escape_key(prefix) != prefix
            or "{" in prefix
        ):
            raise InvalidLimit(f"key prefix must be a plain non-empty string, got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self._cluster = hasattr(client, "get_nodes")
        self._scripts = {name: client.register_script(source(name)) for name in NAMES}
        self._checked = False  # Redis checked (version, scripts loaded): see check()
        self._first_told = False  # a failed check's error said "the limiter's first call"
        # one check at a time: fifty greenlets of a cold node would each load the scripts
        self._check_lock = threading.Lock()
        # the script's keys for (key, shape), worked out and checked once: escaping and
        # formatting are most of a decision's Python, and a process decides for few
        # distinct keys and shapes
        self._sends: dict[tuple[Any, Shape], list[str]] = {}

    def failed_check(self) -> str:
        """What a check that failed was doing, for its error: the limiter's first call, the
        first time only; after that, the decision that checks again (each one does until
        a check passes), so that the seventh deferral's line does not say "first"."""
        if self._first_told:
            return "a rate-limit decision"
        self._first_told = True
        return "the limiter's first call"

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
                if own:
                    escaped.append(fixed_key(own))
                    continue
                if not isinstance(key, str) or not key:
                    raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
                escaped.append(escape_key(key))
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

    def _decision_call(
        self,
        script: str,
        flag: str,
        key: str | Sequence[str],
        shape: Shape,
        token: str | None = None,
        redis_keys: list[str] | None = None,
    ) -> ScriptCall:
        """The call of the decision ``script`` (``"acquire"``, ``"start"``, ``"release"``,
        ``"settle"`` or ``"counter"``: the shape picks its entry script, see
        ``Shape.script``) with ``flag`` (see its header) for ``key``: a code-given key,
        or escaped keys, one per limit (as :meth:`keys_for` takes them); or, when
        ``redis_keys`` are given (from :meth:`keys_for`, or found by a scan), for them."""
        if redis_keys is None:
            keys = self._prepared(key, shape)
        else:
            keys = self._every(redis_keys, shape.limits)
        token_bytes = os.urandom(TOKEN_BYTES) if token is None else parse_token(token)[0]
        fixed = shape.fixed_arguments
        args: list[Any] = [token_bytes, flag, *(shape.arguments() if fixed is None else fixed)]
        return ScriptCall(shape.script(script), keys, args, shape.limits, shape.costs)

    def _acquire_call(
        self,
        key: str | Sequence[str],
        shape: Shape,
        how: str,
        redis_keys: list[str] | None = None,
        fair: str | None = None,
        fair_weight: float | None = None,
    ) -> ScriptCall:
        """The call of an acquisition: ``how`` is ``"now"``, ``"reserve"`` or ``"peek"``
        (the counter reserves nothing: it counts now or denies); ``fair``,
        ``fair_weight``: a reservation's, as :meth:`fair_of` takes them."""
        fairly = None
        if how == "reserve" and (shape.fair_limit is not None or fair is not None):
            fairly = self.fair_of(key, shape.limits, fair, fair_weight)
        script = "counter" if shape.counter else "acquire"
        call = self._decision_call(script, how, key, shape, redis_keys=redis_keys)
        if fairly is None or script != "acquire":
            return call
        log = call.keys[0]
        return call._replace(
            script=shape.script(script, fair=True),
            keys=[*call.keys, log + FAIR_TAGS, log + FAIR_STATE],
            args=[*call.args, fairly[0], repr(fairly[1])],
        )

    @staticmethod
    def fair_of(
        key: str | Sequence[str],
        limits: tuple[Any, ...],
        fair: str | None,
        fair_weight: float | None,
    ) -> tuple[str, float] | None:
        """A direct call's fair-key value (escaped) and weight: ``fair`` or the Limit's
        plain ``fair_key``, ``fair_weight`` or the Limit's numeric one; None when the
        limits have no fair key. With escaped keys (a list, as the Celery layer gives
        them), ``fair`` is escaped already.

        Raises:
            InvalidLimit: a bad weight, a template fair_key without ``fair``.
        """
        limit = next((one for one in limits if getattr(one, "fair_key", None)), None)
        if limit is None:
            if fair is not None:
                raise InvalidLimit(f"fair={fair!r} needs a Limit with a fair_key")
            return None
        if fair is None:
            if not isinstance(limit.fair_key, str) or limit.fair_fields:
                raise InvalidLimit(
                    f"Limit fair_key {limit.fair_key!r} is a template or a function; "
                    "outside a task pass the call's value as acquire(..., fair=...)"
                )
            fair = limit.fair_key
        if not isinstance(fair, str) or not fair:
            raise InvalidLimit(f"fair must be a non-empty string, got {fair!r}")
        if fair_weight is None:
            if callable(limit.fair_weight):
                raise InvalidLimit(
                    f"Limit fair_weight of {limit.label} is a function; outside a task "
                    "pass the call's weight as acquire(..., fair_weight=...)"
                )
            fair_weight = limit.fair_weight
        return fair if not isinstance(key, str) else escape_key(fair), check_weight(fair_weight)

    def _start_call(
        self, token: str, key: str | Sequence[str], shape: Shape, reserved: bool
    ) -> ScriptCall:
        """The call that starts ``token``: a reservation (``reserved``) or this process's
        own grant read late (see ``lua/start.lua``). The counter has neither: the call
        is counted now or denied."""
        parse_token(token)  # a token is required here, and checked
        if shape.counter:
            return self._decision_call("counter", "now", key, shape, token)
        return self._decision_call(
            "start", "reserved" if reserved else "granted", key, shape, token
        )

    def _release_call(
        self, token: str, key: str | Sequence[str], limits: LimitSpec, cost: int | Sequence[int]
    ) -> ScriptCall:
        """The call that gives back what ``token`` holds; its entries are found by the
        costs the token carries when they are these limits' (else by ``cost``)."""
        normalized = to_limits(limits)
        counted = parse_token(token)[1]
        if counted is not None and len(counted) in (1, len(normalized)):
            cost = counted if len(counted) > 1 else counted[0]
        call = shape(normalized, cost)
        flag = "counter" if is_counter(normalized) else "log"
        return self._decision_call("release", flag, key, call, token)

    def _settle_call(
        self, token: str, key: str | Sequence[str], limits: LimitSpec, cost: int | Sequence[int]
    ) -> ScriptCall:
        """The call that makes ``token``'s counted cost ``cost`` (what it was counted at,
        the token carries): one int for every limit, or one per limit."""
        normalized = to_limits(limits)
        counted = parse_token(token)[1] or (1,) * len(normalized)
        if len(counted) == 1:
            counted *= len(normalized)
        if len(counted) != len(normalized):
            raise InvalidLimit(
                f"token {token!r} was counted for {len(counted)} limits, not the "
                f"{len(normalized)} of {describe(normalized)}"
            )
        real = shape(normalized, _per_limit(cost, len(normalized), "cost"), settling=True)
        flag = "counter" if is_counter(normalized) else "log"
        call = self._decision_call("settle", flag, key, real, token)
        was = [
            old for old, limit in zip(counted, normalized, strict=True) if isinstance(limit, Limit)
        ]
        return call._replace(args=call.args + was)

    def _renew_call(
        self, token: str, key: str | Sequence[str], limits: LimitSpec, lease: float | None
    ) -> ScriptCall | None:
        """The call that renews ``token``'s slots (None: the limits have none)."""
        token_bytes = parse_token(token)[0]
        slots = tuple(limit for limit in to_limits(limits) if isinstance(limit, Concurrency))
        if not slots:
            return None
        call = shape(slots, 1, lease=lease)
        keys = self._prepared(key, call)[: 3 * len(slots)]  # not the settings hashes
        return ScriptCall("renew", keys, [token_bytes, *call.leases[1::2]])

    def _pause_call(self, key: str, seconds: float | str | Any) -> ScriptCall | None:
        """The call that pauses ``key`` (None: no time to pause for)."""
        if not isinstance(key, str) or not key:
            raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
        return self._pause_keys_call([escape_key(key)], seconds_from(seconds))

    def _pause_keys_call(self, escaped: Sequence[str], seconds: float) -> ScriptCall | None:
        keys = sorted({settings_key(self.prefix, k) for k in escaped})
        if seconds <= 0:
            return None
        return ScriptCall("pause", keys, [int(min(seconds, MAX_HORIZON) * 1_000_000)])

    def _resume_call(self, key: str) -> ScriptCall:
        """The call that ends ``key``'s pause now."""
        if not isinstance(key, str) or not key:
            raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
        return ScriptCall("resume", [settings_key(self.prefix, escape_key(key))], [])

    def _index_call(self, which: str, names: Sequence[str], seconds: float | None) -> ScriptCall:
        """The call that notes in the index ``which`` (``layout.index_key``) that the
        settings hashes ``names`` are paused or overridden for ``seconds`` (``math.inf``:
        until removed), or (None) no more."""
        if seconds is None:
            ends = ""
        else:
            ends = "+inf" if seconds == math.inf else str(max(int(seconds * 1e6), 1))
        return ScriptCall("index", [index_key(self.prefix, which)], [ends, *names])

    def _override_call(
        self, key: str, rate: str | Rate | None, ttl: float | None, *, escaped: bool = False
    ) -> ScriptCall:
        """The call that sets (or, ``rate`` None, removes) ``key``'s rate override.

        Raises:
            InvalidRate, InvalidLimit, TypeError: a bad key, rate or ``ttl``, naming it.
        """
        if not isinstance(key, str) or not key:
            raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
        ttl_us = 0
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
                raise TypeError(f"ttl must be a number of seconds or None, got {ttl!r}")
            if not 0 < ttl <= MAX_HORIZON:
                raise InvalidLimit(
                    f"ttl must be more than 0 and at most {MAX_HORIZON:g} seconds, got {ttl!r}"
                )
            ttl_us = max(int(ttl * 1_000_000), 1)
        parsed = None if rate is None else Rate.parse(rate)
        limit, window_us = (parsed.limit, parsed.window_us) if parsed is not None else (0, 0)
        keys = [settings_key(self.prefix, key if escaped else escape_key(key))]
        return ScriptCall("override", keys, [limit, window_us, ttl_us])

    def _observe_call(
        self,
        key: str | Sequence[str],
        seen: Observation,
        limits: LimitSpec,
        since: float | None,
    ) -> ScriptCall | None:
        """The call that writes what ``seen`` says for ``key``'s ``limits`` (None:
        nothing to write): the budgets (see :func:`budget_for` for which a limit takes),
        and, for a ``Retry-After``, the pause of every key and a cut of the effective
        rate of the limits declared ``adapt=True``."""
        normalized = to_limits(limits)
        keys = self.keys_for(key, normalized)
        noted, numbers = budget_numbers(keys, normalized, seen)
        pause = seen.retry_after or 0.0
        cut: list[str] = []
        if pause > 0:
            for name, limit in zip(keys, normalized, strict=True):
                if limit.adapt:
                    rate = limit.fixed_rate
                    cut.append(name)
                    step = max(rate.limit // ADAPT_SHARE, 1)
                    numbers += (rate.limit, rate.window_us, step, ADAPT_KEEP)
        if not noted and pause <= 0:
            return None
        paused = sorted({settings_of(k) for k in keys}) if pause > 0 else []
        since_us = 0 if since is None else max(round(since * 1_000_000), 0)
        every = [*(settings_of(k) for k in noted), *noted, *(settings_of(k) for k in cut), *cut]
        return ScriptCall(
            "observe",
            every + paused,
            [len(noted), len(cut), int(min(pause, MAX_HORIZON) * 1_000_000), since_us, *numbers],
        )

    def _prepared(self, key: str | Sequence[str], shape: Shape) -> list[str]:
        """The script's keys for ``key`` under ``shape``, worked out and checked (with the
        shape's arguments) on their first call and remembered for the last few thousand."""
        remembered = (key, shape) if shape.cacheable else None
        if remembered is not None:
            try:
                return self._sends[remembered]
            except KeyError:
                pass
            except TypeError:  # an unhashable key
                remembered = None
        shape.args  # noqa: B018 (checks the costs and horizon)
        keys = self._every(self.keys_for(key, shape.limits), shape.limits)
        if remembered is not None:
            if len(self._sends) >= KEY_CACHE_SIZE:
                self._sends.clear()
            self._sends[remembered] = keys
        return keys

    def _every(self, keys: list[str], limits: tuple[Any, ...]) -> list[str]:
        """The script's KEYS for the limits' ``keys`` (see ``layout.script_keys``).

        Raises:
            InvalidLimit: on Redis Cluster, keys that do not share one hash tag.
        """
        if self._cluster and len({k.partition("}")[0] for k in keys}) > 1:
            raise InvalidLimit(
                "limits checked together must share their hash tag on Redis Cluster: a "
                "key's first and last segments ('yt:quota:{k}' and 'yt:search:{k}' share "
                "'yt:<k>'), or a tag of the keys' own in braces ('{yt}:quota' and "
                f"'{{yt}}:search'; '{{{{yt}}}}:quota' in a template), got keys {keys}"
            )
        return script_keys(keys, limits)

    def translate(self, exc: Exception, doing: str) -> RateLimitError:
        """The library's exception for a redis-py one (see ``failures``)."""
        kwargs = getattr(getattr(self.client, "connection_pool", None), "connection_kwargs", {})
        return translate(exc, doing, kwargs.get("username"), self.prefix)

    def _decided(self, call: ScriptCall, reply: Any, suffix: str | None = None) -> Decision:
        """The Decision a script's ``reply`` to ``call`` means, for a call that starts no
        reservation (only a reservation's start may find it spent). ``suffix``: what the
        call's token carries after its hex digits, when known (``decision.token_of``)."""
        status, remaining, retry_us, reset_us, denied_by, at_us = reply  # integers
        if status == SPENT:
            raise RuntimeError(f"script {call.script} answered 'spent' to {call.args[1]!r}")
        limits = call.limits
        reserved = status in (RESERVED, NOT_YET_DUE)
        allowed = status in (ALLOWED, STARTS_AT, SETTLED)
        paused = denied_by == len(limits) + 1
        token = None
        if reserved or allowed:
            raw = bytes(call.args[0])  # the token's bytes (ScriptCall.token)
            token = token_of(raw, call.costs) if suffix is None else raw.hex() + suffix
        return Decision(
            allowed=allowed,
            remaining=remaining,
            retry_after=retry_us / 1_000_000,
            reset_after=reset_us / 1_000_000,
            limit=limits[denied_by - 1] if denied_by and not paused else None,
            reserved=reserved,
            token=token,
            at=at_us / 1_000_000,
            paused=paused,
        )

    def _decision(self, call: ScriptCall, reply: Any) -> Decision | None:
        """The Decision a script's ``reply`` to ``call`` means; None if the reservation
        its token names was already started on (``SPENT``)."""
        return None if reply[0] == SPENT else self._decided(call, reply)
