"""Command line: ``celery-ratelimit demo|status|reset|set|unset|pause|resume|explain|web``.

Also ``python -m celery_ratelimit ...``, and as a Celery subcommand
(``celery -A proj ratelimit status``, see ``celery_command.py``). ``status``,
``reset``, ``set``, ``unset``, ``pause``, ``resume`` and ``web`` take the app (``-A proj``,
for its Redis URL, key prefix and declared limits) or ``--url``/``--prefix``; ``explain``
needs the app (its tasks' limits) and takes ``--url``/``--prefix`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from .._engine.base import DEFAULT_PREFIX
from .._engine.exceptions import (
    InvalidLimit,
    LimiterMisconfigured,
    LimiterUnavailable,
    RateLimitError,
)
from .._engine.keys import escape_key
from .._engine.limiter import REDIS_ERRORS, Limiter
from .._engine.rate import Rate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="celery-ratelimit",
        description="One rate limit shared by every Celery worker node, kept in Redis.",
    )
    # -A, --url and --prefix go before the command (as `celery -A proj worker`) or after
    # it: the command's own copies default to nothing, so they keep what came before
    parser.add_argument("-A", "--app", help="the Celery app, module or module:attribute")
    parser.add_argument("--url", help="Redis URL (default: the app's ratelimit_redis_url)")
    parser.add_argument("--prefix", help=f"key prefix (default: the app's, else {DEFAULT_PREFIX})")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run worker nodes on a private Redis and show one shared limit holding",
    )
    demo.add_argument("--nodes", type=int, default=3, help="worker nodes (default 3)")
    demo.add_argument("--tasks", type=int, default=60, help="backlog size (default 60)")
    demo.add_argument("--rate", default="10/s", help="the shared limit (default 10/s)")
    demo.add_argument(
        "--no-reserve", action="store_true", help="plain retry-after deferral, no reserved slots"
    )
    demo.add_argument(
        "--burst",
        type=int,
        help="pace the limit: at most N at once, then one per W/L (default: not paced)",
    )
    demo.add_argument(
        "--plot", metavar="PNG", help="draw executions per window and starts over time to this file"
    )

    def where(
        sub: argparse.ArgumentParser, app: str = "the Celery app, module or module:attribute"
    ) -> None:
        kept = argparse.SUPPRESS
        sub.add_argument("-A", "--app", default=kept, help=app)
        sub.add_argument(
            "--url", default=kept, help="Redis URL (default: the app's ratelimit_redis_url)"
        )
        sub.add_argument(
            "--prefix", default=kept, help=f"key prefix (default: the app's, else {DEFAULT_PREFIX})"
        )

    status = commands.add_parser(
        "status", help="each active key: used/limit, remaining, next free slot, reservations"
    )
    where(status)
    status.add_argument("--match", metavar="GLOB", help="only keys matching GLOB ('yt:*')")
    status.add_argument(
        "--sort",
        choices=("key", "backlog", "used"),
        default="key",
        help="order: by key (default), by the backlog's drain time, by the share used",
    )
    status.add_argument("--limit", type=int, metavar="N", help="only the first N keys")
    status.add_argument(
        "--json", action="store_true", help="one JSON document: the keys and their settings"
    )
    reset = commands.add_parser("reset", help="forget everything counted for a key")
    where(reset)
    reset.add_argument("key", help="the key as given to Limit(key=...), e.g. yt:quota:key1")
    set_ = commands.add_parser(
        "set", help="use RATE for KEY on every worker from now on (a runtime override)"
    )
    where(set_)
    set_.add_argument("key", help="the key as given to Limit(key=...), e.g. yt:quota:key1")
    set_.add_argument("rate", help="the rate to use, e.g. 50/s")
    set_.add_argument("--ttl", type=float, metavar="SECONDS", help="the override lapses then")
    unset = commands.add_parser("unset", help="remove KEY's runtime override")
    where(unset)
    unset.add_argument("key", help="the key given to set")
    pause = commands.add_parser("pause", help="grant nothing on KEY for SECONDS, on every worker")
    where(pause)
    pause.add_argument("key", help="the key as given to Limit(key=...), e.g. api:t1")
    pause.add_argument("seconds", help="how long: seconds, or a Retry-After HTTP-date")
    resume = commands.add_parser("resume", help="end KEY's pause now")
    where(resume)
    resume.add_argument("key", help="the key paused")
    web = commands.add_parser("web", help="serve the operator's live page of every key")
    where(web)
    web_options(web.add_argument)
    explain = commands.add_parser(
        "explain", help="which limits apply to a call, their Redis keys, a decision (peek)"
    )
    where(explain, "the Celery app (its tasks' limits), required")
    explain.add_argument("task", help="task name")
    explain.add_argument("args", nargs="*", help="positional arguments (JSON, else text)")
    explain.add_argument("--kwargs", default="{}", help="keyword arguments as a JSON object")
    return parser


def web_options(option: Any) -> None:
    """The ``web`` command's own options (``option``: argparse's ``add_argument``)."""
    option("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    option("--port", type=int, default=8808, help="port (default 8808)")
    option(
        "--actions",
        action="store_true",
        help="allow pause, resume, set, unset and reset from the page (behind a token)",
    )
    option(
        "--token",
        help="the token the page's API asks for (default: $CELERY_RATELIMIT_WEB_TOKEN; "
        "with --actions and neither, one is made and printed)",
    )


def load_app(spec: str) -> Any:
    """The Celery app named by ``module`` or ``module:attribute`` (as ``celery -A``).

    Raises:
        SystemExit: the app cannot be loaded, with the reason.
    """
    import os

    from celery.app.utils import find_app

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `celery -A` does
    try:
        return find_app(spec)
    except Exception as exc:
        raise SystemExit(
            f"error: cannot load the Celery app {spec!r}: {type(exc).__name__}: {exc}"
        ) from None


def limiter_from(app: Any, url: str | None, prefix: str | None) -> Limiter:
    """A limiter for the app's Redis and prefix, overridden by ``url`` / ``prefix``.

    Raises:
        InvalidRedisURL: not a Redis URL, naming the option it came from.
    """
    from .._celery.settings import redis_url, setting

    if app is None and url is None:
        raise SystemExit("give the app (-A proj) or the Redis URL (--url redis://...)")
    try:
        return Limiter.from_url(
            url or redis_url(app),
            prefix=prefix or (setting("ratelimit_key_prefix", app) if app else DEFAULT_PREFIX),
        )
    except (InvalidLimit, LimiterMisconfigured) as exc:  # InvalidRedisURL is the latter
        raise _named(exc, app, url) from exc


@contextlib.contextmanager
def url_named(app: Any, url: str | None) -> Iterator[None]:
    """A failure of the limiter's Redis names the option its URL came from."""
    try:
        yield
    except (LimiterUnavailable, LimiterMisconfigured) as exc:
        raise _named(exc, app, url) from exc


@contextlib.contextmanager
def opened(app: Any, url: str | None, prefix: str | None) -> Iterator[Limiter]:
    """A command's limiter (:func:`limiter_from`), closed after; a Redis failure names
    where its URL came from."""
    limiter = limiter_from(app, url, prefix)
    try:
        with url_named(app, url):
            yield limiter
    finally:
        limiter.client.close()


def _named(exc: RateLimitError, app: Any, url: str | None) -> RateLimitError:
    """``exc`` naming where the Redis URL came from: ``--url`` when given (the
    library's messages name ``ratelimit_redis_url``, the app's setting, not used then)."""
    from .._celery.settings import redis_url_source

    if url:
        text = str(exc).replace("ratelimit_redis_url", "--url")
        source = "from --url"
    else:
        text, source = str(exc), redis_url_source(app)
    if "--url" not in text and "ratelimit_redis_url" not in text:
        text = f"{text} (the Redis URL {source})"
    return type(exc)(text)


def run_status(
    app: Any,
    url: str | None,
    prefix: str | None,
    match: str | None,
    *,
    sort: str = "key",
    limit: int | None = None,
    as_json: bool = False,
) -> list[str]:
    """What ``status`` prints: the table and the settings lines, or (``as_json``) one
    JSON document ``{"prefix", "url", "keys": [...], "settings": [...]}``; the keys in
    the order ``sort`` names (``ops.SORTS``), the first ``limit`` of them."""
    from . import ops, report

    if limit is not None and limit < 1:
        raise SystemExit(f"--limit must be at least 1, got {limit}")
    limiter = limiter_from(app, url, prefix)
    try:
        with url_named(app, url):
            known = ops.known_limits(app) if app is not None else []
            guard = ops.guard_for_app(app) if app is not None else 0.0
            rows = ops.sort_rows(ops.status(limiter, known, guard=guard, match=match), sort)
            settings = ops.key_settings(limiter, match)
        rows = rows[:limit] if limit is not None else rows
        if as_json:
            import json

            document = {
                "prefix": limiter.prefix,
                "url": safe_url(limiter),
                "keys": [row.as_json() for row in rows],
                "settings": [row.as_json() for row in settings],
            }
            return [json.dumps(document, indent=1)]
        lines = report.format_status(rows, limiter.prefix, safe_url(limiter), app=app is not None)
        return lines + report.format_settings(settings)
    finally:
        limiter.client.close()


def run_reset(app: Any, url: str | None, prefix: str | None, key: str) -> list[str]:
    with opened(app, url, prefix) as limiter:
        deleted = limiter.reset(key)
    if not deleted:
        return [f"nothing to reset: no key {key!r} under prefix {limiter.prefix!r}"]
    return [f"deleted {name}" for name in deleted]


def run_set(
    app: Any, url: str | None, prefix: str | None, key: str, rate: str | None, ttl: float | None
) -> list[str]:
    """``set KEY RATE [--ttl]`` (``rate`` None: ``unset KEY``)."""
    with opened(app, url, prefix) as limiter:
        escaped = [escape_key(key)]
        # read just before it goes, to say whether there was one
        before = override_of(limiter, escaped) if rate is None else None
        limiter.override_keys(escaped, rate, ttl=ttl)
    if rate is None and before is None:
        return [f"{key}: there was no override to remove; its calls' own rates apply"]
    if rate is None:
        return [f"{key}: override {before} removed; its calls' own rates apply again"]
    lasts = "until unset" if ttl is None else f"for {ttl:g}s"
    return [f"{key}: {Rate.parse(rate)} on every worker from its next decision, {lasts}"]


def run_pause(app: Any, url: str | None, prefix: str | None, key: str, seconds: str) -> list[str]:
    """``pause KEY SECONDS``: seconds (``"30"``, ``"1.5"``) or a ``Retry-After`` value.

    Raises:
        InvalidLimit: a bad key, or no time to pause for.
    """
    from .._engine.exceptions import InvalidLimit

    try:
        value: float | str = float(seconds)
    except ValueError:
        value = seconds  # an HTTP-date, else the limiter names it
    with opened(app, url, prefix) as limiter:
        left = limiter.pause(key, value)
    if not left:
        raise InvalidLimit(f"no time to pause {key!r} for: {seconds!r}")
    return [f"{key}: paused on every worker, nothing is granted on it for {left:.1f}s"]


def run_resume(app: Any, url: str | None, prefix: str | None, key: str) -> list[str]:
    """``resume KEY``: end its pause now."""
    with opened(app, url, prefix) as limiter:
        left = limiter.resume(key)
    if not left:
        return [f"{key}: was not paused"]
    return [f"{key}: resumed ({left:.1f}s of its pause were left); calls placed past it keep them"]


def override_of(limiter: Limiter, escaped: Sequence[str]) -> Rate | None:
    """The rate override in force for any of the ``escaped`` keys, if any."""
    from .._engine.layout import RATE_FIELD, parse_override, settings_key
    from .ops import server_now_us

    try:
        now = server_now_us(limiter.client)
        for key in escaped:
            value = limiter.client.hget(settings_key(limiter.prefix, key), RATE_FIELD)
            found = parse_override(value, now)
            if found is not None:
                return Rate(found[0], found[1])
    except REDIS_ERRORS as exc:
        raise limiter.translate(exc, "an override read") from exc
    return None


def run_explain(
    app: Any,
    task: str,
    args: Sequence[str],
    kwargs: str,
    url: str | None = None,
    prefix: str | None = None,
) -> list[str]:
    from .._celery.settings import setting
    from . import explain

    try:
        parsed = json.loads(kwargs)
    except ValueError as exc:
        raise SystemExit(f"--kwargs must be a JSON object: {exc}") from None
    if not isinstance(parsed, dict):
        raise SystemExit(f"--kwargs must be a JSON object, got {kwargs!r}")
    try:
        values = [explain.parse_value(a) for a in args]
        limiter = limiter_from(app, url, prefix)
        with url_named(app, url):
            explanation = explain.explain(app, task, values, parsed, limiter)
    except KeyError as exc:
        raise SystemExit(exc.args[0]) from None
    lines = explain.format_explanation(
        explanation,
        reserve=setting("ratelimit_reserve", app),
        max_countdown=setting("ratelimit_max_countdown", app),
    )
    if explanation.error:
        raise CallWouldFail(lines)
    return lines


class CallWouldFail(Exception):
    """``explain`` of a call that a worker would fail: its lines, and a non-zero exit."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def safe_url(limiter: Limiter) -> str:
    """The client's address without a password."""
    kwargs = getattr(getattr(limiter.client, "connection_pool", None), "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    if "host" in kwargs:
        return f"redis://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return type(limiter.client).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "explain" and not args.app:
        parser.error("explain needs the app: -A/--app")
    if args.command == "demo":
        from .demo import main as demo

        if args.nodes < 1 or args.tasks < 1:
            raise SystemExit("--nodes and --tasks must be at least 1")
        return demo(args.nodes, args.tasks, args.rate, not args.no_reserve, args.plot, args.burst)
    app = load_app(args.app) if args.app else None
    try:
        if args.command == "status":
            lines = run_status(
                app,
                args.url,
                args.prefix,
                args.match,
                sort=args.sort,
                limit=args.limit,
                as_json=args.json,
            )
        elif args.command == "reset":
            lines = run_reset(app, args.url, args.prefix, args.key)
        elif args.command in ("set", "unset"):
            rate = args.rate if args.command == "set" else None
            ttl = args.ttl if args.command == "set" else None
            lines = run_set(app, args.url, args.prefix, args.key, rate, ttl)
        elif args.command == "pause":
            lines = run_pause(app, args.url, args.prefix, args.key, args.seconds)
        elif args.command == "resume":
            lines = run_resume(app, args.url, args.prefix, args.key)
        elif args.command == "web":
            from .web import serve

            options = ("url", "prefix", "host", "port", "actions", "token")
            return serve(app, **{name: getattr(args, name) for name in options})
        elif args.command == "explain":
            lines = run_explain(app, args.task, args.args, args.kwargs, args.url, args.prefix)
        else:
            raise AssertionError(args.command)
    except CallWouldFail as exc:
        print("\n".join(exc.lines))
        return 1
    except RateLimitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
