"""What a benchmark leaves: its figures as JSON in ``benchmarks/results/`` (not in git),
and its table on the console and in docs/benchmarks.md (``docs_tables``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import docs_tables

RESULTS = Path(__file__).resolve().parent / "results"


def save(name: str, results: Any, indent: int | None = 1) -> Path:
    """Write ``results`` as JSON to ``results/NAME`` (the folder made if missing)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(results, indent=indent) + "\n")
    return path


def publish(name: str, results: Any, lines: Sequence[str], section: str | None) -> None:
    """:func:`save` ``results`` as ``name``, print the table ``lines`` and write them in
    docs/benchmarks.md between the markers of ``section`` (None: not in the docs)."""
    save(name, results)
    print("\n".join(lines))
    if section is not None:
        docs_tables.write(section, lines)
