"""What a project's conftest.py needs to test its rate-limited tasks (docs/testing.md)."""

from __future__ import annotations

from typing import Any

import pytest

# pytest-celery 1.x gives the name `celery_worker` to a worker in Docker; this restores
# Celery's in-process one (a worker thread on `celery_app`, stopped after each test).
from celery.contrib.pytest import celery_worker  # noqa: F401


@pytest.fixture(scope="session")
def celery_config(ratelimit_celery_config: dict[str, Any]) -> dict[str, Any]:
    return ratelimit_celery_config  # broker, backend and limiter on the test's Redis


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    return "threads"  # bodies run at once, as on a real node ("solo": one at a time)


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    return {"concurrency": 4}
