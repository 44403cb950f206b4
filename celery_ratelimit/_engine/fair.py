"""Fair shares as ``status`` and ``explain`` read them: who waits on a fair limit's key,
and where a new call would take its place (``lua/lib/fair.lua`` places it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .layout import FAIR_STATE, FAIR_TAGS, PENDING

#: Prefix of a fair state hash's field holding a waiting call's value: ``"m:" + member``.
MEMBER_FIELD = b"m:"


def waiting_by_value(client: Any, redis_key: str) -> dict[str, int]:
    """How many calls of each fair-key value (escaped) wait for a slot of the log
    ``redis_key``: their reservation is kept and their task has not started."""
    fields = {
        name[len(MEMBER_FIELD) :]: value
        for name, value in client.hgetall(redis_key + FAIR_STATE).items()
        if name.startswith(MEMBER_FIELD)
    }
    if not fields:
        return {}
    members = list(fields)
    slots = client.zmscore(redis_key + PENDING, members)
    counts = Counter(
        fields[member].decode() for member, slot in zip(members, slots, strict=True) if slot
    )
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class Place:
    """Where a new waiting call of ``value`` would be placed now: ``ahead`` waiting
    calls before it, of ``waiting`` with a slot still to come."""

    value: str
    weight: float
    ahead: int
    waiting: int


def place_of(
    client: Any, redis_key: str, value: str, weight: float, cost: int, now_us: int
) -> Place:
    """The place a reservation of ``value`` would take now, as ``fair_place`` in
    ``lua/lib/fair.lua`` works it out (nothing is written)."""
    pending = client.zrangebyscore(redis_key + PENDING, f"({now_us}", "+inf")
    if not pending:
        return Place(value, weight, 0, 0)
    stored, last = client.hmget(redis_key + FAIR_STATE, "", f"f:{value}")
    head = client.zscore(redis_key + FAIR_TAGS, pending[0])
    virtual = max(float(stored or 0), float(head or 0))
    tag = max(virtual, float(last or 0)) + cost / weight
    future = set(pending)
    rows = client.zrangebyscore(redis_key + FAIR_TAGS, virtual, tag)
    return Place(value, weight, sum(row in future for row in rows), len(pending))


__all__ = ["Place", "place_of", "waiting_by_value"]
