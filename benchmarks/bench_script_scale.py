"""Redis time per script call against the limit's size: ``python -m benchmarks.bench_script_scale``.

For limits of 10 to 100,000 per 30 s, the log is filled to the limit (a full window, as
a saturated key keeps it), 10,000 reservations are made after it (their tasks not yet
started, as a backlog leaves them), then each script path is called and timed by the
limiter's Redis itself (``INFO commandstats``, microseconds per ``EVALSHA``): an
acquisition that is denied, a reservation, a start of a task whose slot was lost (from
now, the path of every late or overdue start), a restamp of a granted call, a release
of a reservation, and a peek. Every entry weighs 1 (the script counts and ranks); then
the same with weights 1 and 2 mixed, whose counts are walks. Last, the confirmation of
a reservation whose slot has come (a deferred task's copy), one window later, each call
timed by the slow log. The figure to read is each path's time at a limit of 100,000 over
its time at 100.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import redis

from benchmarks.output import save
from celery_ratelimit import Limit, Limiter
from celery_ratelimit._engine.base import ALLOWED, STARTS_AT
from celery_ratelimit._engine.scripts import MAX_HORIZON, shape
from celery_ratelimit._tools.embedded import RedisServer
from tests.measure import server_us

#: Each call timed: the entry script and its flag (see each ``lua/*.lua`` header).
ACQUIRE, RESERVE, PEEK = ("acquire", "now"), ("acquire", "reserve"), ("acquire", "peek")
CONFIRM, RESTAMP, RELEASE = ("start", "reserved"), ("start", "granted"), ("release", "log")
LIMITS = (10, 100, 1_000, 10_000, 100_000)
PENDING = 10_000
CALLS = 200
BATCH = 2_000
#: Reservations confirmed per key once due (confirm_due).
DUE = 100


def _send(
    client: redis.Redis,
    limiter: Limiter,
    limit: Limit,
    calls: list[tuple[tuple[str, str], int, bytes]],
    key: str = "scale",
) -> list[Any]:
    """Pipelined script calls ((script, flag), cost, token) on ``limit``'s ``key``; their
    replies."""
    replies: list[Any] = []
    for start in range(0, len(calls), BATCH):
        pipe = client.pipeline(transaction=False)
        for (script, flag), cost, token in calls[start : start + BATCH]:
            options = shape((limit,), cost, MAX_HORIZON, 0.03, 0.2)
            call = limiter._decision_call(script, flag, key, options, token.hex())
            sha = limiter._scripts[call.script].sha
            pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)
        replies += pipe.execute()
    return replies


def _timed(client: redis.Redis, send: Any) -> float:
    client.config_resetstat()
    send()
    stats = client.info("commandstats")["cmdstat_evalsha"]
    return round(float(stats["usec_per_call"]), 1)


def _fill(
    client: redis.Redis, limiter: Limiter, limit: Limit, mixed: bool, key: str = "scale"
) -> tuple[list[bytes], list[tuple[tuple[str, str], int, bytes]], list[Any]]:
    """A full window on ``key`` (grants until the weight reaches the limit), then
    PENDING reservations after it: the grants' tokens, the reservations and their
    replies."""
    size = limit.fixed_rate.limit

    def cost(i: int) -> int:
        return 1 + i % 2 if mixed and size > 1 else 1

    granted: list[bytes] = []
    weight = 0
    while weight < size:
        token = os.urandom(8)
        c = min(cost(len(granted)), size - weight)
        _send(client, limiter, limit, [(ACQUIRE, c, token)], key)
        granted.append(token)
        weight += c
        if len(granted) == 1:  # the rest in bulk, now that the key exists
            rest = []
            while weight < size:
                c = min(cost(len(granted) + len(rest)), size - weight)
                rest.append((ACQUIRE, c, os.urandom(8)))
                weight += c
            _send(client, limiter, limit, rest, key)
            granted += [t for _, _, t in rest]
    reserved = [(RESERVE, cost(i), os.urandom(8)) for i in range(PENDING)]
    return granted, reserved, _send(client, limiter, limit, reserved, key)


def one_limit(client: redis.Redis, limiter: Limiter, size: int, mixed: bool) -> dict[str, Any]:
    client.flushdb()
    limit = Limit(f"{size}/30s")

    def cost(i: int) -> int:
        return 1 + i % 2 if mixed and size > 1 else 1

    granted, reserved, _ = _fill(client, limiter, limit, mixed)
    out = {
        "acquire (denied)": _timed(
            client,
            lambda: _send(
                client, limiter, limit, [(ACQUIRE, 1, os.urandom(8)) for _ in range(CALLS)]
            ),
        ),
        "reserve": _timed(
            client,
            lambda: _send(
                client, limiter, limit, [(RESERVE, cost(i), os.urandom(8)) for i in range(CALLS)]
            ),
        ),
        "start, slot lost": _timed(
            client,
            lambda: _send(
                client, limiter, limit, [(CONFIRM, cost(i), os.urandom(8)) for i in range(CALLS)]
            ),
        ),
        "restamp": _timed(
            client,
            lambda: _send(
                client,
                limiter,
                limit,
                [(RESTAMP, cost(i), granted[-1 - i]) for i in range(min(CALLS, len(granted)))],
            ),
        ),
        "release": _timed(
            client,
            lambda: _send(
                client,
                limiter,
                limit,
                [(RELEASE, c, t) for _, c, t in reserved[:CALLS]],
            ),
        ),
        "peek": _timed(
            client,
            lambda: _send(client, limiter, limit, [(PEEK, 1, os.urandom(8)) for _ in range(CALLS)]),
        ),
    }
    return out


def confirm_due(client: redis.Redis, limiter: Limiter, limits: tuple[int, ...]) -> dict[str, float]:
    """Server µs per confirmation of a reservation whose slot has come (the path of every
    deferred task's copy), by limit: each key is filled as in :func:`one_limit` (a full
    window, PENDING reservations after it), then, one window later, the first DUE
    reservations of every key (at most a window's) are confirmed as their slots come (a
    copy a few ms after its eta). Every entry weighs 1. Every key shares the one wait;
    the slow log times each call.

    Raises:
        RuntimeError: a due slot was not started (the path timed would be another).
    """
    client.flushdb()
    due: list[tuple[int, int, int, bytes]] = []  # slot µs, size, cost, token
    for size in sorted(limits, reverse=True):
        _, reserved, replies = _fill(client, limiter, Limit(f"{size}/30s"), False, f"due{size}")
        due += [
            (reply[5], size, c, token)
            # the first window's slots only (a limit of 10 has 10)
            for (_, c, token), reply in list(zip(reserved, replies, strict=True))[: min(DUE, size)]
        ]
    due.sort()
    sha = limiter._scripts[shape((Limit("10/s"),), 1).script("start")].sha
    before = client.config_get("slowlog-*")
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 100_000)
    client.slowlog_reset()
    while due:
        now = server_us(client)
        ready = [one for one in due if one[0] <= now]
        if not ready:
            time.sleep(min(max((due[0][0] - now) / 1_000_000, 0.0005), 1.0))
            continue
        due = due[len(ready) :]
        for _, size, c, token in ready:
            limit = Limit(f"{size}/30s")
            [reply] = _send(client, limiter, limit, [(CONFIRM, c, token)], f"due{size}")
            if reply[0] not in (ALLOWED, STARTS_AT):
                raise RuntimeError(f"a due slot of limit {size} was answered {reply}")
    timed: dict[int, list[int]] = {size: [] for size in limits}
    for entry in client.slowlog_get(1_000_000):
        words = entry["command"].decode(errors="replace").split()
        if len(words) > 3 and words[0].upper() == "EVALSHA" and words[1] == sha:
            size = int(words[3].partition("due")[2].split(":")[0].strip("{}"))
            timed[size].append(int(entry["duration"]))
    for name, value in before.items():
        client.config_set(name, value)
    return {str(size): statistics.median(us) for size, us in timed.items()}


def run(limits: tuple[int, ...] = LIMITS) -> dict[str, Any]:
    server = RedisServer()
    try:
        client = server.client()
        limiter = Limiter(client)
        limiter.check()
        results: dict[str, Any] = {}
        for mixed in (False, True):
            label = "weights 1 and 2" if mixed else "weights all 1"
            results[label] = {str(size): one_limit(client, limiter, size, mixed) for size in limits}
        # a path of the uniform weights' table, as the others are
        due = confirm_due(client, limiter, limits)
        for size, usec in due.items():
            results["weights all 1"][size]["confirm, slot due"] = usec
        return results
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    results = run()
    save("script_scale.json", results)
    for label, by_size in results.items():
        paths = list(next(iter(by_size.values())))
        print(f"{label}: server us per call, limit per 30 s ({PENDING} reservations pending)")
        print(f"  {'path':28}" + "".join(f"{size:>10}" for size in by_size) + "  100k/100")
        for path in paths:
            row = [by_size[size][path] for size in by_size]
            ratio = by_size["100000"][path] / max(by_size["100"][path], 0.1)
            print(f"  {path:28}" + "".join(f"{x:>10}" for x in row) + f"  {ratio:8.2f}")


if __name__ == "__main__":
    main()
