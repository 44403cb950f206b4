"""``celery -A proj ratelimit status|reset|set|unset|pause|resume|explain|web``: the
command line inside Celery's.

Registered through the ``celery.commands`` entry point; Celery loads the app given by
``-A`` and passes it in the click context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from .._engine.exceptions import RateLimitError


def _echo(lines: list[str]) -> None:
    click.echo("\n".join(lines))


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


def _run(lines: Callable[[], list[str]]) -> None:
    """Print the lines a command returns; a limiter error as Celery's CLI prints errors."""
    try:
        _echo(lines())
    except RateLimitError as exc:
        raise click.ClickException(str(exc)) from exc


def _where(command: Callable[..., None]) -> Callable[..., None]:
    """The options that say which Redis and prefix, when not the app's."""
    command = click.option("--prefix", help="key prefix (default: the app's ratelimit_key_prefix)")(
        command
    )
    return click.option("--url", help="Redis URL (default: the app's ratelimit_redis_url)")(command)


@click.group(name="ratelimit")
def ratelimit() -> None:
    """Shared rate limits kept in Redis: status, reset KEY, set KEY RATE, unset KEY,
    pause KEY SECONDS, resume KEY, explain TASK, web."""


@ratelimit.command()
@_where
@click.option("--match", metavar="GLOB", help="only keys matching GLOB ('yt:*')")
@click.option(
    "--sort",
    type=click.Choice(["key", "backlog", "used"]),
    default="key",
    help="order: by key (default), by the backlog's drain time, by the share used",
)
@click.option("--limit", type=int, metavar="N", help="only the first N keys")
@click.option("--json", "as_json", is_flag=True, help="one JSON document: keys and settings")
@click.pass_context
def status(
    ctx: click.Context,
    url: str | None,
    prefix: str | None,
    match: str | None,
    sort: str,
    limit: int | None,
    as_json: bool,
) -> None:
    """Each active key: used/limit, remaining, reservations, drain time, next free slot."""
    from .cli import run_status

    _run(lambda: run_status(_app(ctx), url, prefix, match, sort=sort, limit=limit, as_json=as_json))


def _key_command(name: str, runner: str, help_text: str) -> None:
    """A command of one argument, KEY, printing what ``cli.<runner>`` returns."""

    @ratelimit.command(name=name, help=help_text)
    @click.argument("key")
    @_where
    @click.pass_context
    def command(ctx: click.Context, key: str, url: str | None, prefix: str | None) -> None:
        from . import cli

        _run(lambda: getattr(cli, runner)(_app(ctx), url, prefix, key))


_key_command(
    "reset", "run_reset", "Forget everything counted for KEY (all its windows), e.g. yt:quota:key1."
)
_key_command("resume", "run_resume", "End KEY's pause now: its calls are granted again.")


@ratelimit.command(name="set")
@click.argument("key")
@click.argument("rate")
@click.option("--ttl", type=float, metavar="SECONDS", help="the override lapses then")
@_where
@click.pass_context
def set_rate(
    ctx: click.Context, key: str, rate: str, ttl: float | None, url: str | None, prefix: str | None
) -> None:
    """Use RATE (50/s) for KEY on every worker from now on: a runtime override."""
    from .cli import run_set

    _run(lambda: run_set(_app(ctx), url, prefix, key, rate, ttl))


@ratelimit.command()
@click.argument("key")
@_where
@click.pass_context
def unset(ctx: click.Context, key: str, url: str | None, prefix: str | None) -> None:
    """Remove KEY's runtime override: its calls' own rates apply again."""
    from .cli import run_set

    _run(lambda: run_set(_app(ctx), url, prefix, key, None, None))


@ratelimit.command()
@click.argument("key")
@click.argument("seconds")
@_where
@click.pass_context
def pause(ctx: click.Context, key: str, seconds: str, url: str | None, prefix: str | None) -> None:
    """Grant nothing on KEY for SECONDS (or until a Retry-After HTTP-date), on every worker."""
    from .cli import run_pause

    _run(lambda: run_pause(_app(ctx), url, prefix, key, seconds))


@ratelimit.command()
@_where
@click.option("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
@click.option("--port", type=int, default=8808, help="port (default 8808)")
@click.option("--actions", is_flag=True, help="allow pause, resume, set, unset, reset (token)")
@click.option("--token", help="the page API's token (default: $CELERY_RATELIMIT_WEB_TOKEN)")
@click.pass_context
def web(ctx: click.Context, /, **options: Any) -> None:
    """Serve the operator's live page of every key (127.0.0.1:8808 by default)."""
    from .web import serve

    ctx.exit(serve(_app(ctx), **options))


@ratelimit.command()
@click.argument("task")
@click.argument("args", nargs=-1)
@click.option("--kwargs", default="{}", help="keyword arguments as a JSON object")
@_where
@click.pass_context
def explain(
    ctx: click.Context,
    task: str,
    args: tuple[str, ...],
    kwargs: str,
    url: str | None,
    prefix: str | None,
) -> None:
    """Which limits apply to TASK(ARGS...), their Redis keys, and a decision (peek)."""
    from .cli import CallWouldFail, run_explain

    try:
        _echo(run_explain(_app(ctx), task, args, kwargs, url, prefix))
    except CallWouldFail as exc:
        _echo(exc.lines)
        ctx.exit(1)
    except RateLimitError as exc:
        raise click.ClickException(str(exc)) from exc
    except SystemExit as exc:
        raise click.ClickException(str(exc.code)) from None
