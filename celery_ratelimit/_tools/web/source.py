"""What the operator's page shows, read the way ``status`` reads it (``ops.read_rows``,
``keysettings.settings_for``, ``KeyStatus.as_json``), a page of keys at a time.

A page is what a few ``SCAN`` calls from a cursor find under the prefix (never
``KEYS``, never the whole prefix): the keys they find, grouped by key family, the
cursor to go on from, and how many names were looked at. Names under the prefix that
are not the limiter's are passed over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._engine.exceptions import RateLimitError
from ..._engine.layout import KeyName, parse_key, prefix_glob, settings_logical_key
from ..._engine.limiter import REDIS_ERRORS, Limiter
from ..cli import limiter_from, safe_url, url_named
from ..keysettings import KeySettings, settings_for, text
from ..ops import KeyStatus, KnownLimit, guard_for_app, known_limits, read_rows, server_now_us
from .chart import GrantHistory

log = logging.getLogger("celery_ratelimit.web")

#: Keys on a page (about: a SCAN call's names are kept whole).
PAGE_SIZE = 50
#: Names one page request may look at before it answers with what it found.
SCAN_BUDGET = 50_000
_GLOB = "*?["


def search_glob(search: str | None) -> str | None:
    """The glob over keys a search means: a glob as given, other text anywhere in the key."""
    if not search:
        return None
    return search if any(c in search for c in _GLOB) else f"*{search}*"


def scan_pattern(prefix: str, glob: str | None) -> str:
    """The ``SCAN MATCH`` of a page: every name under ``prefix`` that can hold a key the
    glob matches (a key is whole inside each of its Redis names)."""
    under = prefix_glob(prefix)
    return under if glob is None else f"{under}{glob.strip('*')}*"


@dataclass
class Found:
    """What a page's scan found: limits' names and keys with a settings hash."""

    names: list[KeyName] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    cursor: int = 0
    scanned: int = 0


def scan_page(client: Any, prefix: str, glob: str | None, cursor: int, size: int) -> Found:
    """Scan from ``cursor`` until ``size`` keys are found, the scan ends, or
    :data:`SCAN_BUDGET` names were looked at."""
    from fnmatch import fnmatchcase

    found, seen = Found(cursor=cursor), set()
    count = max(size * 3, 100)
    pattern = scan_pattern(prefix, glob)
    while True:
        found.cursor, batch = client.scan(found.cursor, match=pattern, count=count)
        found.scanned += count
        for raw in batch:
            name = text(raw)
            limit = parse_key(prefix, name)
            key = limit.key if limit is not None else settings_logical_key(prefix, name)
            if key is None or name in seen or (glob and not fnmatchcase(key, glob)):
                continue  # not one of ours (or already found), or not asked for
            seen.add(name)
            found.keys.add(key)
            if limit is not None:
                found.names.append(limit)
        if not found.cursor or len(found.keys) >= size or found.scanned >= SCAN_BUDGET:
            return found
        count = min(count * 2, 5_000)


def family(row: KeyStatus) -> str:
    """The key family of a row: the template of the limit it matches (``api:{tenant}``),
    else its key with the last segment as ``*`` (``api:*``)."""
    limit = row.limit
    if limit is not None:
        return limit.key if isinstance(limit.key, str) else row.name.key
    return guessed_family(row.name.key)  # not declared: no template to match


def guessed_family(key: str, known: Sequence[KnownLimit] = ()) -> str:
    """The family of a key without a row (only settings): the template of a declared
    limit whose keys it could be, else the key with its last segment as ``*``."""
    for limit in known:
        if isinstance(limit.limit.key, str) and limit.pattern.fullmatch(key):
            return limit.limit.key
    head, sep, _ = key.rpartition(":")
    return f"{head}:*" if sep else key


def grouped(
    rows: Iterable[KeyStatus],
    settings: dict[str, KeySettings],
    known: Sequence[KnownLimit] = (),
) -> list[dict[str, Any]]:
    """Rows and settings by family, then by key: ``[{"family", "keys": [{"key",
    "limits": [KeyStatus.as_json()...], "settings": KeySettings.as_json() | None}]}]``."""
    keys: dict[str, dict[str, Any]] = {}
    families: dict[str, str] = {}
    for row in rows:
        entry = keys.setdefault(row.name.key, {"key": row.name.key, "limits": []})
        entry["limits"].append(row.as_json())
        families.setdefault(row.name.key, family(row))
    for key, row_settings in settings.items():
        keys.setdefault(key, {"key": key, "limits": []})["settings"] = row_settings.as_json()
    by_family: dict[str, list[dict[str, Any]]] = {}
    for key in sorted(keys):
        keys[key].setdefault("settings", None)
        family_name = families.get(key) or guessed_family(key, known)
        by_family.setdefault(family_name, []).append(keys[key])
    return [{"family": name, "keys": by_family[name]} for name in sorted(by_family)]


class Source:
    """The limiter's Redis as the page reads it: the app's (``-A``) or ``url``'s, under
    the app's prefix or ``prefix``. Failures become one line (``error``), logged when
    it changes; the next read tries again."""

    def __init__(self, app: Any, url: str | None, prefix: str | None) -> None:
        self.app, self.url, self.prefix = app, url, prefix
        self.history = GrantHistory()
        self.known: list[KnownLimit] = known_limits(app) if app is not None else []
        self.guard = guard_for_app(app) if app is not None else 0.0
        self._limiter: Limiter | None = None
        self._last_error: str | None = None

    def limiter(self) -> Limiter:
        if self._limiter is None:
            self._limiter = limiter_from(self.app, self.url, self.prefix)
        return self._limiter

    def where(self) -> str:
        """``prefix 'p' on redis://host:port/db`` (no password), or what stops it."""
        try:
            limiter = self.limiter()
        except (RateLimitError, SystemExit) as exc:
            return f"error: {exc}"
        return f"prefix {limiter.prefix!r} on {safe_url(limiter)}"

    def page(self, search: str | None, cursor: int, size: int = PAGE_SIZE) -> dict[str, Any]:
        """One page as the page's script draws it (``error`` set instead when Redis or
        its URL failed)."""
        try:
            document = self._read(search_glob(search), cursor, size)
        except (RateLimitError, SystemExit) as exc:
            error = f"error: {exc}"
            if error != self._last_error:
                log.error("%s", error)
            self._last_error = error
            return {"where": self.where(), "error": error}
        if self._last_error is not None:
            log.warning("the limiter's Redis answers again")
            self._last_error = None
        return {"where": self.where(), "error": None, **document}

    def _read(self, glob: str | None, cursor: int, size: int) -> dict[str, Any]:
        limiter = self.limiter()
        client = limiter.client
        with url_named(self.app, self.url):
            try:
                now = server_now_us(client)
                found = scan_page(client, limiter.prefix, glob, cursor, size)
                settings = settings_for(limiter, found.keys, now)
                overrides = {key: row.override for key, row in settings.items() if row.override}
                rows = read_rows(limiter, found.names, self.known, now, overrides, guard=self.guard)
                grants = self.history.grants(client, found.names, now)
            except REDIS_ERRORS as exc:
                raise limiter.translate(exc, "a page read") from exc
        return {
            "now_s": now / 1_000_000,
            "cursor": cursor,
            "next": found.cursor or None,
            "scanned": found.scanned,
            "families": grouped(rows, settings, self.known),
            "grants": grants,
        }


__all__ = ["PAGE_SIZE", "Source", "family", "scan_page", "search_glob"]
