"""``celery -A proj ratelimit status|reset|explain``: the same commands inside Celery's CLI.

Registered through the ``celery.commands`` entry point; Celery loads the app given by
``-A`` and passes it in the click context.
"""

from __future__ import annotations

from typing import Any

import click

from ._exceptions import RateLimitError


def _echo(lines: list[str]) -> None:
    click.echo("\n".join(lines))


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


@click.group(name="ratelimit")
def ratelimit() -> None:
    """Shared rate limits kept in Redis: status, reset KEY, explain TASK."""


@ratelimit.command()
@click.option("--url", help="Redis URL (default: the app's ratelimit_redis_url)")
@click.option("--prefix", help="key prefix (default: the app's ratelimit_key_prefix)")
@click.option("--match", metavar="GLOB", help="only keys matching GLOB ('yt:*')")
@click.pass_context
def status(ctx: click.Context, url: str | None, prefix: str | None, match: str | None) -> None:
    """Each active key: used/limit, remaining, next free slot, reservations."""
    from ._cli import run_status

    try:
        _echo(run_status(_app(ctx), url, prefix, match))
    except RateLimitError as exc:
        raise click.ClickException(str(exc)) from exc


@ratelimit.command()
@click.argument("key")
@click.option("--url", help="Redis URL (default: the app's ratelimit_redis_url)")
@click.option("--prefix", help="key prefix (default: the app's ratelimit_key_prefix)")
@click.pass_context
def reset(ctx: click.Context, key: str, url: str | None, prefix: str | None) -> None:
    """Forget everything counted for KEY (all its windows), e.g. yt:quota:key1."""
    from ._cli import run_reset

    try:
        _echo(run_reset(_app(ctx), url, prefix, key))
    except RateLimitError as exc:
        raise click.ClickException(str(exc)) from exc


@ratelimit.command()
@click.argument("task")
@click.argument("args", nargs=-1)
@click.option("--kwargs", default="{}", help="keyword arguments as a JSON object")
@click.pass_context
def explain(ctx: click.Context, task: str, args: tuple[str, ...], kwargs: str) -> None:
    """Which limits apply to TASK(ARGS...), their Redis keys, and a decision (peek)."""
    from ._cli import CallWouldFail, run_explain

    try:
        _echo(run_explain(_app(ctx), task, args, kwargs))
    except CallWouldFail as exc:
        _echo(exc.lines)
        ctx.exit(1)
    except RateLimitError as exc:
        raise click.ClickException(str(exc)) from exc
    except SystemExit as exc:
        raise click.ClickException(str(exc.code)) from None
