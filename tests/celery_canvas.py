"""Celery's own canvas integration suite, run with every task passing the limiter.

A rate limiter that wraps every task must not change Celery's semantics. This runs
``t/integration/test_canvas.py`` from the source distribution of the installed Celery
(downloaded once with ``pip download``, kept in ``--workdir``) against a private
``redis-server`` (broker and result backend), its worker started by the suite itself
(``celery_session_worker``). The plugin ``tests/celery_canvas_plugin.py`` applies
``app.conf.ratelimit_rules = {"t.integration.tasks.*": RATE}`` and ``install()`` to the
worker's app, at a rate where deferrals really happen, and counts them.

The verdict: every test that fails limited is run again plain (no limits, same server,
same machine); a failure that is not shared is run limited twice more, alone, and
fails the run if it fails again. So a test Celery's suite fails here anyway (its
environment, its flakiness at that moment) does not, and one the limiter breaks does;
one that failed once and passed both reruns is named in the report as flaky.

Usage (``nox -s canvas`` installs what the suite needs and passes its arguments)::

    python -m tests.celery_canvas                # the whole canvas suite, limited
    python -m tests.celery_canvas --subset       # the stamping and chord tests, 10/s (CI)
    python -m tests.celery_canvas --plain        # the whole suite without limits
    python -m tests.celery_canvas -- -k chain    # more pytest arguments after --

Needs, beside the package's ``[test]`` extra: pip, ``pydantic`` and
``pytest-rerunfailures`` (the suite's own imports and markers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import celery

from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SUITE = "t/integration/test_canvas.py"
#: The CI subset (a few minutes): the stamping class (its stamped ``self.retry()``
#: included) and the chord tests, less those that take many seconds each by the
#: suite's own waits (the chord-header errback flags, the large headers, the generator
#: and errback-per-shape variants); the whole suite runs them.
SUBSET = (
    "test_stamping_mechanism or (test_chord and not (allow_error_cb or large_header or "
    "generator or errback_called_by_chord or error_propagates_from_chord or "
    "nested_chord_header_link_error or redis_subscribed_channels_leak or "
    "different_body_types))"
)
#: A test that fails limited only is run limited this many times more, alone: failing
#: in none of them, it is reported as flaky (Celery's suite reruns its own flaky tests
#: five times) rather than failing the run.
RERUNS = 2
DEFAULT_RATE = "50/s"
#: The subset's tasks come a few at a time: a rate they exceed often enough to be deferred.
SUBSET_RATE = "10/s"


def suite(version: str, workdir: Path) -> Path:
    """The test tree (``t/`` and its pytest settings) of Celery ``version``'s source
    distribution, downloaded once. Celery's own package is left out: the suite runs
    against the installed one."""
    tree = workdir / f"celery-{version}-tests"
    if (tree / SUITE).exists():
        return tree
    workdir.mkdir(parents=True, exist_ok=True)
    archive = workdir / f"celery-{version}.tar.gz"
    if not archive.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"celery=={version}",
                "--dest",
                str(workdir),
            ],
            check=True,
        )
    top = f"celery-{version}/"
    with tarfile.open(archive) as tar:
        members = [
            member
            for member in tar.getmembers()
            if member.name.startswith(top + "t/") or member.name == top + "pyproject.toml"
        ]
        for member in members:
            member.name = member.name[len(top) :]
        tar.extractall(tree, members=members, filter="data")
    if not (tree / SUITE).exists():
        raise SystemExit(f"{archive} has no {SUITE}")
    return tree


def run(
    tree: Path, server: RedisServer, rate: str | None, args: list[str], scratch: Path
) -> dict[str, Any]:
    """Run the suite with ``args`` (limited at ``rate``, or plain): its outcome."""
    report = scratch / f"report-{time.monotonic_ns()}.json"
    deferrals = scratch / f"deferrals-{time.monotonic_ns()}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tree)]),
        "TEST_BROKER": server.url,
        "TEST_BACKEND": server.url,
        # the suite's own Redis client (t/integration/tasks.py): the private server
        "REDIS_HOST": "127.0.0.1",
        "REDIS_PORT": str(server.port),
        "CRL_CANVAS_REPORT": str(report),
        "CRL_CANVAS_DEFERRALS": str(deferrals),
    }
    env.pop("CRL_CANVAS_RATE", None)
    if rate:
        env["CRL_CANVAS_RATE"] = rate
    server.client().flushall()  # the private server: each run starts empty
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.celery_canvas_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        *args,
    ]
    print(f"\n== {'limited at ' + rate if rate else 'plain'}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    code = subprocess.run(command, cwd=tree, env=env).returncode
    if not report.exists():
        raise SystemExit(f"the suite ended without a report (pytest exit code {code})")
    outcome: dict[str, Any] = json.loads(report.read_text())
    outcome["code"] = code
    outcome["seconds"] = round(time.monotonic() - started, 1)
    outcome["deferrals"] = deferrals.stat().st_size if deferrals.exists() else 0
    return outcome


def line(name: str, outcome: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in outcome["outcome"].items() if n)
    return f"{name}: {counts} in {outcome['seconds']}s; {outcome['deferrals']} deferrals"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", action="store_true", help="run without limits")
    parser.add_argument("--subset", action="store_true", help="CI's part: -k SUBSET")
    parser.add_argument(
        "--rate", help=f"the rule's rate ({DEFAULT_RATE}; with --subset {SUBSET_RATE})"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "crl-celery-sdist",
        help="where the source distribution is kept (%(default)s)",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    options = parser.parse_args(argv)
    rate = options.rate or (SUBSET_RATE if options.subset else DEFAULT_RATE)
    tree = suite(celery.__version__, options.workdir)
    args = [SUITE, *(["-k", SUBSET] if options.subset else []), *options.pytest_args]
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="crl-canvas-") as scratch:
        if options.plain:
            plain = run(tree, server, None, args, Path(scratch))
            print(line(f"celery {celery.__version__} canvas suite, plain", plain))
            return int(plain["code"])
        limited = run(tree, server, rate, args, Path(scratch))
        if limited["code"] not in (0, 1) or not limited["outcome"]["passed"]:
            print(line("limited", limited))
            return int(limited["code"]) or 1
        shared: list[str] = []
        if limited["failed"]:
            # the same tests without limits: a failure they share is not the limiter's
            plain = run(tree, server, None, limited["failed"], Path(scratch))
            shared = [test for test in limited["failed"] if test in plain["failed"]]
        own = [test for test in limited["failed"] if test not in shared]
        flaky: list[str] = []
        if own:
            # a failure seen once: the same tests limited again, twice, alone
            again = [run(tree, server, rate, own, Path(scratch)) for _ in range(RERUNS)]
            flaky = [test for test in own if not any(test in one["failed"] for one in again)]
            own = [test for test in own if test not in flaky]
        print(line(f"\ncelery {celery.__version__} canvas suite, limited", limited))
        for test in shared:
            print(f"  fails plain too: {test}")
        for test in flaky:
            print(f"  failed once limited, passed {RERUNS} reruns limited and plain: {test}")
        for test in own:
            print(f"  FAILS ONLY LIMITED: {test}")
        if limited["deferrals"] == 0:
            print(f"  no task was deferred: {rate} never bit (give --rate a lower one)")
            return 1
        return 1 if own else 0


if __name__ == "__main__":
    sys.exit(main())
