"""Tables the benchmarks write into docs/benchmarks.md themselves, between markers:

    <!-- NAME: written by the benchmarks -->
    ...
    <!-- end NAME -->

so that the page shows the latest run's figures, never figures copied by hand.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def markdown(header: Sequence[str], rows: Sequence[Sequence[object]], right: int = 1) -> list[str]:
    """A markdown table; columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def write(name: str, lines: Sequence[str], doc: Path = DOC) -> bool:
    """Put ``lines`` between the markers of ``name`` in ``doc``; False if it has none."""
    text = doc.read_text(encoding="utf-8")
    marker = re.escape(name)
    pattern = re.compile(
        rf"(<!-- {marker}: written by the benchmarks -->\n).*?(<!-- end {marker} -->)", re.DOTALL
    )
    if not pattern.search(text):
        return False
    body = "\n".join(lines) + "\n"
    doc.write_text(pattern.sub(lambda m: m.group(1) + body + m.group(2), text), encoding="utf-8")
    return True
