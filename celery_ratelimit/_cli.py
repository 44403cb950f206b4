"""Command line: ``celery-ratelimit demo|status|reset|explain``.

Also ``python -m celery_ratelimit ...``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="celery-ratelimit",
        description="One rate limit shared by every Celery worker node, kept in Redis.",
    )
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
    demo.add_argument("--plot", metavar="PNG", help="draw executions per window to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import main as demo

        if args.nodes < 1 or args.tasks < 1:
            raise SystemExit("--nodes and --tasks must be at least 1")
        return demo(args.nodes, args.tasks, args.rate, not args.no_reserve, args.plot)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
