"""The operator's page: ``celery -A proj ratelimit web`` and ``celery-ratelimit web --url
URL [--host H] [--port P] [--actions] [--token T]``.

``source`` reads a page of keys (``status``'s reading, by a cursor); ``chart`` keeps
grants per second from the logs' entries; ``server`` is the HTTP side (Starlette, served
by uvicorn: the ``[web]`` extra); ``static/`` the page itself, plain HTML and JavaScript.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import sys
from typing import Any


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    app: Any,
    *,
    url: str | None = None,
    prefix: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8808,
    actions: bool = False,
    token: str | None = None,
) -> int:
    """Serve the page until interrupted; the exit status (2: refused to start)."""
    from .server import LOOPBACK_NAMES, TOKEN_ENV

    token = token or os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        print(
            f"error: refusing to serve on {host}: a page other machines can reach needs a "
            f"token (--token or ${TOKEN_ENV}); or serve on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    try:
        import uvicorn

        from .server import make_app
        from .source import Source
    except ImportError as exc:
        print(
            f"error: the page needs the [web] extra ({exc.name} is missing): "
            "pip install 'celery-ratelimit[web]'",
            file=sys.stderr,
        )
        return 1
    made = actions and token is None
    if made:
        token = secrets.token_urlsafe(18)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    source = Source(app, url, prefix)
    page = f"http://{host}:{port}/"
    print(
        f"celery-ratelimit web on {page}: {source.where()}; actions "
        f"{'on (a POST with the token)' if actions else 'off'}",
        flush=True,
    )
    if made:
        print(f"the token (made for this run): {token}; open {page}#token={token}", flush=True)
    hosts = LOOPBACK_NAMES if is_loopback(host) else None  # else: the token guards it
    page_app = make_app(source, actions=actions, token=token, hosts=hosts)
    uvicorn.run(page_app, host=host, port=port, log_level="warning")
    return 0


__all__ = ["is_loopback", "serve"]
