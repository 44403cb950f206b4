"""The Lua scripts, read once from the package (or the source tree's ``lua/``)."""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

NAMES = ("sliding_log", "sliding_counter")


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua``: packaged in the wheel, or beside the package in a
    source checkout."""
    if name not in NAMES:
        raise KeyError(name)
    packaged = resources.files("celery_ratelimit") / "lua" / f"{name}.lua"
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "lua" / f"{name}.lua").read_text(
        encoding="utf-8"
    )
