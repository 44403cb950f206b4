"""Key names: escaped user input, and each key's Redis Cluster hash tag.

A key is a string, ``api:t1`` or ``yt:quota:K1``, however it is reached: rendered from a
task's template (``api:{tenant}``), returned by a key function, or given as a string to
``Limiter``, the CLI or ``UpstreamRateLimited``. Its Redis names depend on that string
alone (and the limit): ``layout.redis_key`` builds every one of them, as
``{prefix}:{tag}:key:{algorithm}:{window_us}``.

The tag is, by :func:`hash_tag`, the part of the key in braces when the key names a tag
of its own (``{yt}:quota``, Redis's own convention; ``{{yt}}:quota`` in a template), else
the key's first and last segments: ``api:t1`` is tagged ``api:t1``, ``yt:quota:K1`` and
``yt:search:K1`` are both tagged ``yt:K1``, ``K1:erp`` is tagged ``K1:erp``. So tenants
spread over a Cluster's shards, and the budgets of one holder (its last segment) under
one service (its first) share a slot, as the limits checked together in one call must.

Values taken from task arguments are escaped before they enter a template: every
byte outside ``[A-Za-z0-9_.@-]`` becomes ``%XX``, so a value can contain neither a
``:`` (to reach another key) nor a brace (to move the hash tag). A value whose
escaped form is longer than ``MAX_PART`` is replaced by ``#`` and 32 hex digits of
its SHA-256, which no escaped value can equal since ``#`` is itself escaped. Literal
text keeps its braces only where they name the key's tag (the first ``{`` and the
first ``}`` after it, with something between), and keeps an escape or a digest as it
is: escaping a key twice gives the key, so the string ``status`` shows is the key.
"""

from __future__ import annotations

import functools
import hashlib
import re
import string
from collections.abc import Mapping

from .exceptions import InvalidLimit

MAX_PART = 64
MAX_KEY = 200
_UNSAFE_PART = re.compile(rb"[^A-Za-z0-9_.@-]")
#: In literal text: what is not printable ASCII, and a ``%`` or ``#`` that does not
#: already begin an escape (``%XX``) or a digest (``#`` and 32 hex digits), so that a key
#: shown escaped (by ``status``) and given back is the same key.
_UNSAFE_KEY = re.compile(rb"[^\x21-\x7e]|%(?![0-9A-F]{2})|#(?![0-9a-f]{32})")
_BRACE = re.compile(r"[{}]")


def _percent(match: re.Match[bytes]) -> bytes:
    return b"%%%02X" % match.group()[0]


def escape_part(value: object) -> str:
    """Escape one value taken from a task's arguments for use inside a key."""
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogatepass")
    escaped = _UNSAFE_PART.sub(_percent, raw)
    if len(escaped) > MAX_PART:
        return "#" + hashlib.sha256(escaped).hexdigest()[:32]
    return escaped.decode("ascii")


def escape_literal(text: str) -> str:
    """Literal key text escaped, its braces kept (see :func:`_own_tag`)."""
    return _UNSAFE_KEY.sub(_percent, text.encode("utf-8", "surrogatepass")).decode("ascii")


def _tag_span(key: str) -> tuple[int, int] | None:
    """Where the key's own tag is, Redis's rule: the first ``{`` and the first ``}``
    after it, with something between (the braces' indexes); None if it has none."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return (start, end) if end > start + 1 else None


def _escape_braces(text: str) -> str:
    return text.replace("{", "%7B").replace("}", "%7D")


def _own_tag(key: str) -> str:
    """``key`` with every brace escaped but the pair that names its tag."""
    span = _tag_span(key)
    if span is None:
        return _escape_braces(key)
    start, end = span
    return (
        _own_tag(key[:start])
        + "{"
        + _own_tag(key[start + 1 : end])
        + "}"
        + _escape_braces(key[end + 1 :])
    )


def _bounded(key: str) -> str:
    if len(key) <= MAX_KEY:
        return key
    head = key.split(":", 1)[0][:MAX_PART]
    return f"{_BRACE.sub('_', head)}:#{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def _finished(key: str) -> str:
    """An escaped key's braces settled (:func:`_own_tag`) and its length bounded."""
    if "{" in key or "}" in key:
        key = _own_tag(key)
    return key if len(key) <= MAX_KEY else _bounded(key)


def escape_key(key: str) -> str:
    """Escape a key given by code (not by a task argument): keeps ``:`` as structure and
    a ``{tag}`` of its own, escapes other braces, ``%``, ``#``, spaces and control
    characters; bounds its length."""
    return _finished(escape_literal(key))


@functools.lru_cache(maxsize=1024)
def _pieces(template: str) -> tuple[tuple[str, str | None], ...]:
    """A template as (escaped literal text, field name or None) pairs, parsed once."""
    return tuple(
        (escape_literal(literal), name)
        for literal, name, _spec, _conv in string.Formatter().parse(template)
    )


def render(template: str, arguments: Mapping[str, object], args: tuple[object, ...]) -> str:
    """Format a key template from a call's bound arguments, escaping each value: the
    same key :func:`escape_key` gives for the rendered string.

    ``arguments`` maps parameter names to values; ``args`` are the positional
    arguments, for ``{0}``-style fields.

    Raises:
        InvalidLimit: the template names an argument this call does not have.
    """
    pieces: list[str] = []
    for literal, name in _pieces(template):
        pieces.append(literal)
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
    return _finished("".join(pieces))


def fixed_key(template: str) -> str:
    """The key of a template without fields, ``Limit(key="{{yt}}:quota")``, as a task
    renders it (``{yt}:quota``): a ``Limit``'s key is a template, a string given to
    ``Limiter`` or the CLI is the key itself."""
    return render(template, {}, ())


def hash_tag(key: str) -> str:
    """The Redis Cluster hash tag of an escaped key: its own ``{tag}`` if it names one,
    else its first and last segments (``yt:quota:K1`` -> ``yt:K1``; a key of one or two
    segments is its own tag)."""
    span = _tag_span(key)
    if span is not None:
        return key[span[0] + 1 : span[1]]
    first, _, rest = key.partition(":")
    last = rest.rpartition(":")[2]
    return f"{first}:{last}" if last else first
