"""What the examples share that is no part of rate limiting: a stand-in upstream served
over HTTP, waiting for the workers' records, and the ``produce`` command line. Each
example's limits, tasks and report stay in its own module; copy those, not this."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis

#: An upstream's answer to one request: status, headers, body.
Answer = tuple[int, dict[str, str], str]


def serve(port: int, handle: Callable[[dict[str, str]], Answer]) -> ThreadingHTTPServer:
    """Serve ``GET /...?name=value&...`` on 127.0.0.1:``port`` in a thread, each
    request answered by ``handle(query)``; ``shutdown()`` the server when done."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            query = dict(p.split("=", 1) for p in self.path.split("?", 1)[1].split("&"))
            status, headers, body = handle(query)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_for_records(
    client: redis.Redis, key: str, total: int, timeout: float, what: str = "calls"
) -> bool:
    """Until the list ``key`` holds ``total`` records (one per execution of ``what``);
    False, and a line on stderr, if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while (done := client.llen(key)) < total:
        if time.monotonic() > deadline:
            print(f"timed out: {done} of {total} {what} executed", file=sys.stderr)
            return False
        time.sleep(0.2)
    return True


def produce_command(
    produce: Callable[[int], int], option: str, default: int, what: str
) -> Callable[[list[str] | None], int]:
    """``main(argv)`` for ``python -m <produce's module> produce [--<option> N]``."""

    def main(argv: list[str] | None = None) -> int:
        parser = argparse.ArgumentParser(prog=f"python -m {produce.__module__}")
        commands = parser.add_subparsers(dest="command", required=True)
        commands.add_parser("produce", help=what).add_argument(
            f"--{option}", type=int, default=default
        )
        args = parser.parse_args(argv)
        return produce(getattr(args, option))

    return main
