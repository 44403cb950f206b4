"""End to end: three ``celery worker`` nodes (prefork, concurrency 2) sharing one limit.

``python -m benchmarks.bench_celery [--broker redis|rabbitmq]``. Every figure is a ratio
measured in this run:

5. exactness: most executions in any window / limit (grants and task starts); anchor:
   Celery's own ``rate_limit`` on the same nodes (one bucket per node), on a backlog
   of 6x the limit (its excess shows in the first windows; after them it slows to far
   below the rate, celery/celery#5927).
6. drain time of a backlog of 20x the limit / ideal drain time, reservations on vs off.
7. limiter calls and broker publishes per executed task, reservations on vs off.
8. overhead when the limit never binds: tasks per second with a limit far above the
   load / tasks per second of the same task without the library (interleaved rounds on
   a full queue, the rate between the 10th and 90th percentile of the starts);
   bounds: the same task with one more Redis round trip and no library, sent as ours
   is (on a held connection): a PING, an EVALSHA of a script that does nothing (what
   any limiter in a Lua script pays), and one of the floor script (the least an exact
   decision does: the clock, a read, the prune, a write, on a 1 s log). With psutil
   installed, also the CPU time per task of every process involved (the nodes' main
   processes, their pools, the limiter's Redis, the broker), steadier than the rate on
   a busy machine, where the CPU is what bounds the rate.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import time
import uuid
from typing import Any

import kombu.pools

from benchmarks.output import save
from celery_ratelimit._celery.park import park_calls
from celery_ratelimit._engine.rate import Rate
from celery_ratelimit._tools.embedded import RedisServer, WorkerNodes
from tests.measure import max_in_window

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
#: Interleaved rounds of the overhead scenario (8), each of ``overhead_tasks`` per task.
OVERHEAD_ROUNDS = 7


def rabbitmq_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1.0):
            return True
    except OSError:
        return False


def steady_rate(starts_us: list[int]) -> float:
    """Tasks per second between the 10th and the 90th percentile of the starts: the
    first and last tenth measure the nodes waking up and the one node left with the
    last prefetched messages, which vary from round to round more than the task does."""
    starts = sorted(starts_us)
    lo, hi = len(starts) // 10, len(starts) - 1 - len(starts) // 10
    span = (starts[hi] - starts[lo]) / 1e6 if hi > lo else 0.0
    return (hi - lo) / span if span > 0 else 0.0


class Bench:
    def __init__(
        self,
        broker: str,
        rate: Rate,
        backlog: int,
        overhead_tasks: int,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        park_after: str = "auto",
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.rate = rate
        self.backlog = backlog
        self.overhead_tasks = overhead_tasks
        self.limiter_redis = RedisServer()
        self.broker_redis: RedisServer | None = None
        if broker == "redis":
            self.broker_redis = RedisServer()
            self.broker_url = self.broker_redis.url
        else:
            self.broker_url = RABBITMQ_URL
        self.queue = f"bench-{uuid.uuid4().hex[:8]}"
        from benchmarks import bench_app

        self.tasks = bench_app
        bench_app.app.conf.broker_url = self.broker_url
        bench_app.app.conf.task_default_queue = self.queue
        self.client = self.limiter_redis.client(decode_responses=True)
        self.nodes = WorkerNodes(
            "benchmarks.bench_app",
            3,
            {
                "CRL_BENCH_BROKER": self.broker_url,
                "CRL_BENCH_REDIS": self.limiter_redis.url,
                "CRL_BENCH_RATE": str(rate),
                "CRL_BENCH_PARK_AFTER": park_after,
                "CRL_BENCH_SETTINGS": json.dumps(settings or {}),
            },
            pool=pool,
            concurrency=concurrency,
            loglevel="WARNING",
            extra_args=("-Q", self.queue),
        )

    def close(self) -> None:
        self.nodes.stop()
        if self.broker_url == RABBITMQ_URL:
            with self.tasks.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(self.queue)
        for server in (self.limiter_redis, self.broker_redis):
            if server is not None:
                server.close()
        # the next run may use another broker: drop this one's pooled connections
        app = self.tasks.app
        if app._pool is not None:
            app._pool.force_close_all()
        app._pool = None
        app.amqp._producer_pool = None
        # kombu keeps pools per connection URL: a later server on a port this one had
        # would get this closed pool back
        kombu.pools.reset()

    def _processes(self) -> dict[str, list[Any]]:
        """The processes whose CPU a task costs, by role (psutil), or {} without psutil."""
        try:
            import psutil
        except ImportError:
            return {}
        groups: dict[str, list[Any]] = {"node main": [], "pool": []}
        for proc in self.nodes.procs:
            main = psutil.Process(proc.pid)
            groups["node main"].append(main)
            groups["pool"].extend(main.children(recursive=True))
        for role, server in (("limiter redis", self.limiter_redis), ("broker", self.broker_redis)):
            if server is not None and server.proc is not None:
                groups[role] = [psutil.Process(server.proc.pid)]
        if self.broker_redis is None:  # RabbitMQ, if it runs on this machine
            # the server's VM only: rabbitmqctl and other tools run a beam.smp for moments
            groups["broker"] = [
                p
                for p in psutil.process_iter(["name", "cmdline"])
                if p.info["name"] == "beam.smp" and _is_rabbitmq_server(p.info["cmdline"] or [])
            ]
        return groups

    @staticmethod
    def _cpu_seconds(groups: dict[str, list[Any]]) -> dict[str, float]:
        return {role: sum(sum(p.cpu_times()[:2]) for p in procs) for role, procs in groups.items()}

    def _calls(self, client: Any, command: str) -> int:
        stats = client.info("commandstats").get(f"cmdstat_{command}", {})
        return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))

    def drain(
        self, name: str, count: int, timeout: float, *, queued_first: bool = False
    ) -> dict[str, Any]:
        """Send ``count`` tasks of ``name`` at once and wait until all have run.

        ``queued_first``: the nodes stop consuming while the tasks are sent, so that
        they drain a full queue (the producer shares the CPUs and is slower than they
        are: timed while it publishes, the nodes would measure its rate).
        """
        begun = time.monotonic()
        task = getattr(self.tasks, name)
        runs_key = f"bench:runs:{name}"
        self.client.delete(runs_key)
        broker = self.broker_redis.client() if self.broker_redis else None
        self.client.config_resetstat()
        park_before = park_calls(self.client, "bench")
        if broker is not None:
            broker.config_resetstat()
        groups = self._processes() if queued_first else {}
        cpu_before = self._cpu_seconds(groups)
        if queued_first:
            self._consume(False)
        for _ in range(count):
            task.delay()
        if queued_first:
            self._consume(True)
        deadline = time.monotonic() + timeout
        while self.client.llen(runs_key) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        cpu_after = self._cpu_seconds(groups)
        time.sleep(0.2)  # let a duplicate, if any, show up
        rows = [tuple(int(x) for x in raw.split()) for raw in self.client.lrange(runs_key, 0, -1)]
        park_ops = park_calls(self.client, "bench") - park_before
        starts = [r[0] for r in rows]
        grants = [r[1] for r in rows]
        result: dict[str, Any] = {
            "task": name,
            "sent": count,
            "executed": len(rows),
            "drain_s": (max(starts) - min(starts)) / 1e6 if rows else None,
            "max_grants_per_window": max_in_window(grants, self.rate.window_us),
            "max_starts_per_window": max_in_window(starts, self.rate.window_us),
            # decisions: the calls of the park's script are counted apart
            "limiter_calls": self._calls(self.client, "evalsha") - park_ops,
            "park_calls": park_ops,
            # the limiter's Redis time per script call, here under the nodes' load
            "limiter_usec_per_call": float(
                self.client.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call", 0)
            ),
            "deferrals": sum(r[2] for r in rows),
            "publishes_from_records": count + sum(r[2] for r in rows),
            "wall_s": round(time.monotonic() - begun, 2),
            # CPU microseconds per task, by role (publishing the tasks included)
            "cpu_us_per_task": {
                role: round((cpu_after[role] - cpu_before[role]) / count * 1e6, 1)
                for role in cpu_before
            },
            "starts_us": starts,
            "grants_us": grants,
        }
        if broker is not None:
            result["broker_lpush"] = self._calls(broker, "lpush")
            broker.close()
        return result

    def _consume(self, on: bool) -> None:
        """Every node starts (or stops) consuming the benchmark's queue."""
        control = self.tasks.app.control
        command = control.add_consumer if on else control.cancel_consumer
        nodes = len(self.nodes.procs)
        replies = command(self.queue, reply=True, timeout=5, limit=nodes)
        if len(replies or ()) != nodes:
            raise RuntimeError(f"not every node answered the remote control: {replies}")

    def run(self, scenarios: bool = True) -> dict[str, Any]:
        begun = time.monotonic()
        self.nodes.start(self.tasks.app)
        limit, window = self.rate.limit, self.rate.window
        ideal = (math.ceil(self.backlog / limit) - 1) * window
        out: dict[str, Any] = {"rate": str(self.rate), "backlog": self.backlog, "ideal_s": ideal}
        for name in ("reserved", "unreserved") if scenarios else ():
            r = self.drain(name, self.backlog, ideal * 4 + 30)
            r["drain_over_ideal"] = r["drain_s"] / ideal if r["drain_s"] else None
            r["calls_per_task"] = r["limiter_calls"] / max(r["executed"], 1)
            r["publishes_per_task"] = (r.get("broker_lpush") or r["publishes_from_records"]) / max(
                r["executed"], 1
            )
            r["grants_over_limit"] = r["max_grants_per_window"] / limit
            r["starts_over_limit"] = r["max_starts_per_window"] / limit
            out[name] = r
        # Celery's own limit is over once each node has run a window at its own rate;
        # after a burst it falls far below the rate (one task a second per node here,
        # celery/celery#5927), so a whole backlog would take a minute to drain
        if scenarios:
            anchor = self.drain("celery_rate_limit", min(self.backlog, 6 * limit), 60)
            anchor["starts_over_limit"] = anchor["max_starts_per_window"] / limit
            out["celery_rate_limit"] = anchor
        scenarios_done = time.monotonic()
        names = ("unlimited", "loose", "one_round_trip", "one_script_call", "one_floor_call")
        throughput: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        usec: dict[str, list[float]] = {name: [] for name in names}
        for name in throughput:  # warm up: each pool process imports and connects once
            self.drain(name, self.overhead_tasks // 4, 120)
        for round_ in range(OVERHEAD_ROUNDS):
            turn = round_ % len(names)
            for name in names[turn:] + names[:turn]:  # no fixed order
                r = self.drain(name, self.overhead_tasks, 120, queued_first=True)
                throughput[name].append(steady_rate(r["starts_us"]))
                cpu[name].append(r["cpu_us_per_task"])
                if r["limiter_usec_per_call"]:
                    usec[name].append(r["limiter_usec_per_call"])
        medians = {name: statistics.median(v) for name, v in throughput.items()}
        # each round's ratio to the plain task of the same round, then their median:
        # rounds drift together on a shared machine, a round's ratio much less
        ratios = {
            name: statistics.median(
                x / plain
                for x, plain in zip(throughput[name], throughput["unlimited"], strict=True)
            )
            for name in names
        }
        out["overhead"] = {
            "tasks_per_s": medians,
            "rounds": throughput,
            "ratio": ratios["loose"],
            "one_round_trip_ratio": ratios["one_round_trip"],
            "one_script_call_ratio": ratios["one_script_call"],
            "one_floor_call_ratio": ratios["one_floor_call"],
            # ours against the least an exact limiter does, round by round: how far
            # ours is from that bound, whatever the plain task did in the round
            "loose_over_floor": statistics.median(
                x / floor
                for x, floor in zip(throughput["loose"], throughput["one_floor_call"], strict=True)
            ),
        }
        out["overhead"]["limiter_usec_per_call"] = {
            name: statistics.median(usec[name]) for name in names if usec[name]
        }
        if cpu["unlimited"] and cpu["unlimited"][0]:
            # median CPU per task of each role, and the plain task's total over each
            # variant's: the rate ratio that the CPU alone allows
            per_role = {
                name: {role: statistics.median(r[role] for r in rounds) for role in rounds[0]}
                for name, rounds in cpu.items()
            }
            totals = {name: sum(roles.values()) for name, roles in per_role.items()}
            out["overhead"]["cpu_us_per_task"] = per_role
            out["overhead"]["cpu_ratio"] = {
                name: round(totals["unlimited"] / totals[name], 3) for name in names
            }
        out["seconds"] = {
            "nodes and scenarios 5-7": round(scenarios_done - begun, 1),
            "overhead (8)": round(time.monotonic() - scenarios_done, 1),
        }
        return out


def run(
    broker: str = "redis",
    rate: str = "20/s",
    backlog: int = 400,
    overhead: int = 2000,
    scenarios: bool = True,
) -> Any:
    bench = Bench(broker, Rate.parse(rate), backlog, overhead)
    try:
        return bench.run(scenarios)
    finally:
        bench.close()


def _is_rabbitmq_server(cmdline: list[str]) -> bool:
    """Is this Erlang VM's command line the RabbitMQ server's (``-s rabbit boot``)?"""
    return any(cmdline[i : i + 3] == ["-s", "rabbit", "boot"] for i in range(len(cmdline)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    parser.add_argument("--rate", default="20/s")
    parser.add_argument("--backlog", type=int, default=400)
    parser.add_argument("--overhead-tasks", type=int, default=2000)
    parser.add_argument(
        "--overhead-only", action="store_true", help="row 8 alone (no scenarios 5-7)"
    )
    args = parser.parse_args()
    if args.broker == "rabbitmq" and not rabbitmq_reachable():
        raise SystemExit("no RabbitMQ on 127.0.0.1:5672")
    result = run(args.broker, args.rate, args.backlog, args.overhead_tasks, not args.overhead_only)
    suffix = "_overhead" if args.overhead_only else ""
    save(f"celery_{args.broker}{suffix}.json", result, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
