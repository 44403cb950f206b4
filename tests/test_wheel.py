"""The built wheel carries the Lua scripts (and the pytest plugin) and works in a fresh
virtualenv."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
    )
    (built,) = out.glob("celery_ratelimit-*.whl")
    return built


def test_the_wheel_ships_the_lua_scripts_and_the_type_marker(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    scripts = {f"celery_ratelimit/lua/{p.name}" for p in (ROOT / "lua").glob("*.lua")}
    assert len(scripts) >= 4  # the scripts and the files they include
    assert {*scripts, "celery_ratelimit/py.typed", "celery_ratelimit_pytest.py"} <= names
    assert not any(name.startswith("tests/") for name in names)


def test_a_fresh_venv_with_the_wheel_makes_a_decision(
    wheel: Path, redis_url: str, tmp_path: Path
) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        check=True,
    )
    snippet = f"""
import celery_ratelimit, pathlib
from celery_ratelimit import Limit, Limiter
assert "site-packages" in celery_ratelimit.__file__, celery_ratelimit.__file__
limiter = Limiter.from_url({redis_url!r}, prefix="wheel-test")
d = [limiter.acquire("wheel", Limit("2/s"), cost=1) for _ in range(3)]
print([x.allowed for x in d], d[0].remaining)
limiter.reset("wheel", Limit("2/s"))
"""
    result = subprocess.run(
        [str(python), "-c", snippet], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    assert result.stdout.strip() == "[True, True, False] 1"
