"""Redis key names: one prefix, one Cluster hash tag per call, escaped user input.

A limit key such as ``"yt:quota:key1"`` becomes
``ratelimit:{yt}:quota:key1:log:86400000000`` (see ``_layout``): prefix, the first
segment as the Redis Cluster hash tag, the rest, the algorithm and the window.

Values taken from task arguments are escaped before they enter a template: every
byte outside ``[A-Za-z0-9_.@-]`` becomes ``%XX``, so a value can contain neither a
``:`` (to reach another key) nor a brace (to move the hash tag). A value whose
escaped form is longer than ``MAX_PART`` is replaced by ``#`` and 32 hex digits of
its SHA-256, which no escaped value can equal since ``#`` is itself escaped.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Mapping

from ._exceptions import InvalidLimit

MAX_PART = 64
MAX_KEY = 200
_UNSAFE_PART = re.compile(rb"[^A-Za-z0-9_.@-]")
_UNSAFE_KEY = re.compile(rb"[^\x21-\x7e]|[{}%#]")


def _percent(match: re.Match[bytes]) -> bytes:
    return b"%%%02X" % match.group()[0]


def escape_part(value: object) -> str:
    """Escape one value taken from a task's arguments for use inside a key."""
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogatepass")
    escaped = _UNSAFE_PART.sub(_percent, raw)
    if len(escaped) > MAX_PART:
        return "#" + hashlib.sha256(escaped).hexdigest()[:32]
    return escaped.decode("ascii")


def _bounded(key: str) -> str:
    if len(key) <= MAX_KEY:
        return key
    head = key.split(":", 1)[0][:MAX_PART]
    return f"{head}:#{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def _escape_literal(text: str) -> str:
    return _UNSAFE_KEY.sub(_percent, text.encode("utf-8", "surrogatepass")).decode("ascii")


def escape_key(key: str) -> str:
    """Escape a key given by code (not by a task argument): keeps ``:`` as structure,
    escapes braces, ``%``, ``#``, spaces and control characters; bounds its length."""
    return _bounded(_escape_literal(key))


def render(template: str, arguments: Mapping[str, object], args: tuple[object, ...]) -> str:
    """Format a key template from a call's bound arguments, escaping each value.

    ``arguments`` maps parameter names to values; ``args`` are the positional
    arguments, for ``{0}``-style fields.

    Raises:
        InvalidLimit: the template names an argument this call does not have.
    """
    pieces: list[str] = []
    for literal, name, _spec, _conv in string.Formatter().parse(template):
        pieces.append(_escape_literal(literal))
        if name is None:
            continue
        if name.isdigit():
            if int(name) >= len(args):
                raise InvalidLimit(
                    f"key template {template!r} needs positional argument {name}, "
                    f"but the call has {len(args)}"
                )
            value = args[int(name)]
        elif name in arguments:
            value = arguments[name]
        else:
            raise InvalidLimit(
                f"key template {template!r} names argument {name!r}, which this call "
                f"does not have (arguments: {', '.join(arguments) or 'none'})"
            )
        pieces.append(escape_part(value))
    return _bounded("".join(pieces))
