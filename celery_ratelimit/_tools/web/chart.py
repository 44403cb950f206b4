"""Grants per second of the keys a page shows, over the last minutes, read from the
sliding logs' own entries: the decision path writes nothing more for the chart.

A log holds its entries for one window (a second, a minute, an hour...): this process
reads each log's entries newer than what it read before and keeps their counts by
second, so the chart reaches back as far as the longer of the windows and the time the
page has been watching. A key of the counter algorithm keeps no entries and is left out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from ..._engine.layout import ENTRY_FLOOR, KeyName, weight_of

#: Seconds the chart covers.
SPAN_S = 300
#: Logs whose counts are kept (the most recently read); a key beyond them starts again.
KEPT_KEYS = 5_000
_CHARTED = ("log", "cal")


class GrantHistory:
    """Per log key: counts of grants by second of Redis time, and the instant read up to."""

    def __init__(self, span_s: int = SPAN_S, kept: int = KEPT_KEYS) -> None:
        self.span_s = span_s
        self.kept = kept
        self._lock = threading.Lock()
        self._read_to: OrderedDict[str, int] = OrderedDict()
        self._counts: dict[str, dict[int, int]] = {}

    def grants(self, client: Any, names: Sequence[KeyName], now: int) -> list[int]:
        """Grants per second of the logs ``names`` for the :attr:`span_s` seconds up to
        ``now`` (µs of Redis time), the oldest first; reads what is new in them (one
        pipelined ``ZRANGEBYSCORE`` each).

        Raises:
            redis errors, as they come.
        """
        logs = sorted({n.redis_key for n in names if n.algorithm in _CHARTED})
        start = now // 1_000_000 - self.span_s + 1
        with self._lock:
            pipe = client.pipeline(transaction=False)
            for key in logs:
                since = max(self._read_to.get(key, 0), (start * 1_000_000) - 1, ENTRY_FLOOR)
                pipe.zrangebyscore(key, f"({since}", now, withscores=True)
            replies = pipe.execute(raise_on_error=False) if logs else []
            for key, entries in zip(logs, replies, strict=True):
                if isinstance(entries, ResponseError):
                    continue  # a name of our shape holding another type: not a log of ours
                if isinstance(entries, Exception):
                    raise entries
                counts = self._counts.setdefault(key, {})
                for member, score in entries:
                    second = int(score) // 1_000_000
                    counts[second] = counts.get(second, 0) + weight_of(member)
                for second in [s for s in counts if s < start]:
                    del counts[second]
                self._read_to[key] = now
                self._read_to.move_to_end(key)
            while len(self._read_to) > self.kept:
                old, _ = self._read_to.popitem(last=False)
                self._counts.pop(old, None)
            return [
                sum(self._counts.get(key, {}).get(second, 0) for key in logs)
                for second in range(start, start + self.span_s)
            ]


__all__ = ["SPAN_S", "GrantHistory"]
