"""A real HTTP upstream for the tests: a threaded ``http.server`` on 127.0.0.1 that
enforces its own sliding limit (``limit`` requests in any ``window`` seconds, per path)
and answers every request with its rate-limit headers, in the family its path names:

- ``/ietf``: ``RateLimit-Policy: "default";q=L;w=W`` and ``RateLimit: "default";r=R;t=T``
- ``/x``: ``X-RateLimit-Limit``, ``-Remaining``, ``-Reset`` (the reset in epoch seconds)
- ``/llm``: ``x-ratelimit-limit-requests``, ``-remaining-requests``, ``-reset-requests``
  (a duration in milliseconds)
- ``/none``: no rate-limit headers (a 429 still gives its ``Retry-After``)

A path ``/<family>-<anything>`` answers as ``/<family>`` with a window of its own.

The reset is when the oldest request of the window leaves it (until then, the remaining
is all there is), rounded up where the family counts whole seconds. Over the limit it
answers 429 with a ``Retry-After`` (whole seconds, rounded up). Every request is kept in
``arrivals``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

FAMILIES = ("ietf", "x", "llm")


@dataclass
class Arrival:
    at: float  # this machine's clock, seconds
    family: str
    task: str
    status: int


@dataclass
class Upstream:
    limit: int
    window: float
    arrivals: list[Arrival] = field(default_factory=list)
    _accepted: dict[str, deque[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def __enter__(self) -> Upstream:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                family = url.path.strip("/")
                task = parse_qs(url.query).get("task", [""])[0]
                status, headers = upstream.answer(family, task)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: Any) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    def url(self, family: str) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/{family}"

    def answer(self, family: str, task: str) -> tuple[int, dict[str, str]]:
        """Count the request if it fits the window; the status and the headers."""
        with self._lock:
            now = time.time()
            accepted = self._accepted.setdefault(family, deque())
            while accepted and accepted[0] <= now - self.window:
                accepted.popleft()
            status = 200 if len(accepted) < self.limit else 429
            if status == 200:
                accepted.append(now)
            self.arrivals.append(Arrival(now, family, task, status))
            remaining = self.limit - len(accepted)
            frees = accepted[0] + self.window - now if accepted else 0.0
            headers = self._headers(family, remaining, frees, now)
            if status == 429:
                headers["Retry-After"] = str(math.ceil(accepted[0] + self.window - now))
            return status, headers

    def _headers(self, family: str, remaining: int, frees: float, now: float) -> dict[str, str]:
        family = family.split("-")[0]
        if family == "none":
            return {}
        if family == "ietf":
            return {
                "RateLimit-Policy": f'"default";q={self.limit};w={math.ceil(self.window)}',
                "RateLimit": f'"default";r={remaining};t={math.ceil(frees)}',
            }
        if family == "x":
            return {
                "X-RateLimit-Limit": str(self.limit),
                "X-RateLimit-Remaining": str(remaining),
                "X-RateLimit-Reset": str(math.ceil(now + frees)),
            }
        return {
            "x-ratelimit-limit-requests": str(self.limit),
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": f"{math.ceil(frees * 1000)}ms",
        }
