"""Limiter cost, side by side on one private redis-server: ``python -m benchmarks.bench_limiter``.

(a) client-side: mean ``acquire`` time over mean ``PING`` time on the same client
    (``client.ping()``: a pooled connection, redis-py's usual path), interleaved
    rounds, for a limit that never binds, a limit that binds (mostly denials), the
    anchors (``limits``, ``throttled-py``), and the bounds: a PING, an EVALSHA of
    ``return 1`` and the floor script sent on a held connection, as ours is.
(b) server-side: ``cmdstat_evalsha`` microseconds per call (INFO commandstats after
    CONFIG RESETSTAT) at cost 1 and cost 1000, and with 2 and 4 stacked limits, in
    steady state (entries expire as fast as they arrive).
(b3) a backlog: ``cmdstat_evalsha`` microseconds per reserving call behind a line of
    reservations (2/s, 300 ahead: the first fit walks the line's first entries), and per
    start of a reservation whose slot has come (a deferred task's second call), beside
    a plain call's in the same run.
(c) memory: MEMORY USAGE per entry of a full log key at limits 100, 1000, 10000, and
    the bytes of a counter key.

Prints a table and writes ``benchmarks/results/limiter.json``.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.output import save
from celery_ratelimit import Limit, Limiter
from celery_ratelimit._engine.client import HeldConnection
from celery_ratelimit._engine.scripts import source
from celery_ratelimit._tools.embedded import RedisServer

#: Physical floors on this server, in scripts that do nothing else (no arguments read,
#: no reply built). NOOP: what any script-based limiter pays for EVALSHA itself. FLOOR3:
#: the least any exact decision needs: the clock, one read of the key, one write.
#: FLOOR (4 commands): an exact log that also prunes expired entries, as ours does.
NOOP_SCRIPT = "return 1"
FLOOR3_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZMSCORE', KEYS[1], '', '+', '=', '~')
redis.call('ZADD', KEYS[1], now, ARGV[1], 1, '')
return 1
"""


def floor_script(window_us: int) -> str:
    """FLOOR (4 commands) over a log of ``window_us`` microseconds."""
    return f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZMSCORE', KEYS[1], '', '+', '=', '~')
redis.call('ZREMRANGEBYSCORE', KEYS[1], 1e13, now - {window_us})
redis.call('ZADD', KEYS[1], now, ARGV[1], 1, '')
return 1
"""


FLOOR_SCRIPT = floor_script(200_000)
#: The seed algorithm, bare: a sliding log of one weight, no meta, no settings.
SEED_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, now - 200000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 1200)
return 1
"""
#: What the contract needs on top of the seed: the key's settings (a pause, a rate
#: override: every decision reads them), the running total of weights (cost 1000 costs
#: what cost 1 does), and the entry written with the total and the newest instant.
CONTRACT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('HMGET', KEYS[2], 'pause', 'rate')
local meta = redis.call('ZMSCORE', KEYS[1], '', '+', '=', '~')
local gone = redis.call('ZREMRANGEBYSCORE', KEYS[1], 1e13, now - 200000)
redis.call('ZADD', KEYS[1], now, ARGV[1], (tonumber(meta[1]) or 0) - gone + 1, '', -now, '+')
return {1, 0, 0, 0, 0, now}
"""
#: Exactly the commands ours sends for a plain decision that never binds, and nothing
#: else: the settings, the log's meta members, a count of the expired entries when the
#: log holds more than 500 (pruning is bounded to 500 a call), the prune, the entry.
#: Sent the same KEYS and ARGV as ours (lua/acquire_one.lua), so Redis converts as many, on
#: a log holding the same meta members (its first entry writes the unit and the expiry
#: too: ZMSCORE then formats as many scores as it does for ours).
OURS_BARE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('HMGET', KEYS[3], 'pause', 'rate', 'up')
local meta = redis.call('ZMSCORE', KEYS[1], '', '+', '=', '~')
local total, cutoff = tonumber(meta[1]) or 0, now - tonumber(ARGV[11])
if total > 500 then redis.call('ZCOUNT', KEYS[1], 1e13, cutoff) end
local gone = redis.call('ZREMRANGEBYSCORE', KEYS[1], 1e13, cutoff)
if total == 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[1], 1, '', -now, '+', 1, '=', -(now + 3.6e9), '~')
else
  redis.call('ZADD', KEYS[1], now, ARGV[1], total - gone + 1, '', -now, '+')
end
return {1, 0, 0, 0, 0, now}
"""
ROUNDS = 15
ANCHOR = "anchor: limits moving window hit"
CALLS = 2_000
#: Calls of one variant in a row in (b2): short enough for every variant to see the same
#: moments, long enough for each to run as it does alone (its script warm).
BATCH = 100


def _table(title: str, rows: dict[str, Any], line: Callable[[str, Any], str]) -> None:
    """Print one part of the results: its title, then a line per row."""
    print(f"\n{title}")
    for name, row in rows.items():
        print(f"    {line(name, row)}")


def _per_call(width: int) -> Callable[[str, Any], str]:
    """A line of a table of Redis µs per call: the row's name, then its figure."""
    return lambda name, row: (
        f"{name:{width}} {row['usec_per_call'] if isinstance(row, dict) else row:8}"
    )


def _mean_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def client_side(server: RedisServer, rounds: int, calls: int) -> dict[str, Any]:
    """(a): every operation timed once per round, rounds interleaved."""
    client = server.client()
    limiter = Limiter(client, prefix="bench-a")
    free = [Limit("1000000000/s")]
    free_and_day = [*free, Limit("1000000000/d", align="America/Los_Angeles")]
    binding = [Limit("100/s")]
    # the bounds send on a connection of their own, as the limiter does (HeldConnection)
    held = HeldConnection.for_client(server.client())
    assert held is not None
    noop = client.script_load(NOOP_SCRIPT)
    floor = client.script_load(FLOOR_SCRIPT)
    ops: dict[str, Callable[[], object]] = {
        "ping": client.ping,
        "acquire (not binding)": lambda: limiter.acquire("free", free),
        "acquire (binding)": lambda: limiter.acquire("busy", binding),
        # its zone's window boundaries worked out and sent with the call (no round trip)
        "acquire (not binding, + aligned day)": lambda: limiter.acquire("day", free_and_day),
        "bound: PING on a held connection": lambda: held.call("PING"),
        "bound: EVALSHA of 'return 1'": lambda: held.call("EVALSHA", noop, 0),
        "bound: floor script (4 commands)": lambda: held.call(
            "EVALSHA", floor, 1, "floor-a", os.urandom(8)
        ),
    }
    try:
        from limits import parse
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter, SlidingWindowCounterRateLimiter

        storage = RedisStorage(server.url)
        moving = MovingWindowRateLimiter(storage)
        sliding = SlidingWindowCounterRateLimiter(storage)
        item = parse("1000000000/second")
        ops["limits moving window"] = lambda: moving.hit(item, "bench")
        ops["limits sliding counter"] = lambda: sliding.hit(item, "bench-sw")
    except ImportError:  # the bench extra is not installed
        pass
    try:
        from throttled import RateLimiterType, Throttled, rate_limiter, store

        throttled_store = store.RedisStore(server=server.url)
        for label, using in (
            ("throttled-py GCRA", RateLimiterType.GCRA.value),
            ("throttled-py sliding window", RateLimiterType.SLIDING_WINDOW.value),
        ):
            limiter_ = Throttled(
                key=label, using=using, quota=rate_limiter.per_sec(10**9), store=throttled_store
            )
            ops[label] = limiter_.limit
    except ImportError:
        pass
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for fn in ops.values():  # warm up connections, script cache, code paths
        _mean_us(fn, 200)
    for _ in range(rounds):
        for name, fn in ops.items():
            samples[name].append(_mean_us(fn, calls))
    ping = statistics.fmean(samples["ping"])
    out: dict[str, Any] = {}
    for name, values in samples.items():
        mean = statistics.fmean(values)
        out[name] = {"mean_us": round(mean, 2), "x_ping": round(mean / ping, 3)}
    client.close()
    return out


def _evalsha_usec(client: redis.Redis, command: str = "evalsha") -> tuple[float, int]:
    stats = client.info("commandstats")[f"cmdstat_{command}"]
    return float(stats["usec_per_call"]), int(stats["calls"])


def _as_function(client: redis.Redis, name: str) -> str | None:
    """The entry script ``name`` loaded as a Redis Function (``FUNCTION LOAD``, Redis 7+),
    its body unchanged (KEYS and ARGV become its parameters); None where the server has
    no functions."""
    library = (
        f"#!lua name=crl_{name}\n"
        f"redis.register_function('crl_{name}', function(KEYS, ARGV)\n{source(name)}\nend)\n"
    )
    try:
        client.function_load(library, replace=True)
    except redis.ResponseError:
        return None
    return f"crl_{name}"


def server_side(server: RedisServer, rounds: int, calls: int) -> dict[str, Any]:
    """(b): Redis-side cost per decision, steady state with entries expiring."""
    client = server.client()
    limiter = Limiter(client, prefix="bench-b")
    windows = ["200ms", "300ms", "400ms", "500ms"]
    cases = {
        "cost 1": ([Limit(f"1000000000/{windows[0]}")], 1),
        "cost 1000": ([Limit(f"1000000000/{windows[0]}")], 1000),
        "cost 1, 2 limits": ([Limit(f"1000000000/{w}") for w in windows[:2]], 1),
        "cost 1, 4 limits": ([Limit(f"1000000000/{w}") for w in windows], 1),
        # a runtime override of the key's rate, read by the same HMGET as a pause
        "cost 1, rate overridden": ([Limit(f"1000000000/{windows[0]}")], 1),
        # a calendar-aligned day (its boundaries sent with the call) alone, and beside
        # a sliding limit in the same call
        "cost 1, aligned day": ([Limit("1000000000/d", align="America/Los_Angeles")], 1),
        "cost 1, + aligned day": (
            [Limit(f"1000000000/{windows[0]}"), Limit("1000000000/d", align="America/Los_Angeles")],
            1,
        ),
    }
    limiter.override("cost1rateoverridden", f"999999999/{windows[0]}")
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for name, (limits, cost) in cases.items():  # fill every window once
        key = name.replace(" ", "").replace(",", "")
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            limiter.acquire(key, limits, cost)
    for _ in range(rounds):
        for name, (limits, cost) in cases.items():
            key = name.replace(" ", "").replace(",", "")
            client.config_resetstat()
            for _ in range(calls):
                if not limiter.acquire(key, limits, cost).allowed:
                    raise RuntimeError(f"{name}: the benchmark limit bound")
            usec, count = _evalsha_usec(client)
            assert count == calls, (name, count)
            samples[name].append(usec)
    out = {name: {"usec_per_call": round(statistics.median(v), 2)} for name, v in samples.items()}
    # The physical floors on this server (see the scripts above), same rounds.
    floors = {
        "bound: EVALSHA of 'return 1'": client.register_script(NOOP_SCRIPT),
        "floor3: TIME+ZMSCORE+ZADD": client.register_script(FLOOR3_SCRIPT),
        "floor: TIME+ZMSCORE+ZREMRANGEBYSCORE+ZADD": client.register_script(FLOOR_SCRIPT),
        "seed: TIME+ZREMRANGEBYSCORE+ZADD+PEXPIRE": client.register_script(SEED_SCRIPT),
        "contract: seed + settings + running total": client.register_script(CONTRACT_SCRIPT),
    }
    # The pruning floor runs on a log of its own in the steady state ours is measured in
    # (full, an entry leaving the window per call); the others on a fresh key each round
    # (FLOOR3 never prunes).
    steady = {
        "floor: TIME+ZMSCORE+ZREMRANGEBYSCORE+ZADD": "{floor}-steady",
        "seed: TIME+ZREMRANGEBYSCORE+ZADD+PEXPIRE": "{floor}-seed",
        "contract: seed + settings + running total": "{floor}-contract",
    }
    for name, key in steady.items():
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            floors[name](keys=[key, key + ":settings"], args=[os.urandom(8)])
    floor_samples: dict[str, list[float]] = {name: [] for name in floors}
    for _ in range(rounds):
        for name, script in floors.items():
            key = steady.get(name, "{floor}")
            if name not in steady:
                client.delete(key)
            client.config_resetstat()
            for _ in range(calls):
                script(keys=[key, key + ":settings"], args=[os.urandom(8)])
            floor_samples[name].append(_evalsha_usec(client)[0])
    for name, values in floor_samples.items():
        out[name] = {"usec_per_call": round(statistics.median(values), 2)}
    # The anchor: `limits`' moving window (a list, the client's clock; 4 commands), its
    # log as full as ours, in rounds of its own (interleaving would mix its stats)
    try:
        from limits import parse
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter
    except ImportError:
        pass
    else:
        moving, item = MovingWindowRateLimiter(RedisStorage(server.url)), parse("1000000000/second")
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            moving.hit(item, "bench-b")
        anchor: list[float] = []
        for _ in range(rounds):
            client.config_resetstat()
            for _ in range(calls):
                moving.hit(item, "bench-b")
            anchor.append(_evalsha_usec(client)[0])
        out[ANCHOR] = {"usec_per_call": round(statistics.median(anchor), 2)}
        out[f"cost 1 / {ANCHOR}"] = round(
            out["cost 1"]["usec_per_call"] / out[ANCHOR]["usec_per_call"], 3
        )
    floor_us = out["floor: TIME+ZMSCORE+ZREMRANGEBYSCORE+ZADD"]["usec_per_call"]
    out["cost 1 / floor"] = round(out["cost 1"]["usec_per_call"] / floor_us, 3)
    for name in ("seed", "contract"):
        bound = next(v for k, v in out.items() if k.startswith(name + ":"))
        out[f"cost 1 / {name}"] = round(out["cost 1"]["usec_per_call"] / bound["usec_per_call"], 3)
    out["cost 1000 / cost 1"] = round(
        out["cost 1000"]["usec_per_call"] / out["cost 1"]["usec_per_call"], 3
    )
    out["cost 1, + aligned day / cost 1"] = round(
        out["cost 1, + aligned day"]["usec_per_call"] / out["cost 1"]["usec_per_call"], 3
    )
    client.close()
    return out


def plain_beside_bare(server: RedisServer, rounds: int, calls: int) -> dict[str, Any]:
    """(b2): a plain decision that never binds, beside the bare script of exactly its
    commands (same KEYS and ARGV) and `limits`' moving window, on a log of more than 500
    entries (200 ms window: pruning counts first) and of fewer (10 ms).

    Each call is timed by Redis itself (``SLOWLOG`` at 0 µs: the time of each command,
    its script's commands included), in batches of ``BATCH`` calls taking turns in an
    order that rotates each round, so that every variant sees the same moments of the
    machine and each place in the turn: the median of each variant's per-round mean."""
    client = server.client()
    limiter = Limiter(client, prefix="bench-b2")
    bare = client.script_load(OURS_BARE_SCRIPT)
    function = _as_function(client, "acquire_one")
    ops: dict[str, Callable[[], object]] = {}
    for window in ("200ms", "10ms"):
        limits = [Limit(f"1000000000/{window}")]
        key = f"plain{window}"
        ops[f"ours, {window}"] = lambda key=key, limits=limits: limiter.acquire(key, limits)
        prepared = limiter._prepare_acquire(limits)
        assert prepared is not None
        if function is not None:  # the same script as a function: what FCALL would save
            sends = limiter._prepared((f"fcall{window}",), prepared.shape)
            ops[f"ours as FCALL, {window}"] = lambda sends=sends, more=prepared.arguments: (
                client.execute_command(
                    "FCALL", function, len(sends), *sends, os.urandom(8), "now", *more
                )
            )
        keys = limiter._prepared((f"bare{window}",), prepared.shape)
        ops[f"bare, {window}"] = lambda keys=keys, args=prepared.arguments: client.evalsha(
            bare, len(keys), *keys, os.urandom(8), "now", *args
        )
    try:
        from limits import parse
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter
    except ImportError:
        pass
    else:
        moving, item = MovingWindowRateLimiter(RedisStorage(server.url)), parse("1000000000/second")
        ops["limits moving window hit"] = lambda: moving.hit(item, "bench-b2")
    names = list(ops)
    samples: dict[str, list[float]] = {name: [] for name in names}
    client.config_set("slowlog-max-len", len(names) * calls * 2)
    try:
        for name in names:  # fill every window, warm the scripts
            deadline = time.monotonic() + 1.2
            while time.monotonic() < deadline:
                ops[name]()
        for turn in range(rounds):
            order = names[turn % len(names) :] + names[: turn % len(names)]
            client.slowlog_reset()
            client.config_set("slowlog-log-slower-than", 0)
            for _ in range(calls // BATCH):
                for name in order:
                    for _ in range(BATCH):
                        ops[name]()
            client.config_set("slowlog-log-slower-than", 10_000)
            durations: dict[str, list[int]] = {name: [] for name in names}
            for entry in client.slowlog_get(len(names) * calls * 2):
                name = _slowlog_variant(entry["command"])
                if name is not None:
                    durations[name].append(entry["duration"])
            for name in names:
                samples[name].append(statistics.mean(durations[name]))
    finally:
        client.config_set("slowlog-log-slower-than", 10_000)
        client.slowlog_reset()
    out: dict[str, Any] = {
        name: {"usec_per_call": round(statistics.median(v), 2)} for name, v in samples.items()
    }
    for window in ("200ms", "10ms"):
        ours = out[f"ours, {window}"]["usec_per_call"]
        out[f"ours / bare, {window}"] = round(ours / out[f"bare, {window}"]["usec_per_call"], 3)
        if f"ours as FCALL, {window}" in out:
            fcall = out[f"ours as FCALL, {window}"]["usec_per_call"]
            out[f"FCALL / EVALSHA, {window}"] = round(fcall / ours, 3)
        if "limits moving window hit" in out:
            anchor = out["limits moving window hit"]["usec_per_call"]
            out[f"ours / limits, {window}"] = round(ours / anchor, 3)
    client.close()
    return out


def _slowlog_variant(command: bytes) -> str | None:
    """The (b2) variant a SLOWLOG entry's command line is a call of, by its first key."""
    words = command.split()
    if not words or words[0].upper() not in (b"EVALSHA", b"FCALL") or len(words) < 4:
        return None
    key = words[3].decode(errors="replace")
    if key.startswith("LIMITS"):
        return "limits moving window hit"
    for window in ("200ms", "10ms"):
        if key.endswith(window) or f"{window}}}" in key:
            if "{fcall" in key:
                return f"ours as FCALL, {window}"
            if "{bare" in key:
                return f"bare, {window}"
            if "{plain" in key:
                return f"ours, {window}"
    return None


def backlog(server: RedisServer, rounds: int, calls: int) -> dict[str, Any]:
    """(b3): Redis-side cost of a reserving call behind a line of reservations, of a
    reservation's start at its slot (a deferred task's second call), and of a plain call
    that never binds, interleaved."""
    client = server.client()
    limiter = Limiter(client, prefix="bench-b3")
    line, free = Limit("2/s"), Limit("1000000000/200ms")
    for _ in range(300):
        limiter.acquire("line", line, reserve=True, horizon=86_400)
    samples: dict[str, list[float]] = {
        "reserve behind 300": [],
        "plain, never binds": [],
        "start at its slot": [],
    }
    # a deferred task's second call: its reservation started when its slot comes, in a
    # window of `calls` that as many plain calls filled, and as many reservations follow
    due = Limit(f"{calls}/200ms")
    for round_ in range(rounds):
        for name in samples:
            tokens = []
            if name == "start at its slot":
                for _ in range(calls):
                    limiter.acquire(f"due{round_}", due)
                for _ in range(calls):
                    tokens.append(limiter.acquire(f"due{round_}", due, reserve=True).token)
                time.sleep(0.25)  # every slot has come
            client.config_resetstat()
            for i in range(calls):
                if name == "plain, never binds":
                    limiter.acquire("free", free)
                elif name == "start at its slot":
                    limiter.confirm(tokens[i], f"due{round_}", due)
                else:
                    limiter.acquire("line", line, reserve=True, horizon=86_400)
            usec, count = _evalsha_usec(client)
            samples[name].append(usec * count / calls)  # a call that took two scripts
    out: dict[str, Any] = {
        k: {"usec_per_call": round(statistics.median(v), 2)} for k, v in samples.items()
    }
    plain = out["plain, never binds"]["usec_per_call"]
    out["reserve / plain"] = round(out["reserve behind 300"]["usec_per_call"] / plain, 3)
    out["start / plain"] = round(out["start at its slot"]["usec_per_call"] / plain, 3)
    client.close()
    return out


def memory(server: RedisServer) -> dict[str, Any]:
    """(c): bytes per entry of a full log key, and of a counter key."""
    client = server.client()
    limiter = Limiter(client, prefix="bench-c")
    out: dict[str, Any] = {}
    for size in (100, 1000, 10000):
        limits = [Limit(f"{size}/h")]
        pipe_calls = 0
        while limiter.acquire(f"full{size}", limits).allowed:
            pipe_calls += 1
        key = limiter.keys_for(f"full{size}", limits)[0]
        used = int(client.memory_usage(key, samples=0))
        out[f"log {size}"] = {
            "entries": pipe_calls,
            "bytes": used,
            "bytes_per_entry": round(used / pipe_calls, 1),
            "encoding": client.object("encoding", key).decode(),
        }
    counter = [Limit("1000/h", algorithm="counter")]
    limiter.acquire("counter", counter, 7)
    key = limiter.keys_for("counter", counter)[0]
    out["counter"] = {"bytes": int(client.memory_usage(key, samples=0))}
    out.update(_listpack_tuning(client, limiter))
    # What a log outside a sorted set would take: 10,000 stamps as stream entries (ID =
    # the microsecond, one empty field), which Redis packs into listpacks it appends to.
    stamp = int(time.time() * 1_000_000)
    pipe = client.pipeline(transaction=False)
    for i in range(10_000):
        pipe.xadd("stream-log", {"": ""}, id=f"{stamp + 100 * i}-1")
    pipe.execute()
    used = int(client.memory_usage("stream-log", samples=0))
    out["log 10000 as a stream"] = {"bytes_per_entry": round(used / 10_000, 1), "bound": True}
    client.delete("stream-log")
    client.close()
    return out


def _listpack_tuning(client: redis.Redis, limiter: Limiter) -> dict[str, Any]:
    """What the server setting ``zset-max-listpack-entries`` trades: a log of 10,000
    entries kept as a listpack (compact, O(n) to update) instead of a skiplist, in
    bytes per entry and server microseconds per decision, both encodings side by side."""
    out: dict[str, Any] = {}
    default = client.config_get("zset-max-listpack-entries")["zset-max-listpack-entries"]
    try:
        for label, setting in (("skiplist", default), ("listpack", "20000")):
            client.config_set("zset-max-listpack-entries", setting)
            limits = [Limit("20000/h")]
            name = f"tuned-{label}"
            for _ in range(10_000):
                limiter.acquire(name, limits)
            key = limiter.keys_for(name, limits)[0]
            used = int(client.memory_usage(key, samples=0))
            client.config_resetstat()
            for _ in range(500):
                limiter.acquire(name, limits)
            usec, _ = _evalsha_usec(client)
            out[f"log 10000, {label}"] = {
                "entries": 10_000,
                "bytes": used,
                "bytes_per_entry": round(used / 10_000, 1),
                "encoding": client.object("encoding", key).decode(),
                "usec_per_decision": usec,
            }
            client.delete(key)
    finally:
        client.config_set("zset-max-listpack-entries", default)
    return out


def _hammer(url: str, seconds: float, key: str) -> int:
    limiter = Limiter.from_url(url, prefix="bench-d")
    limits = [Limit("1000000000/s")]
    done = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(50):
            limiter.acquire(key, limits)
        done += 50
    return done


def throughput(server: RedisServer, seconds: float = 2.0) -> dict[str, Any]:
    """(d): decisions per second with 1, 8 and 32 client processes, one key each."""
    from concurrent.futures import ProcessPoolExecutor

    out: dict[str, Any] = {}
    for clients in (1, 8, 32):
        with ProcessPoolExecutor(clients) as pool:
            list(pool.map(_hammer, [server.url] * clients, [0.2] * clients, ["w"] * clients))
            started = time.perf_counter()
            counts = list(
                pool.map(
                    _hammer,
                    [server.url] * clients,
                    [seconds] * clients,
                    [f"k{i}" for i in range(clients)],
                )
            )
            elapsed = time.perf_counter() - started
        out[f"{clients} clients"] = {"decisions_per_s": round(sum(counts) / elapsed)}
    return out


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else ROUNDS
    server = RedisServer()
    if argv[1:] in (["plain"], ["backlog"]):  # (b2) or (b3) alone
        try:
            if argv[1:] == ["plain"]:
                plain = plain_beside_bare(server, rounds, CALLS)
            else:
                plain = backlog(server, rounds, CALLS // 4)
        finally:
            server.close()
        for name, row in plain.items():
            print(f"    {name:28} {row['usec_per_call'] if isinstance(row, dict) else row:8}")
        return 0
    try:
        version = server.client().info("server")["redis_version"]
        results = {
            "redis_version": version,
            "python": platform.python_version(),
            "rounds": rounds,
            "calls_per_round": CALLS,
            "a_client_side": client_side(server, rounds, CALLS),
            "b_server_side": server_side(server, rounds, CALLS),
            "b2_plain_beside_bare": plain_beside_bare(server, rounds, CALLS),
            "b3_backlog": backlog(server, rounds, CALLS // 4),
            "c_memory": memory(server),
            "d_throughput": throughput(server),
        }
    finally:
        server.close()
    print(f"redis {results['redis_version']}, {rounds} interleaved rounds of {CALLS} calls")
    _table(
        "(a) client side           mean us   x PING   (target acquire <= 1.10)",
        results["a_client_side"],
        lambda name, row: f"{name:24} {row['mean_us']:8.2f} {row['x_ping']:8.3f}",
    )
    _table(
        "(b) server side           usec/call         (target <= 8, cost 1000 <= 1.2x)",
        results["b_server_side"],
        _per_call(24),
    )
    _table(
        "(b2) a plain decision beside the bare script of its commands   usec/call",
        results["b2_plain_beside_bare"],
        _per_call(28),
    )
    _table(
        "(b3) a reserving call behind a line of reservations   usec/call",
        results["b3_backlog"],
        _per_call(28),
    )
    _table(
        "(c) memory                bytes/entry  bytes  encoding   (target <= 60/entry)",
        results["c_memory"],
        lambda name, row: (
            f"{name:24} {row.get('bytes_per_entry', '')!s:>8} "
            f"{row.get('bytes', '')!s:>8} {row.get('encoding', '')}"
        ),
    )
    _table(
        "(d) throughput            decisions/s   (one redis-server, one key per client)",
        results["d_throughput"],
        lambda name, row: f"{name:24} {row['decisions_per_s']:8}",
    )
    print(f"\nwrote {save('limiter.json', results, indent=2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
