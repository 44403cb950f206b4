"""The text ``status`` and ``explain`` print: the table of keys, and the lines about
paused keys, rate overrides and what an upstream said."""

from __future__ import annotations

from collections.abc import Sequence

from .._engine.limit import Concurrency
from .._engine.rate import Rate
from .ops import KeySettings, KeyStatus


def in_seconds(value: float) -> str:
    if value <= 0:
        return "now"
    if value < 120:
        return f"in {value:.3f}s"
    if value < 7200:
        return f"in {value / 60:.1f}m"
    return f"in {value / 3600:.1f}h"


def _window(window_us: int) -> str:
    if window_us == 0:
        return "-"
    text = str(Rate(1, window_us)).split("/", 1)[1]
    return text if text[0].isdigit() else "1" + text


def format_status(
    rows: Sequence[KeyStatus], prefix: str, url: str, *, app: bool = True
) -> list[str]:
    """The table ``status`` prints (``app``: the app's declarations were read)."""
    lines = [f"prefix {prefix!r} on {url}: {len(rows)} active key(s)"]
    if not rows:
        return lines
    header = (
        "KEY", "WINDOW", "ALG", "USED/LIMIT", "REMAINING", "RESERVED", "DRAINS", "NEXT FREE",
        "LIMIT",
    )  # fmt: skip
    table = [header, *(_cells(row, app) for row in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for r in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    for row in rows:
        if row.waiting:
            counts = ", ".join(f"{value} {n}" for value, n in row.waiting.items())
            lines.append(f"waiting on {row.name.key} by fair key: {counts}")
    lines.append(
        "USED: weight counted in the window until now (ALG conc: bodies running); "
        "RESERVED: future slots held by deferred tasks (conc: calls waiting for their "
        "turn; REMAINING and NEXT FREE count them); DRAINS: when the last of them is "
        "due, the backlog drained."
    )
    if not app and any(row.limit is None for row in rows):
        lines.append(
            "Without the app (-A proj), a key's declared limit, REMAINING and NEXT FREE "
            "are unknown (?): what Redis holds is shown."
        )
    return lines


def _cells(row: KeyStatus, app: bool) -> tuple[str, ...]:
    """One row of the ``status`` table."""
    reserved = str(row.reservations)
    if row.reserved != row.reservations:
        reserved += f" ({row.reserved} units)"
    name = row.name
    head = (name.key, _window(name.window_us), name.algorithm)
    if row.limit is None:
        used = f"{row.used}/{row.override.limit}" if row.override else f"{row.used}"
        return (*head, used, "?", reserved, _drains(row), "?", _undeclared_label(row, app))
    if isinstance(row.limit, Concurrency):
        used = f"{row.used}/{row.limit.n} running"
    else:
        used = f"{row.used}/{row.override.limit if row.override else row.limit.fixed_rate.limit}"
    free = in_seconds(row.next_free or 0.0)
    return (*head, used, str(row.remaining), reserved, _drains(row), free, _declared_label(row))


def _drains(row: KeyStatus) -> str:
    return in_seconds(row.drains_in) if row.drains_in else "-"


def _declared_label(row: KeyStatus) -> str:
    assert row.limit is not None
    label = f"{row.limit.label} ({', '.join(row.sources)})"
    if isinstance(row.limit, Concurrency):
        return label
    if row.override:
        label += f"; overridden: {row.override}"
    if row.pace_in is not None:
        label += f"; paced, burst {row.limit.burst}: next unit {in_seconds(row.pace_in)}"
    return label


def _undeclared_label(row: KeyStatus, app: bool) -> str:
    label = "not declared by the app" if app else "declared limit: needs the app (-A)"
    if row.override:
        label += f"; overridden: {row.override}"
    if row.oldest_leaves is not None:
        label += f"; oldest entry leaves {in_seconds(row.oldest_leaves)}"
    return label


def format_settings(rows: Sequence[KeySettings]) -> list[str]:
    """The lines ``status`` prints about paused keys and rate overrides."""
    lines = []
    for row in rows:
        if row.paused_for:
            lines.append(
                f"paused {row.key}: nothing is granted; the pause ends {in_seconds(row.paused_for)}"
            )
        if row.override is not None:
            left = row.override_for
            until = "until unset" if left is None else f"ends {in_seconds(left)}"
            lines.append(f"override {row.key}: {row.override} ({until})")
        for seen in row.seen:
            what = f"upstream {row.key} ({seen.algorithm} {_window(seen.window_us)}):"
            if seen.reset_in:
                what += f" {seen.remaining} left, full again {in_seconds(seen.reset_in)}"
            if seen.quota:
                what += f"{',' if seen.reset_in else ''} quota {seen.quota}"
            lines.append(what)
        for algorithm, window_us, limit in row.effective:
            lines.append(
                f"adapting {row.key} ({algorithm} {_window(window_us)}): effective "
                f"{Rate(limit, window_us)} (the declared rate when lower)"
            )
    return lines


__all__ = ["format_settings", "format_status", "in_seconds"]
