"""The functions of ours an allowed task passes: ``python -m benchmarks.bench_path``.

A task of ``RateLimitedTask`` with one limit that never binds runs ``before_start`` in
this process, as a worker's pool process runs it (a request pushed as Celery pushes
one, not eager), against a private redis-server, warm (its plan, settings, limiter and
scripts ready). ``sys.setprofile`` records every function of ``celery_ratelimit`` it
calls, from ``before_start`` to the script's reply; comprehensions and lambdas are not
counted (they are expressions of the function that holds them). Two keys: a fixed one
(``"api"``) and a template (``"api:{k}"``, rendered and escaped on every call).

Prints, for each, the functions in call order and the count, functions and modules.
"""

from __future__ import annotations

import sys
import uuid
from types import FrameType
from typing import Any

from celery import Celery

from celery_ratelimit import Limit, RateLimitedTask
from celery_ratelimit._tools.embedded import RedisServer

PACKAGE = "celery_ratelimit/"


def path_of(url: str, key: str) -> list[str]:
    """The functions (``module:qualname``) an allowed call of a task keyed ``key`` passes."""
    app = Celery("bench_path", broker="memory://", set_as_current=False)
    app.conf.ratelimit_redis_url = url

    @app.task(base=RateLimitedTask, ratelimit=Limit("1000000/s", key=key), bind=True, shared=False)
    def job(self: Any, k: str) -> str:
        return k

    task = app.tasks[job.name]

    def once() -> None:
        task.push_request(
            id=str(uuid.uuid4()),
            is_eager=False,
            called_directly=False,
            args=("a",),
            kwargs={},
            headers={},
            delivery_info={},
            retries=0,
        )
        try:
            task.before_start(task.request.id, ("a",), {})
        finally:
            task.pop_request()

    for _ in range(5):  # warm: the plan, the settings, the limiter, the scripts
        once()
    seen: dict[str, None] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and PACKAGE in frame.f_code.co_filename:
            name = frame.f_code.co_qualname
            if "<" not in name:  # not a comprehension or a lambda
                module = frame.f_code.co_filename.rsplit(PACKAGE, 1)[1]
                seen.setdefault(f"{module}:{name}")

    sys.setprofile(profile)
    try:
        once()
    finally:
        sys.setprofile(None)
    return list(seen)


def main() -> int:
    with RedisServer() as server:
        for key in ("api", "api:{k}"):
            functions = path_of(server.url, key)
            modules = {name.split(":", 1)[0] for name in functions}
            print(f"\nkey {key!r}: {len(functions)} functions in {len(modules)} modules")
            for name in functions:
                print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
