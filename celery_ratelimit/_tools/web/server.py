"""The operator's page over HTTP: Starlette routes, served by uvicorn.

``GET /`` and ``GET /page.js`` are the page (static: no data in them); ``GET /api/keys``
is one page of keys as JSON (``source.Source.page``), polled every second by the page;
``POST /api/action/{pause|resume|set|unset|reset}`` runs the command line's own
operation (``cli.run_*``: the same validation, the same messages), only when the page
was started with ``--actions``, and only with the token. With a token configured, the
API answers nothing without it; a change is never a GET.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..._engine.exceptions import RateLimitError
from ..cli import run_pause, run_reset, run_resume, run_set
from .source import PAGE_SIZE, Source

log = logging.getLogger("celery_ratelimit.web")

#: The environment variable a token may come from (``--token`` wins).
TOKEN_ENV = "CELERY_RATELIMIT_WEB_TOKEN"
#: The header the page sends its token in (``Authorization: Bearer`` works too).
TOKEN_HEADER = "X-Ratelimit-Token"
ACTIONS = ("pause", "resume", "set", "unset", "reset")
_STATIC = Path(__file__).with_name("static")


def perform(source: Source, action: str, body: dict[str, Any]) -> list[str]:
    """Run ``action`` as the command line does, on ``body``'s ``key`` (and ``seconds``;
    ``rate`` and ``ttl``); returns its lines.

    Raises:
        RateLimitError: what the command line prints as ``error: ...``.
        SystemExit: a bad argument, with the command line's message.
    """
    key = body.get("key")
    if not isinstance(key, str) or not key:
        raise SystemExit("error: the following arguments are required: key")
    where = (source.app, source.url, source.prefix)
    if action == "pause":
        return run_pause(*where, key, str(body.get("seconds") or ""))
    if action == "resume":
        return run_resume(*where, key)
    if action == "set":
        ttl = body.get("ttl")
        try:
            seconds = None if ttl in (None, "") else float(ttl)
        except (TypeError, ValueError):
            raise SystemExit(f"argument --ttl: invalid float value: {ttl!r}") from None
        return run_set(*where, key, str(body.get("rate") or ""), seconds)
    if action == "unset":
        return run_set(*where, key, None, None)
    return run_reset(*where, key)


#: What the page may load and who may frame it: itself only (its styles are inline).
_POLICY = "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"
#: The names a page served on a loopback address answers to: a web site whose name is
#: made to resolve to 127.0.0.1 (DNS rebinding) is refused, its Host header is its own.
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "[::1]", "::1"]


def make_app(
    source: Source, *, actions: bool, token: str | None, hosts: list[str] | None = None
) -> Starlette:
    """The page's routes on ``source``: actions allowed when ``actions``; with a
    ``token``, every API call must carry it; ``hosts``: the Host names it answers to
    (None: any)."""

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        given = request.headers.get(TOKEN_HEADER) or ""
        scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given = given or bearer.strip()
        return hmac.compare_digest(given.encode(), token.encode())

    def refused() -> JSONResponse:
        return JSONResponse(
            {"error": "refused: this page's API needs its token (the page's token field)"}, 401
        )

    async def index(request: Request) -> Response:
        page = (_STATIC / "page.html").read_text("utf-8")
        return HTMLResponse(page, headers={"Content-Security-Policy": _POLICY})

    async def script(request: Request) -> Response:
        return Response((_STATIC / "page.js").read_text("utf-8"), media_type="text/javascript")

    def keys(request: Request) -> Response:  # sync: Starlette runs it in its thread pool
        if not authorized(request):
            return refused()
        query = request.query_params
        try:
            cursor = int(query.get("cursor") or 0)
            size = min(max(int(query.get("size") or PAGE_SIZE), 1), 500)
        except ValueError:
            return JSONResponse({"error": "cursor and size must be whole numbers"}, 400)
        document = source.page(query.get("search"), cursor, size)
        document.update(actions=actions, token=token is not None)
        return JSONResponse(document, 503 if document["error"] else 200)

    async def act(request: Request) -> Response:
        action = request.path_params["action"]
        if action not in ACTIONS:
            return JSONResponse({"error": f"no action {action!r}: one of {ACTIONS}"}, 404)
        if not actions:
            return JSONResponse({"error": "actions are off: start the page with --actions"}, 403)
        if not authorized(request):
            log.warning("refused %s without the token from %s", action, _peer(request))
            return refused()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError(body)
        except ValueError:
            return JSONResponse({"error": "the body must be a JSON object"}, 400)
        try:
            lines = await run_in_threadpool(perform, source, action, body)
        except RateLimitError as exc:
            message = f"error: {exc}"
        except SystemExit as exc:
            message = str(exc.code)
        else:
            log.info("%s %s from %s: %s", action, body["key"], _peer(request), " ".join(lines))
            return JSONResponse({"ok": True, "lines": lines})
        log.info("%s %s from %s failed: %s", action, body.get("key"), _peer(request), message)
        return JSONResponse({"ok": False, "error": message}, 400)

    return Starlette(
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts or ["*"])],
        routes=[
            Route("/", index),
            Route("/page.js", script),
            Route("/api/keys", keys),
            Route("/api/action/{action}", act, methods=["POST"]),
        ],
    )


def _peer(request: Request) -> str:
    return request.client.host if request.client else "?"


__all__ = ["ACTIONS", "LOOPBACK_NAMES", "TOKEN_ENV", "TOKEN_HEADER", "make_app", "perform"]
