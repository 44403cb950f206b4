"""docker-compose.yml is checked for structure, since no Docker engine runs here: the
services exist, every command points at a module that imports, and every environment
variable a service sets is one its module reads."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
WORKERS = ("worker1", "worker2", "worker3")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    return dict(data["services"])


def _module(command: str) -> str | None:
    """The module a command runs: ``celery -A mod ...`` or ``python -m mod ...``."""
    argv = shlex.split(command)
    for flag in ("-A", "--app", "-m"):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    match = re.search(r"--app=(\S+)", command)
    return match[1] if match else None


def _command(service: dict[str, Any]) -> str:
    command = service["command"]
    return command if isinstance(command, str) else shlex.join(command)


def test_the_services_are_all_there(services: dict[str, Any]) -> None:
    assert {"redis", "rabbitmq", *WORKERS, "producer", "flower"} <= set(services)
    assert services["redis"]["image"].startswith("redis")
    assert services["rabbitmq"]["image"].startswith("rabbitmq")
    for name in WORKERS:
        assert " worker " in f" {_command(services[name])} "
        assert {"redis"} <= set(services[name]["depends_on"])
    assert set(WORKERS) <= set(services["producer"]["depends_on"])
    assert " flower" in _command(services["flower"])


def test_workers_send_task_events_for_flower(services: dict[str, Any]) -> None:
    for name in WORKERS:
        argv = shlex.split(_command(services[name]))
        assert "-E" in argv or "--task-events" in argv


def test_the_image_has_what_the_commands_need() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY . /app" in dockerfile and "WORKDIR /app" in dockerfile
    assert "flower" in dockerfile  # the flower service runs `celery flower`


@pytest.mark.parametrize("service", [*WORKERS, "producer", "flower"])
def test_commands_point_at_modules_that_import_and_read_the_environment(
    services: dict[str, Any], service: str
) -> None:
    spec = services[service]
    module = _module(_command(spec))
    assert module, f"{service}: no -A/-m module in {_command(spec)!r}"
    env = dict(spec.get("environment") or {})
    assert env, f"{service} sets no environment"

    # Import the module as the container would (from the repository root), with each
    # variable set to a marker (a number where the value is one, a URL of the same scheme
    # where it is a URL: the app's settings are checked when its tasks are bound), and
    # find every marker in what the module configured.
    def marker(i: int, name: str, value: Any) -> str:
        if str(value).isdigit():
            return str(987650 + i)
        if "://" in str(value):
            return f"{str(value).split('://')[0]}://marker-{i}-{name.lower()}:6379/0"
        return f"marker-{i}-{name.lower()}"

    markers = {name: marker(i, name, value) for i, (name, value) in enumerate(env.items())}
    probe = (
        "import importlib, json, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "seen = [repr(v) for v in vars(m).values()]\n"
        "app = getattr(m, 'app', None)\n"
        "if app is not None: seen += [repr(v) for v in app.conf.values()]\n"
        "print(json.dumps(seen))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **{k: str(v) for k, v in markers.items()}},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    seen = "\n".join(json.loads(result.stdout))
    for name, marker in markers.items():
        assert marker in seen, f"{service}: {module} does not read ${name}"
    if module.split(".")[0] != "celery_ratelimit":
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").exists() or (
            ROOT / Path(*module.split(".")) / "__init__.py"
        ).exists()
