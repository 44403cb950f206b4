"""A soak under random faults (issue 48): worker nodes on mixed pools drain a mixed,
rate-limited workload while a seeded schedule of faults hits the nodes and the servers.

    python -m benchmarks.soak --minutes M --seed S [--broker redis|rabbitmq] [--own-redis]

Three ``celery worker`` nodes (prefork, threads, gevent) run ``benchmarks.soak_app``:
stacked limits, weighted costs, a ``Concurrency``, fair keys across tenants, a fake
upstream that answers 429 (``UpstreamRateLimited``), every task ``acks_late`` with
``task_reject_on_worker_lost``, the policy fail-closed (``defer``). A steady producer
sends every task at twice its limit for the first ``SEND_SHARE`` of the run; faults go
on for all of it (``soak_faults``: kill -9 and SIGTERM of a node, restarted as a
supervisor would; SIGSTOP of Redis for 1-10 s; a Redis restart with ``appendonly
yes``; ``SCRIPT FLUSH``; ``CLIENT KILL`` of the workers' connections; a restart of the
soak's private RabbitMQ node). Then the soak waits for the drain, checks the record
(``soak_check``) and what Redis still holds, and prints as its last line

    soak: tasks=N ran=N lost=L dup=D over_limit=W held_after=H faults=F

exiting 0 only when ``lost=0 over_limit=0 held_after=0``. The Redis servers are the
soak's own; with ``--broker rabbitmq`` the broker is a RabbitMQ node of its own too.
By default the limiter is on the broker's Redis (the park on); ``--own-redis`` gives it
a Redis of its own (the park off, deferred copies go to the broker with their ETA).

Before it, ``supervisor: probe_restarts=K exit_restarts=E term_kills=T``: the nodes'
supervisor (``soak_nodes``) also starts again a node that exits on its own (E), probes
every node with a ping, killing -9 and starting again one that stops answering (K), and
kills -9 a node that ignores SIGTERM for 60 s after Celery's unrecoverable error (T).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery

from benchmarks.soak_app import LEASE
from benchmarks.soak_check import Record, broker_leftovers, by_class, held, judge, queued_ids
from benchmarks.soak_faults import NODE_FAULTS, Fault, PrivateRabbit, RedisBox, schedule
from benchmarks.soak_nodes import APP, NODES, Supervisor, say
from tests.upstream import Upstream

#: task -> calls a second the producer sends: twice each task's limit (``weighted``
#: costs 2 units on average under 4 units a second; ``stacked`` is held to 2 a second
#: by its 10/5s)
MIX = {"stacked": 4.0, "weighted": 4.0, "slotted": 4.0, "fair": 6.0, "upstream": 4.0}
#: share of the run the producer sends for: the backlog then drains, faults going on
SEND_SHARE = 0.35
TENANTS = {"a": 7, "b": 2, "c": 1}
#: the fake upstream allows this many calls in any second (as the limit does)
UPSTREAM_LIMIT = 2
#: the drain ends when what it waits for has not changed for this long (seconds): more
#: than the visibility timeout and a deferral's longest hop
STALL = 90.0


def plan(rng: random.Random, seconds: float) -> list[tuple[float, str, list[Any], str]]:
    """The producer's sends: (when, task, args, task id), each task evenly spaced."""
    sends = []
    for task, rate in MIX.items():
        for k in range(int(seconds * rate)):
            if task == "weighted":
                args: list[Any] = [rng.randint(1, 3), k]
            elif task == "fair":
                args = [rng.choices(list(TENANTS), list(TENANTS.values()))[0], k]
            else:
                args = [k]
            sends.append((k / rate, task, args, str(uuid.UUID(int=rng.getrandbits(128)))))
    return sorted(sends, key=lambda s: s[0])


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.seconds = args.minutes * 60
        self.t0 = time.monotonic()
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="crl-soak-"))
        self.keep = args.workdir is not None  # the servers' AOFs are copied there at the end
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.record = Record(self.workdir / "runs.jsonl")
        self.sent: dict[str, float] = {}  # task id -> when it was sent (epoch seconds)
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.parked_for = 0.0  # seconds until the last parked copy is due (idle())
        self.happened: list[tuple[float, Fault]] = []  # (epoch seconds, the fault) once done
        self.prefix = f"soak{args.seed}"
        self.boxes: dict[str, RedisBox] = {}
        self.rabbit: PrivateRabbit | None = None

    def servers(self) -> tuple[str, str]:
        """Start the soak's own servers; the broker's and the limiter's URLs."""
        if self.args.broker == "rabbitmq":
            self.rabbit = PrivateRabbit()
            self.boxes["limiter"] = RedisBox("limiter")
            return self.rabbit.url, self.boxes["limiter"].url
        self.boxes["broker"] = RedisBox("broker")
        if self.args.own_redis:
            self.boxes["limiter"] = RedisBox("limiter")
            return self.boxes["broker"].url, self.boxes["limiter"].url
        return self.boxes["broker"].url, ""  # the limiter on the broker's Redis

    def fault(self, fault: Fault, supervisor: Supervisor) -> None:
        time.sleep(max(0.0, self.t0 + fault.at - time.monotonic()))
        began = time.time()
        try:
            if fault.kind in NODE_FAULTS:
                outcome = supervisor.run(fault)
            elif fault.target == "rabbitmq":
                assert self.rabbit is not None
                with supervisor.outage():
                    self.rabbit.run(fault.kind, fault.hold)
                outcome = "done"
            else:
                # the broker stopped, down or its connections cut: the probe waits
                broker = fault.target == "broker" and fault.kind != "script_flush"
                with supervisor.outage() if broker else contextlib.nullcontext():
                    self.boxes[fault.target].run(fault.kind, fault.hold)
                outcome = "done"
        except Exception as exc:  # reported, and counted against the soak
            outcome = f"error: {exc!r}"[:200]
        self.outcomes[fault.kind, outcome.split(" ")[0]] += 1
        if outcome == "done":
            self.happened.append((began, fault))
        say(self.t0, f"{fault}: {outcome}")

    def produce(self, app: Celery, sends: list[tuple[float, str, list[Any], str]]) -> None:
        for at, task, args, task_id in sends:
            time.sleep(max(0.0, self.t0 + at - time.monotonic()))
            while True:
                try:  # the same id again after a failure: a duplicate at worst
                    app.send_task(f"{APP}.{task}", args=args, task_id=task_id)
                    break
                except Exception as exc:
                    say(self.t0, f"producer: {exc!r}; sending again")
                    time.sleep(0.5)
            self.sent[task_id] = time.time()

    def idle(self) -> list[str]:
        """What keeps the soak from being idle: tasks not run, messages in the broker,
        copies in the park."""
        self.record.read()
        waiting = [f"{len(set(self.sent) - set(self.record.done))} tasks not run yet"]
        if self.rabbit is not None:
            waiting.append(f"{self.rabbit.messages()} messages in RabbitMQ")
        else:
            with self.boxes["broker"].client() as client:
                waiting += broker_leftovers(client)
                dues = list(client.scan_iter(match="*{park:*}:due"))
                waiting.append(f"{sum(client.zcard(k) for k in dues)} parked")
                # seconds until the last parked copy is due (the park's scores: Redis µs)
                tops = [client.zrange(k, -1, -1, withscores=True) for k in dues]
                last = max((float(top[0][1]) for top in tops if top), default=0.0)
                seconds, micros = client.time()
                self.parked_for = last / 1e6 - seconds - micros / 1e6 if last else 0.0
        return [w for w in waiting if not w.startswith("0 ")]

    def run(self) -> int:
        args = self.args
        broker, limiter = self.servers()
        faults = schedule(
            self.rng, self.seconds, [n for n, _, _ in NODES], sorted(self.boxes), bool(self.rabbit)
        )
        sends = plan(self.rng, self.seconds * SEND_SHARE)
        print(f"soak: seed {args.seed}, {args.minutes} min, broker {args.broker} ({broker}), "
              f"limiter {'its own Redis ' + limiter if limiter else 'on the broker Redis'}, "
              f"{len(sends)} tasks, {len(faults)} faults, logs in {self.workdir}")  # fmt: skip
        print("schedule:")
        for fault in faults:
            print(f"  {fault}")
        with Upstream(UPSTREAM_LIMIT, 1.0) as upstream:
            env = {
                "SOAK_BROKER": broker,
                "SOAK_REDIS": limiter,
                "SOAK_PREFIX": self.prefix,
                "SOAK_RECORD": str(self.record.path),
                "SOAK_UPSTREAM": upstream.url("none"),
            }
            supervisor = Supervisor(self.workdir, env, self.t0)
            producer = Celery("soak-producer", broker=broker)
            queued: frozenset[str] = frozenset()  # what the broker holds at the end
            producer.conf.broker_connection_retry_on_startup = True
            if broker.startswith("amqp"):
                # publisher confirms, as the nodes (soak_app): a send RabbitMQ does not
                # confirm raises, and is sent again
                producer.conf.broker_transport_options = {"confirm_publish": True}
            try:
                supervisor.start()
                self.t0 = supervisor.t0 = time.monotonic()
                supervisor.watch()
                say(self.t0, "nodes ready: producing, faults start")
                threads = [
                    threading.Thread(target=self.fault, args=(f, supervisor), daemon=True)
                    for f in faults
                ] + [threading.Thread(target=self.produce, args=(producer, sends), daemon=True)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                time.sleep(max(0.0, self.t0 + self.seconds - time.monotonic()))
                say(self.t0, "faults over: draining")
                self.drain()
                time.sleep(LEASE + 7)  # past every window, lease and reservation
                client = (self.boxes.get("limiter") or self.boxes["broker"]).client()
                left = held(client, self.prefix)
                if self.rabbit is None:
                    with self.boxes["broker"].client() as broker_client:
                        queued = queued_ids(broker_client)
                supervisor.stop(producer)
            finally:
                supervisor.quiet()
                for node in supervisor.nodes.values():
                    node.stop()
                producer.close()
                for name, box in self.boxes.items():
                    # the broker's AOF is read by the verdict (soak_check.popped_unseen)
                    box.close(keep=self.workdir if self.keep or name == "broker" else None)
                if self.rabbit is not None:
                    self.rabbit.close()
        self.record.read()
        kills = supervisor.kills if supervisor.gap else []
        aof = self.workdir / "redis-broker" if self.rabbit is None else None
        verdict = judge(self.sent, self.record, kills, self.workdir, supervisor.gap, aof, queued)
        if aof is not None and not self.keep:
            shutil.rmtree(aof, ignore_errors=True)
        for line in verdict.details:
            print(f"  {line}")
        for line in left:
            print(f"  held after the drain: {line}")
        for line in supervisor.hung:
            print(f"  hung: {line}")
        if verdict.gap:
            print(f"  not counted as lost: {verdict.gap} in kombu's BRPOP gap")
        print("faults by class:")
        for kind in sorted({k for k, _ in self.outcomes}):
            outcomes = {o: n for (k, o), n in self.outcomes.items() if k == kind}
            print(f"  {kind:<14} {outcomes}")
        print("what each fault class did:")
        for line in by_class(self.happened, self.record, verdict.gap_at, self.workdir):
            print(f"  {line}")
        done = sum(n for (_, o), n in self.outcomes.items() if o == "done")
        held_after = len(left) + len(supervisor.hung)
        errors = sum(n for (_, o), n in self.outcomes.items() if o.startswith("error"))
        print(
            f"supervisor: probe_restarts={supervisor.probe_restarts} "
            f"exit_restarts={supervisor.exit_restarts} term_kills={supervisor.term_kills}"
        )
        print(
            f"soak: tasks={verdict.tasks} ran={verdict.ran} lost={verdict.lost} dup={verdict.dup} "
            f"over_limit={verdict.over_limit} held_after={held_after} faults={done}",
            flush=True,
        )
        ok = verdict.lost == 0 and verdict.over_limit == 0 and held_after == 0 and not errors
        return 0 if ok else 1

    def drain(self) -> None:
        """Wait until idle, nothing changed for :data:`STALL` s (with no parked copy due
        later), or ``--drain`` seconds have passed (by default 600, or one and a half
        times the run when that is longer: the backlog left when the faults end grows
        with the run, and drains below the limits' rate on a busy machine)."""
        longest = self.args.drain
        if longest is None:
            longest = max(600.0, 1.5 * 60 * self.args.minutes)
        deadline = time.monotonic() + longest
        last = 0.0
        same, since = [""], time.monotonic()
        while (waiting := self.idle()) and time.monotonic() < deadline:
            if waiting != same:
                same, since = waiting, time.monotonic()
            elif time.monotonic() - since > STALL and self.parked_for <= 0:
                # (a parked copy due later is no stall: with the park on, a deferral
                # waits up to the horizon, 600 s)
                say(self.t0, f"no change for {STALL:.0f}s: the drain is over")
                break
            if time.monotonic() - last > 15:
                last = time.monotonic()
                say(self.t0, f"draining: {', '.join(waiting)}")
            time.sleep(1.0)
        say(self.t0, f"drained: {', '.join(waiting) or 'idle'}")


def _exit(signum: int, _: Any) -> None:
    raise SystemExit(128 + signum)  # the servers and nodes are stopped on the way out


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument("--own-redis", action="store_true", help="a Redis for the limiter")
    parser.add_argument(
        "--drain", type=float, help="seconds to wait at most (default: 600, or 1.5x the run)"
    )
    parser.add_argument(
        "--workdir", help="where the record, the nodes' logs and (then) each Redis's AOF go"
    )
    return Soak(parser.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
