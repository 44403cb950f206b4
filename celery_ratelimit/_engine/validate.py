"""Checks of the values a Limit, a Concurrency and a call are given: costs, weights, key
and fair-key templates. Each raises at the moment the bad value is given, naming it."""

from __future__ import annotations

import math
import string

from .exceptions import InvalidLimit


def check_cost(cost: object, where: str = "cost") -> int:
    """Return ``cost`` if it is a positive int (not a bool), else raise.

    Raises:
        TypeError: ``cost`` is a bool, a float or not a number.
        InvalidLimit: ``cost`` is zero or negative.
    """
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise TypeError(f"{where} must be a positive int, got {cost!r}")
    if cost < 1:
        raise InvalidLimit(f"{where} must be a positive int, got {cost!r}")
    return cost


def check_weight(weight: object, where: str = "fair_weight") -> float:
    """Return ``weight`` as a float if it is a positive finite number (not a bool).

    Raises:
        InvalidLimit: ``weight`` is not a number, or is zero, negative, NaN or infinite.
    """
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise InvalidLimit(f"{where} must be a positive number, got {weight!r}")
    if not (math.isfinite(weight) and weight > 0):
        raise InvalidLimit(f"{where} must be a positive finite number, got {weight!r}")
    return float(weight)


def _fair_fields(fair_key: object, what: str) -> tuple[str, ...]:
    """The argument names a ``fair_key`` template refers to (none for a callable).

    Raises:
        InvalidLimit: an empty or bad template. TypeError: neither a string nor a callable.
    """
    if fair_key is None or callable(fair_key):
        return ()
    if not isinstance(fair_key, str):
        raise TypeError(f"{what} fair_key must be a string, a callable or None, got {fair_key!r}")
    if not fair_key:
        raise InvalidLimit(f"{what} fair_key must not be empty")
    return template_fields(fair_key)


#: Characters that stay as they are in a template's literal text and that an argument
#: value can never contain unescaped (values keep only ``[A-Za-z0-9_.@-]``, literals
#: escape ``{}%#``; see ``keys``): one of them must separate two fields.
_SEPARATORS = frozenset(map(chr, range(0x21, 0x7F))) - set(
    string.ascii_letters + string.digits + "_.@-{}%#"
)


def template_fields(template: str) -> tuple[str, ...]:
    """The argument names a key template refers to; validates its braces.

    Raises:
        InvalidLimit: unbalanced braces, an empty ``{}``, or a field that is not a plain
            argument name or position (``{user.id}``, ``{x!r}`` and ``{x:>5}`` are refused),
            or two fields not separated by a character such as ``:`` (``{a}-{b}``).
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidLimit(f"bad key template {template!r}: {exc}") from None
    names: list[str] = []
    for literal, name, spec, conversion in parsed:
        if name is not None and names and not set(literal) & _SEPARATORS:
            # "{a}-{b}" would give ("x-y", "z") and ("x", "y-z") one key
            raise InvalidLimit(
                f"bad key template {template!r}: fields {{{names[-1]}}} and {{{name}}} "
                "must be separated by ':' (or another character that argument values "
                "cannot contain unescaped), or two different calls could share a key"
            )
        if name is None:
            continue
        if not (name.isidentifier() or name.isdigit()) or spec or conversion:
            raise InvalidLimit(
                f"bad key template {template!r}: field {{{name}}} must be a plain "
                "argument name such as {tenant} or a position such as {0}"
            )
        names.append(name)
    return tuple(names)


__all__ = ["check_cost", "check_weight", "template_fields"]
