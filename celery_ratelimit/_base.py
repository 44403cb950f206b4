"""What a limiter works out without Redis: a script call's keys and numbers, and the
Decision its reply means. :class:`Limiter` (redis-py) and :class:`AsyncLimiter`
(``redis.asyncio``) send the same calls to the same scripts."""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from ._decision import TOKEN_BYTES, Decision, token_bytes_of
from ._exceptions import InvalidLimit
from ._keys import escape_key
from ._layout import redis_key, script_keys, settings_key
from ._limit import Concurrency, Limit, LimitSpec, check_cost, describe, rate_algorithm, to_limits
from ._rate import Rate
from ._scripts import SETTLE, Shape, override_numbers, pause_numbers, shape, source
from ._upstream import seconds_from

#: Script modes (the first of the packed numbers, ARGV[2]); see the header of
#: lua/sliding_log.lua (and lua/gate.lua for RENEW, PAUSE and OVERRIDE).
ACQUIRE, RESERVE, PEEK, CONFIRM, RELEASE, RESTAMP, RENEW, PAUSE, OVERRIDE = range(9)
#: Reply statuses.
DENIED, ALLOWED, RESERVED, NOT_YET_DUE, RELEASED, SPENT, STARTS_AT, SETTLED = range(8)

DEFAULT_PREFIX = "ratelimit"
#: How many call shapes (key, limits, cost, options) a limiter remembers what it sends for.
KEY_CACHE_SIZE = 4096
#: The scripts a limiter registers, by the name its calls use.
SCRIPTS = {
    "log": "sliding_log",
    "counter": "sliding_counter",
    "concurrency": "concurrency",
    "park": "park",  # see _park
}


class ScriptCall(NamedTuple):
    """One call of a script: its name (a key of :data:`SCRIPTS`), KEYS, token (ARGV[1]),
    packed numbers (ARGV[2]) and the call's limits (to read the reply)."""

    script: str
    keys: list[str]
    token: bytes
    numbers: bytes
    limits: tuple[Any, ...] = ()


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
        if not isinstance(prefix, str) or not prefix or escape_key(prefix) != prefix:
            raise InvalidLimit(f"key prefix must be a plain non-empty string, got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self._cluster = hasattr(client, "get_nodes")
        self._scripts = {
            name: client.register_script(source(file)) for name, file in SCRIPTS.items()
        }
        self._checked = False  # Redis checked (version, scripts loaded): see check()
        # one check at a time: fifty greenlets of a cold node would each load the scripts
        self._check_lock = threading.Lock()
        # the script's keys for (key, shape), worked out and checked once: escaping and
        # formatting are most of a decision's Python, and a process decides for few
        # distinct keys and shapes
        self._sends: dict[tuple[Any, Shape], tuple[list[str], bytes]] = {}

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

    def _script_call(
        self,
        key: str | tuple[str, ...],
        shape: Shape,
        token: str | None = None,
        redis_keys: list[str] | None = None,
    ) -> ScriptCall:
        """The call of a decision of ``shape`` for ``key``: a code-given key, or a tuple
        of escaped keys, one per limit (as :meth:`keys_for` takes them); or, when
        ``redis_keys`` are given (from :meth:`keys_for`, or found by a scan), for them
        (``key`` is then ``()``). What a shape's cost, guard and hold mean: see
        ``_scripts.Shape``."""
        if redis_keys is None:
            every, numbers = self._prepared(key, shape)
        else:
            every, numbers = self._every(redis_keys, shape.limits), shape.numbers
        if shape.aligned:
            numbers += shape.calendar()
        token_bytes = token_bytes_of(token) if token else os.urandom(TOKEN_BYTES)
        return ScriptCall(rate_algorithm(shape.limits), every, token_bytes, numbers, shape.limits)

    def _renew_call(
        self, token: str, key: str | tuple[str, ...], limits: LimitSpec, lease: float | None
    ) -> ScriptCall | None:
        """The call that renews ``token``'s slots (None: the limits have none)."""
        token_bytes = token_bytes_of(token)
        slots = tuple(limit for limit in to_limits(limits) if isinstance(limit, Concurrency))
        if not slots:
            return None
        every, numbers = self._prepared(key, shape(slots, 1, RENEW, lease=lease))
        return ScriptCall("concurrency", every, token_bytes, numbers)

    def _settle_call(
        self,
        token: str,
        key: str | tuple[str, ...],
        limits: LimitSpec,
        cost: int | Sequence[int],
        was: int | Sequence[int],
    ) -> ScriptCall:
        """The call that makes ``token``'s counted cost ``cost`` (it was ``was``): one
        int for every limit, or one per limit."""
        normalized = to_limits(limits)
        olds = _per_limit(was, len(normalized), "was")
        for old in olds:
            check_cost(old, "was")
        call = self._script_call(
            key, shape(normalized, _per_limit(cost, len(normalized), "cost"), SETTLE), token
        )
        counted = [
            old for old, limit in zip(olds, normalized, strict=True) if isinstance(limit, Limit)
        ]
        return call._replace(numbers=call.numbers + struct.pack(f"<{len(counted)}d", *counted))

    def _pause_call(self, key: str, seconds: float | str | Any) -> ScriptCall | None:
        """The call that pauses ``key`` (None: no time to pause for)."""
        if not isinstance(key, str) or not key:
            raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
        return self._pause_keys_call([escape_key(key)], seconds_from(seconds))

    def _pause_keys_call(self, escaped: Sequence[str], seconds: float) -> ScriptCall | None:
        keys = sorted({settings_key(self.prefix, k) for k in escaped})
        if seconds <= 0:
            return None
        numbers = pause_numbers(min(seconds, 366 * 86_400.0), len(keys))
        return ScriptCall("concurrency", keys, os.urandom(TOKEN_BYTES), numbers)

    def _override_call(self, key: str, rate: str | Rate | None, ttl: float | None) -> ScriptCall:
        if not isinstance(key, str) or not key:
            raise InvalidLimit(f"key must be a non-empty string, got {key!r}")
        numbers = override_numbers(None if rate is None else Rate.parse(rate), ttl)
        keys = [settings_key(self.prefix, escape_key(key))]
        return ScriptCall("concurrency", keys, os.urandom(TOKEN_BYTES), numbers)

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

    def _decision(self, call: ScriptCall, reply: Any) -> Decision | None:
        """The Decision a script's ``reply`` to ``call`` means; None if the reservation
        its token names was already started on (``SPENT``)."""
        limits, token_bytes = call.limits, call.token
        if len(reply) == 3:  # allowed now by its one limit: the script's short reply
            remaining, reset_us, at_us = reply
            return Decision(
                allowed=True,
                remaining=remaining,
                retry_after=0.0,
                reset_after=reset_us / 1_000_000,
                token=token_bytes.hex(),
                at=at_us / 1_000_000,
            )
        status, remaining, retry_us, reset_us, denied_by, at_us = reply  # integers
        if status == SPENT:
            return None
        reserved = status in (RESERVED, NOT_YET_DUE)
        allowed = status in (ALLOWED, STARTS_AT, SETTLED)
        paused = denied_by == len(limits) + 1
        return Decision(
            allowed=allowed,
            remaining=remaining,
            retry_after=retry_us / 1_000_000,
            reset_after=reset_us / 1_000_000,
            limit=limits[denied_by - 1] if denied_by and not paused else None,
            reserved=reserved,
            token=token_bytes.hex() if reserved or allowed else None,
            at=at_us / 1_000_000,
            paused=paused,
        )
