"""Rate: a number of weight units allowed per sliding window, parsed from ``"10/s"``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

from .exceptions import InvalidRate

_SECOND, _MINUTE, _HOUR, _DAY = 1_000_000, 60_000_000, 3_600_000_000, 86_400_000_000
#: Every unit name, exactly as written (lowercase: "10/Ms" is no rate, not 10 per ms).
_UNITS_US = {
    "ms": 1_000,
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), _SECOND),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), _MINUTE),
    **dict.fromkeys(("h", "hour", "hours"), _HOUR),
    **dict.fromkeys(("d", "day", "days"), _DAY),
}
#: ASCII digits only: "٣/s" is refused rather than read as 3 per second.
_RATE_RE = re.compile(
    r"^\s*(?P<limit>[0-9]+)\s*/\s*(?P<amount>[0-9]+(?:\.[0-9]+)?)?\s*(?P<unit>[A-Za-z]+)\s*$",
    re.ASCII,
)
#: Largest limit accepted; keeps every running total far below the log's entry scores.
MAX_LIMIT = 10**12
#: Shortest and longest windows accepted.
MIN_WINDOW_US = 1_000
MAX_WINDOW_US = 366 * 86_400_000_000


@dataclass(frozen=True, slots=True)
class Rate:
    """``limit`` weight units per sliding window of ``window_us`` microseconds.

    Build one with :meth:`parse` (``Rate.parse("100/m")``) or directly
    (``Rate(100, window_us=60_000_000)``).

    Raises:
        InvalidRate: the limit is not a positive integer or the window is out of range.
    """

    limit: int
    window_us: int

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int):
            raise InvalidRate(f"rate limit must be an int, got {self.limit!r}")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise InvalidRate(f"rate limit must be between 1 and {MAX_LIMIT}, got {self.limit}")
        if isinstance(self.window_us, bool) or not isinstance(self.window_us, int):
            raise InvalidRate(f"rate window must be an int of microseconds, got {self.window_us!r}")
        if not MIN_WINDOW_US <= self.window_us <= MAX_WINDOW_US:
            raise InvalidRate(
                f"rate window must be between 1ms and 366 days, got {self.window_us}us"
            )

    @classmethod
    def parse(cls, text: str | Rate) -> Rate:
        """Parse ``"N/unit"`` or ``"N/<amount><unit>"``.

        Units, lowercase: ``ms``, ``s``, ``m``, ``h``, ``d`` (also ``sec``, ``second``,
        ``min``, ``minute``, ``hour``, ``day`` and their plurals); ASCII digits.
        Examples: ``"10/s"``, ``"100/m"``, ``"9500/d"``, ``"50/10s"``, ``"5/1.5s"``.

        Raises:
            InvalidRate: naming the text that could not be parsed.
        """
        if isinstance(text, Rate):
            return text
        if not isinstance(text, str):
            raise InvalidRate(f"a rate must be a string such as '10/s', got {text!r}")
        match = _RATE_RE.match(text)
        unit = _UNITS_US.get(match["unit"]) if match is not None else None
        if match is None or unit is None:
            raise InvalidRate(
                f"cannot parse rate {text!r}: expected 'N/unit' or 'N/<amount><unit>' "
                "with unit ms, s, m, h or d in lowercase (or sec, min, hour, day and their "
                "plurals), e.g. '10/s', '50/10s', '9500/d'"
            )
        window = Decimal(match["amount"] or 1) * unit
        if window != window.to_integral_value():
            raise InvalidRate(f"rate {text!r} has a window that is not a whole microsecond")
        try:
            return cls(int(match["limit"]), int(window))
        except InvalidRate as exc:
            raise InvalidRate(f"bad rate {text!r}: {exc}") from None

    @property
    def window(self) -> float:
        """The window length in seconds."""
        return self.window_us / 1_000_000

    def __str__(self) -> str:
        for name, size in (("d", _DAY), ("h", _HOUR), ("m", _MINUTE)):
            if self.window_us == size:
                return f"{self.limit}/{name}"
        if self.window_us == _SECOND:
            return f"{self.limit}/s"
        if self.window_us % _SECOND == 0:
            return f"{self.limit}/{self.window_us // _SECOND}s"
        # exact, so that Rate.parse(str(rate)) == rate (":g" kept 6 digits)
        return f"{self.limit}/{Decimal(self.window_us) / 1_000_000:f}s"
