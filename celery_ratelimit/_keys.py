"""Redis key names: one prefix, one Cluster hash tag per key, escaped user input.

A limit key such as ``"yt:quota"`` becomes ``ratelimit:{yt}:quota:log:86400000000``
(see ``_layout``): prefix, the Redis Cluster hash tag, the rest of the key, the
algorithm and the window.

The hash tag is the key's first segment, followed by the values its template filled in
after that segment: ``api:{tenant}`` is tagged ``api:<tenant>``, ``yt:quota:{api_key}``
and ``yt:search:{api_key}`` are both tagged ``yt:<api_key>``, ``{tenant}:erp`` is
tagged ``<tenant>``; a key without such values (``yt:quota``, ``yt:search``, a task's
name, a key function's string) is tagged by its first segment (``yt``). So each tenant
lands in a slot of its own, limits of one call that share their literal head and their
values share a slot, and a key's tag never depends on which other keys it is checked
with: one budget has one Redis key in every call. A rendered key whose tag is more than
its first segment carries it, ``{api:t1}:t1``; :func:`logical_key` gives it back as
written, ``api:t1``.

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
#: A tag longer than this (many or long values) becomes its first segment and a digest.
MAX_TAG = 2 * MAX_PART
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
    values: list[str] = []  # those after the first segment: the rest of the hash tag
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
        escaped = escape_part(value)
        if any(":" in piece for piece in pieces):
            values.append(escaped)
        pieces.append(escaped)
    return tagged(_bounded("".join(pieces)), values)


def tagged(key: str, values: list[str]) -> str:
    """``key`` (escaped) with its hash tag marked, ``{first:value...}:rest``, when the
    tag holds ``values`` (escaped, so neither a ``:`` nor a brace) besides the first
    segment; else ``key`` itself."""
    if not values:
        return key
    first, colon, rest = key.partition(":")
    tag = ":".join([first, *values])
    if len(tag) > MAX_TAG:
        tag = f"{first}:#{hashlib.sha256(tag.encode()).hexdigest()[:32]}"
    return f"{{{tag}}}{colon}{rest}"


def split_tag(key: str) -> tuple[str, str]:
    """``(hash tag, the rest after the first segment)`` of an escaped key."""
    if key.startswith("{"):
        tag, _, rest = key[1:].partition("}")
        return tag, rest
    first, colon, rest = key.partition(":")
    return first, colon + rest


def logical_key(key: str) -> str:
    """An escaped key as written, its marked hash tag left out (``{api:t1}:t1`` ->
    ``api:t1``): what ``status`` shows and ``reset KEY`` takes."""
    tag, rest = split_tag(key)
    return tag.partition(":")[0] + rest
