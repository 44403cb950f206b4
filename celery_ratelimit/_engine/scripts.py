"""The Lua scripts, read once from the package (or the source tree's ``lua/``), and the
arguments a decision sends them.

One entry script per operation (``lua/acquire.lua``, ``start.lua``, ``release.lua``,
...), each opening with its KEYS, ARGV and reply. They share Lua functions with
parameters, kept in ``lua/lib/``: a line ``--- @include "lib/log.lua"`` is replaced by
that file's text (as BullMQ's scripts do), so that Redis runs one script while a reader
has files of a readable size.

A decision's script is composed from the features its call declares (:data:`COMPOSED`):
a line ``--- @include "lib/calendar.lua" if cal else local calendar = nil`` is kept in
the script of a call with calendar-aligned limits, and replaced by what follows
``else`` (Lua, or another file) in the others, so that a call runs a script holding
only the code it needs. The script is named after its file with ``+`` and each
feature: ``start+log+cal+conc``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple
from zoneinfo import ZoneInfo

from .calendar import boundaries, zone_of
from .exceptions import InvalidLimit
from .limit import DEFAULT_LEASE, Concurrency, check_cost

#: The features a decision's entry script is composed with (its ``@include ... if``
#: lines), in the order a name gives them: sliding log limits, a paced sliding limit,
#: calendar-aligned limits, concurrency limits, a reservation's fair queue.
FEATURES = ("log", "pace", "cal", "conc", "fair")


def _sets(*features: str) -> tuple[tuple[str, ...], ...]:
    """Every subset of ``features`` but the empty one, in :data:`FEATURES` order."""
    subsets: list[tuple[str, ...]] = [()]
    for feature in features:
        subsets += [(*one, feature) for one in subsets]
    return tuple(one for one in subsets[1:])


def _paced(sets: tuple[tuple[str, ...], ...], log: bool = True) -> tuple[tuple[str, ...], ...]:
    """``sets`` and, for each with a sliding limit (with a log, when ``log``), the same
    set with ``"pace"``: a paced call's."""
    more = [
        tuple(f for f in FEATURES if f in (*one, "pace")) for one in sets if "log" in one or not log
    ]
    return (*sets, *more)


#: The entry scripts composed by feature, and every set of features a call can ask for
#: (:meth:`Shape.script`). A call has some limit; a counter's release or settle has no
#: log to edit, nor a settle anything to do for a concurrency limit; a fair queue
#: orders the calls of one sliding limit, or of one Concurrency and nothing else; a
#: pace is taken by an acquisition or a start (a release or a settle never moves it).
COMPOSED: dict[str, tuple[tuple[str, ...], ...]] = {
    "acquire_full": _paced((*_sets("log", "cal", "conc"), ("log", "fair"), ("conc", "fair"))),
    "start": _paced(_sets("log", "cal", "conc")),
    "release": ((), *_sets("log", "cal", "conc")),
    "settle": ((), *_sets("log", "cal")),
    "counter": _paced(((), *_sets("cal", "conc")), log=False),
}
#: The script a call the plain ``acquire.lua`` leaves goes to (see :data:`FULL`).
ACQUIRE_FULL = "acquire_full+log"
#: The plain decisions: ``acquire_one.lua`` for a call of one limit, ``acquire.lua`` for
#: several (the same decision without the walk over limits, which costs a one-limit
#: call about 5% of its server time).
PLAIN = ("acquire_one", "acquire")
#: The entry scripts, by the name a limiter's calls use.
NAMES = (
    *PLAIN,
    *("+".join((file, *features)) for file, sets in COMPOSED.items() for features in sets),
    "renew",
    "pause",
    "resume",
    "override",
    "observe",
    "park",
    "index",
)
#: The scripts a limiter loads when it checks Redis (its first call): every one but the
#: compositions with a pace, aligned or concurrency limits or a fair queue, which the first call
#: sending one loads (EVALSHA, then SCRIPT LOAD on NOSCRIPT) so that Redis holds only
#: those the limiter's calls declare.
PRELOADED = tuple(name for name in NAMES if set(name.split("+")[1:]) <= {"log"})
_INCLUDE = re.compile(
    r'^--- @include "(lib/[a-z_]+\.lua)"'
    r'(?: if ([a-z]+)(?: else (local [a-z_]+ = nil|"lib/[a-z_]+\.lua"))?)?$\n?',
    re.MULTILINE,
)
#: The reply of a plain script (:data:`PLAIN`) to a call it leaves to ``acquire_full.lua``
#: (a key an upstream was observed on, entries of other weights, an abandoned slot).
FULL = 8
#: Longest horizon accepted (seconds): a year, the longest window.
MAX_HORIZON = 366 * 86_400.0
#: Reservations are never made further ahead than this by default (seconds).
DEFAULT_HORIZON = 3600.0


@cache
def source(name: str) -> str:
    """The script ``name``: ``lua/<file>.lua`` for a name ``<file>+<feature>+...``, its
    ``@include`` lines replaced by those files (and theirs: ``lib/log.lua`` includes
    ``lib/pace.lua``), those of a feature not named by what follows their ``else`` (a
    line of Lua, or a file), or by nothing."""
    if name not in NAMES:
        raise KeyError(name)
    file, *features = name.split("+")

    def include(match: re.Match[str]) -> str:
        path, feature, otherwise = match.groups()
        if feature is not None and feature not in features:
            if otherwise is None:
                return ""
            if not otherwise.startswith('"'):
                return otherwise + "\n"
            path = otherwise.strip('"')
        return _read(path).rstrip("\n") + "\n"

    text = _read(f"{file}.lua")
    while _INCLUDE.search(text):
        text = _INCLUDE.sub(include, text)
    return text


def _read(filename: str) -> str:
    """A file of ``lua/``, as it was when this module was imported (:data:`_LUA`)."""
    return _LUA[filename]


def _lua_files() -> dict[str, str]:
    """Every file of ``lua/`` by its name there (``"lib/log.lua"``): packaged in the
    wheel, or beside the package in a checkout."""
    packaged = resources.files("celery_ratelimit").joinpath("lua")
    root: Any = packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "lua"
    files = {}
    for folder, prefix in ((root, ""), (root / "lib", "lib/")):
        for one in folder.iterdir():
            if one.name.endswith(".lua"):
                files[prefix + one.name] = one.read_text(encoding="utf-8")
    return files


#: The Lua files, read once at import: a script composed later is made of the files this
#: process's Python was written for, even when the package is upgraded in place under a
#: running worker (its other files would send the old ARGV to the new code).
_LUA = _lua_files()


def is_counter(limits: tuple[Any, ...]) -> bool:
    """Are the call's sliding rate limits the counter's (``algorithm="counter"``)?"""
    first = limits[0]
    return (
        not isinstance(first, Concurrency) and first.align is None and first.algorithm == "counter"
    )


def _us(seconds: float) -> int:
    return int(seconds * 1_000_000)


@dataclass(frozen=True)
class Shape:
    """What a decision sends besides its keys, token and flag (see ``lua/lib/call.lua``):
    the limits (sliding rate limits, then aligned ones, then concurrency limits), the
    cost (one for every limit, or one per limit), and the options of the Celery layer,
    in seconds.

    ``horizon``: nothing is reserved further ahead. ``guard`` (at most 4% of each
    window is used) widens the windows in which calls are *placed*, while a start is
    checked in a window only half of it wider: a body that begins up to half of
    ``guard`` after its recorded start still never puts more than the limit in a window
    (the Celery layer's ``ratelimit_guard``). ``hold`` (``"log"`` only): a start at most
    this far ahead is counted for that instant and answered ``allowed`` with
    ``retry_after`` > 0: the caller waits that long and runs with no second call.
    ``lease``: a concurrency limit's lease when it gives none (None: ``DEFAULT_LEASE``).
    ``settling``: the costs are a settle's real ones (0, or above a limit, allowed).
    ``lead`` (an acquisition only): a grant is counted this long after now, where its
    body's first request is expected (``green.lead``); 0: now.

    Hashable, so a limiter remembers what it sends for a shape; its arguments are worked
    out, and checked, once.
    """

    limits: tuple[Any, ...]
    cost: int | tuple[int, ...] = 1
    horizon: float = DEFAULT_HORIZON
    guard: float = 0.0
    hold: float = 0.0
    lease: float | None = None
    settling: bool = False
    lead: float = 0.0

    @cached_property
    def cacheable(self) -> bool:
        """Only exact ints may be remembered: a bool or a float hashes like an int."""
        costs = self.cost if type(self.cost) is tuple else (self.cost,)
        return all(type(one) is int for one in costs)

    @cached_property
    def costs(self) -> tuple[int, ...]:
        """One cost per limit.

        Raises:
            InvalidLimit, TypeError: a bad cost, naming it.
        """
        cost, limits = self.cost, self.limits
        if isinstance(cost, int):
            costs: tuple[Any, ...] = (cost,) * len(limits)
        elif isinstance(cost, tuple):
            costs = cost
        else:
            raise TypeError(f"cost must be a positive int or one int per limit, got {cost!r}")
        if len(costs) != len(limits):
            raise InvalidLimit(f"got {len(costs)} costs for {len(limits)} limits")
        for limit, one in zip(limits, costs, strict=True):
            if isinstance(limit, Concurrency):
                continue
            if self.settling:
                # a real cost known after the call: a refund to 0, or above the limit
                if isinstance(one, bool) or not isinstance(one, int) or one < 0:
                    raise InvalidLimit(f"a settled cost must be an int of 0 or more, got {one!r}")
                continue
            check_cost(one)
            if one > limit.fixed_rate.limit:
                raise InvalidLimit(
                    f"cost {one} is greater than the limit of {limit.label}: "
                    "such a call could never run"
                )
        return tuple(costs)

    @cached_property
    def aligned(self) -> tuple[tuple[int, ZoneInfo], ...]:
        """(window µs, zone) of every calendar-aligned limit, in order."""
        return tuple(
            (limit.fixed_rate.window_us, zone_of(limit.align))
            for limit in self.limits
            if not isinstance(limit, Concurrency) and limit.align is not None
        )

    @cached_property
    def logged(self) -> bool:
        """Has the call sliding limits of the log (not the counter)?"""
        sliding = any(not isinstance(one, Concurrency) and one.align is None for one in self.limits)
        return sliding and not self.counter

    @cached_property
    def concurrent(self) -> bool:
        """Has the call concurrency limits?"""
        return any(isinstance(one, Concurrency) for one in self.limits)

    @cached_property
    def gated(self) -> bool:
        """Has the call calendar-aligned or concurrency limits?"""
        return bool(self.aligned) or self.concurrent

    @cached_property
    def _scripts(self) -> dict[tuple[str, bool], str]:
        return {}

    def script(self, operation: str, fair: bool = False) -> str:
        """The entry script that decides ``operation`` (``"acquire"``, or a key of
        :data:`COMPOSED`) for this call: the plain ``acquire``, or the operation's script
        composed with the features the call declares (see :data:`COMPOSED`). ``fair``:
        an acquire sent with a fair queue."""
        try:
            return self._scripts[operation, fair]
        except KeyError:
            pass
        file = "acquire_full" if operation == "acquire" else operation
        features = []
        if self.logged and operation != "counter":
            features.append("log")
        if self.paced and operation in ("acquire", "start", "counter"):
            features.append("pace")
        if self.aligned:
            features.append("cal")
        if self.concurrent and operation != "settle":
            features.append("conc")
        lone = len(self.limits) == 1 and isinstance(self.limits[0], Concurrency)
        if fair and operation == "acquire" and (not self.gated or lone):
            features.append("fair")
        name = "+".join((file, *features))
        if name == ACQUIRE_FULL and self.plain:
            name = PLAIN[0] if len(self.limits) == 1 else PLAIN[1]
        if name not in NAMES:
            raise KeyError(f"no script decides {operation!r} for {features}")
        self._scripts[operation, fair] = name
        return name

    @cached_property
    def plain(self) -> bool:
        """Sliding limits only, unpaced, with no lead: a call a plain script decides
        (:data:`PLAIN`; it hands the call to ``acquire_full.lua`` only in the cases its
        header names)."""
        return not self.gated and not self.paced and self.lead == 0

    @cached_property
    def args(self) -> tuple[int, ...]:
        """ARGV[3] on of a decision (see ``lua/lib/call.lua``), but for the aligned
        limits' boundaries, which :meth:`arguments` adds on every call.

        Raises:
            InvalidLimit, TypeError: a bad cost or horizon, naming it.
        """
        horizon = self.horizon
        if isinstance(horizon, bool) or not isinstance(horizon, (int, float)):
            raise TypeError(f"horizon must be a number of seconds, got {horizon!r}")
        if not 0 < horizon <= MAX_HORIZON:
            raise InvalidLimit(
                f"horizon must be more than 0 and at most {MAX_HORIZON:g} seconds, got {horizon!r}"
            )
        lead = self.lead
        if isinstance(lead, bool) or not isinstance(lead, (int, float)) or not 0 <= lead <= horizon:
            raise InvalidLimit(f"lead must be 0 to the horizon, in seconds, got {lead!r}")
        rates = [
            (limit, cost)
            for limit, cost in zip(self.limits, self.costs, strict=True)
            if not isinstance(limit, Concurrency)
        ]
        slots = [limit for limit in self.limits if isinstance(limit, Concurrency)]
        numbers = [
            len(rates) - len(self.aligned),
            len(self.aligned),
            len(slots),
            _us(horizon),
            _us(self.guard),
            _us(self.hold),
            _us(lead),
        ]
        for limit, cost in rates:
            numbers += (limit.fixed_rate.limit, limit.fixed_rate.window_us, cost)
            if limit.align is None:
                numbers.append(limit.burst or 0)  # 0: not paced
        return tuple(numbers)

    @cached_property
    def leases(self) -> tuple[int, ...]:
        """(most, lease µs) of every concurrency limit."""
        numbers: list[int] = []
        for slot in self.limits:
            if isinstance(slot, Concurrency):
                numbers += (slot.n, _us(slot.lease or self.lease or DEFAULT_LEASE))
        return tuple(numbers)

    @cached_property
    def paced(self) -> bool:
        """Is a sliding limit paced (``Limit(burst=...)``, see ``lua/lib/pace.lua``)?"""
        return any(
            not isinstance(limit, Concurrency) and limit.align is None and limit.burst
            for limit in self.limits
        )

    @cached_property
    def counter(self) -> bool:
        """Are the call's sliding rate limits the counter's (see :func:`is_counter`)?"""
        return is_counter(self.limits)

    @cached_property
    def fair_limit(self) -> Any:
        """The call's limit with a ``fair_key``, or None."""
        return next((one for one in self.limits if getattr(one, "fair_key", None)), None)

    @cached_property
    def fixed_arguments(self) -> tuple[int | str, ...] | None:
        """:meth:`arguments` when they are the same on every call (no aligned limit,
        whose window boundaries move with the clock), else None."""
        return None if self.aligned else tuple(self.arguments())

    def arguments(self) -> list[int | str]:
        """ARGV[3] on: :attr:`args`, the aligned limits' window boundaries around this
        machine's clock now, and :attr:`leases`."""
        every: list[int | str] = list(self.args)
        for window, zone in self.aligned:
            every += boundaries(window, zone)
        every += self.leases
        return every


class Prepared(NamedTuple):
    """An acquisition of one shape worked out once by a limiter (``Limiter._prepare_acquire``):
    the calls made of it (``Limiter._acquire_prepared``) differ only by their keys and token."""

    shape: Shape
    script: str
    arguments: tuple[int | str, ...]  # ARGV[3] on
    suffix: str  # what a token carries after its hex digits (``decision.token_of``)
    sends: dict[tuple[str, ...], list[str]]  # the script's KEYS by the call's keys


#: Shapes by their arguments: a call's arguments are worked out and checked once per
#: shape, so the same limits and options give the same Shape object.
_SHAPES: dict[tuple[Any, ...], Shape] = {}
_SHAPES_SIZE = 4096


def shape(
    limits: tuple[Any, ...],
    cost: int | Sequence[int],
    horizon: float = DEFAULT_HORIZON,
    guard: float = 0.0,
    hold: float = 0.0,
    lease: float | None = None,
    settling: bool = False,
    lead: float = 0.0,
) -> Shape:
    """A :class:`Shape` (a sequence of costs made a tuple, so that it hashes), the one
    made before for the same arguments if it may be remembered."""
    if isinstance(cost, Sequence) and not isinstance(cost, (str, bytes)):
        cost = tuple(cost)
    every = (limits, cost, horizon, guard, hold, lease, settling, lead)
    costs = cost if type(cost) is tuple else (cost,)
    if not all(type(one) is int for one in costs):
        # a bool or a float hashes like an int: never looked up, checked every time
        return Shape(*every)  # type: ignore[arg-type]
    try:
        return _SHAPES[every]
    except (KeyError, TypeError):
        pass
    made = Shape(*every)  # type: ignore[arg-type]
    if len(_SHAPES) >= _SHAPES_SIZE:
        _SHAPES.clear()
    with contextlib.suppress(TypeError):  # unhashable
        _SHAPES[every] = made
    return made
