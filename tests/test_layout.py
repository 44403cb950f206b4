"""The storage layout has one definition on the Python side (``_layout``): the scripts
must write what it reads, and every key name it builds must read back."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from celery_ratelimit import Concurrency, Limit, Limiter
from celery_ratelimit._engine.keys import escape_key, hash_tag, render
from celery_ratelimit._engine.layout import (
    COUNTER_FIELDS,
    EFF_FIELD,
    ENTRY_FLOOR,
    META_MEMBERS,
    PACE_FIELD,
    PACE_MEMBER,
    PAUSE_FIELD,
    RATE_FIELD,
    SEEN_FIELD,
    TOKEN_LEN,
    UP_FIELD,
    WINDOW_META,
    KeyName,
    keys_of,
    log_entries,
    log_total,
    parse_key,
    parse_override,
    redis_key,
)
from celery_ratelimit._engine.scripts import (
    ACQUIRE_FULL,
    COMPOSED,
    FEATURES,
    NAMES,
    PRELOADED,
    shape,
    source,
)
from celery_ratelimit._tools.cli import run_set
from celery_ratelimit._tools.ops import key_settings, key_status


def lua_constant(script: str, name: str) -> float:
    match = re.search(rf"^local {name} = (\S+)$", source(script), re.MULTILINE)
    assert match, f"{name} not found in lua/{script}.lua"
    return float(match.group(1))


def test_the_scripts_share_the_layouts_constants() -> None:
    full = ACQUIRE_FULL
    for name in ("acquire_one", "acquire", full):
        assert lua_constant(name, "ENTRY_FLOOR") == ENTRY_FLOOR
        assert lua_constant(name, "PRUNE_BATCH") == lua_constant(full, "PRUNE_BATCH")
        assert lua_constant(name, "TTL_MARGIN_MS") == lua_constant(full, "TTL_MARGIN_MS")
    assert lua_constant(full, "TOKEN_LEN") == TOKEN_LEN
    members = ", ".join(f"'{m}'" for m in META_MEMBERS)
    assert f"redis.call('ZMSCORE', spec.key, {members})" in source(full)
    assert f"call('ZMSCORE', key, {members})" in source("acquire")
    assert f"call('ZMSCORE', key, {members})" in source("acquire_one")
    fields = ", ".join(f"'{f}'" for f in COUNTER_FIELDS)
    assert f"redis.call('HMGET', spec.key, {fields})" in source("counter")
    assert f"return '{WINDOW_META}' .. string.format" in source("acquire_full+cal")
    for name in (full, "acquire_full+log+pace", "counter", "counter+pace"):  # no_pace.lua, pace.lua
        assert f"local PACE_MEMBER = '{PACE_MEMBER}'" in source(name)
        assert f"local PACE_FIELD = '{PACE_FIELD}'" in source(name)


#: What only the script of a call with each feature holds: the functions of its library.
FEATURE_CODE = {
    "log": ("local function log_prune", "local function log_free_at"),
    "pace": ("local function pace_take",),
    "cal": ("local calendar\n", "local function cal_"),
    "conc": ("local concurrency\n", "local function conc_"),
    "fair": ("local function fair_place",),
}


@pytest.mark.parametrize("name", [one for one in NAMES if one.split("+")[0] in COMPOSED])
def test_a_composed_script_holds_the_code_of_its_features_only(name: str) -> None:
    file, *features = name.split("+")
    text = source(name)
    assert "--- @include" not in text, name
    for feature in FEATURES:
        for code in FEATURE_CODE[feature]:
            if code == "local function log_free_at" and file in ("release", "settle"):
                continue  # they edit the log, never search it
            assert (code in text) == (feature in features), (name, code)
    # its header first: what it is, then its KEYS, ARGV and reply, before any code
    header = text[: text.index("\nlocal ")]
    assert header.startswith(f"-- {file}.lua — "), name
    assert all(line.startswith("--") or not line for line in header.splitlines()), name
    assert "KEYS" in header and "ARGV" in header and "eply" in header, name


def test_every_script_compiles_and_the_plain_ones_load_first(limiter: Limiter) -> None:
    client = limiter.client
    for name in NAMES:
        assert client.script_load(source(name)) == limiter._scripts[name].sha, name
    assert {"acquire_one", "acquire", "acquire_full+log"} <= set(PRELOADED)
    assert all(set(name.split("+")[1:]) <= {"log"} for name in PRELOADED)


#: The globals Redis gives a script: any other name a script reads is one it does not
#: define (a library a composition left out, a stand-in that forgot a name).
REDIS_GLOBALS = {"redis", "KEYS", "ARGV", "math", "string", "table", "tonumber", "ipairs"}
REDIS_GLOBALS |= {"tostring", "pairs", "unpack", "type", "error", "pcall", "next", "select"}


@pytest.mark.skipif(shutil.which("luac5.1") is None, reason="no luac5.1 (apt-get install lua5.1)")
@pytest.mark.parametrize("name", NAMES)
def test_a_script_reads_no_name_it_does_not_define(name: str, tmp_path: Path) -> None:
    script = tmp_path / "script.lua"
    script.write_text(source(name), encoding="utf-8")
    listing = subprocess.run(
        ["luac5.1", "-p", "-l", str(script)], capture_output=True, text=True, check=True
    ).stdout
    names = {
        line.rsplit(";", 1)[-1].strip()
        for line in listing.splitlines()
        if "GETGLOBAL" in line or "SETGLOBAL" in line
    }
    assert names <= REDIS_GLOBALS, (name, names - REDIS_GLOBALS)
    assert "SETGLOBAL" not in listing, name


def test_a_call_runs_the_script_of_what_it_declares() -> None:
    plain, fair = shape((Limit("10/s"),), 1), True
    assert plain.script("acquire") == "acquire_one"
    assert shape((Limit("10/s"),), 2).script("acquire") == "acquire_one"  # any one weight
    assert shape((Limit("10/s"), Limit("100/m")), 1).script("acquire") == "acquire"
    assert shape((Limit("10/s", burst=2),), 1).script("acquire") == "acquire_full+log+pace"
    day, two = Limit("10/d", align="UTC"), Concurrency(2)
    for limits, features in (
        ((Limit("10/s"),), "+log"),
        ((Limit("10/s"), day), "+log+cal"),
        ((day,), "+cal"),
        ((Limit("10/s"), two), "+log+conc"),
        ((two,), "+conc"),
        ((Limit("10/s"), day, two), "+log+cal+conc"),
        ((day, two), "+cal+conc"),
    ):
        call = shape(limits, 2)
        for operation in ("start", "release"):
            assert call.script(operation) == operation + features
        plainly = features == "+log"  # at any cost: entries of another weight go on to full
        assert call.script("acquire") == ("acquire_one" if plainly else "acquire_full" + features)
        assert call.script("settle") == "settle" + features.replace("+conc", "")
        others = [one for one in limits if isinstance(one, Concurrency) or one.align]
        counter = shape((Limit("10/s", algorithm="counter"), *others), 1)
        assert counter.script("counter") == "counter" + features.replace("+log", "")
        assert counter.script("release") == "release" + features.replace("+log", "")
    # a fair queue orders one sliding limit's calls, or one Concurrency's alone
    assert plain.script("acquire", fair) == "acquire_full+log+fair"
    paced = shape((Limit("10/s", burst=2),), 1)
    assert paced.script("acquire", fair) == "acquire_full+log+pace+fair"
    assert shape((two,), 1).script("acquire", fair) == "acquire_full+conc+fair"


def test_an_aligned_key_reads_back_with_its_windows(limiter: Limiter) -> None:
    day = Limit("100/d", align="UTC")
    (key,) = limiter.keys_for("layout", day)
    name = parse_key(limiter.prefix, key)
    assert name is not None and (name.algorithm, name.window_us) == ("cal", 86_400_000_000)
    for cost in (1, 3):
        assert limiter.acquire("layout", day, cost=cost).allowed
    now = int(limiter.client.time()[0]) * 1_000_000
    status = key_status(limiter.client, name, now)
    assert (status.used, status.reserved) == (4, 0)
    assert [weight for _, weight in log_entries(limiter.client, key)] == [1, 3]
    settings = f"redis.call('HMGET', key, '{PAUSE_FIELD}', '{RATE_FIELD}', '{UP_FIELD}')"
    assert settings in source(ACQUIRE_FULL)
    lean = f"call('HMGET', hash, '{PAUSE_FIELD}', '{RATE_FIELD}', '{UP_FIELD}')"
    assert lean in source("acquire")
    one = f"call('HMGET', KEYS[3], '{PAUSE_FIELD}', '{RATE_FIELD}', '{UP_FIELD}')"
    assert one in source("acquire_one")
    assert f"'{UP_FIELD}', 1)" in source("observe")
    assert f"return '{SEEN_FIELD}' .. limit, '{EFF_FIELD}' .. limit" in source(ACQUIRE_FULL)
    assert f"'{EFF_FIELD}' .. string.match" in source("observe")


@pytest.mark.parametrize(
    "key", ["api", "yt:quota:key1", "a%3Ab:c", "t:#0123abcd", "{yt}:quota", "x:{yt:K}:quota"]
)
@pytest.mark.parametrize("rate", ["10/s", "9500/d"])
@pytest.mark.parametrize("algorithm", ["log", "counter"])
def test_every_key_name_reads_back(key: str, rate: str, algorithm: str) -> None:
    limit = Limit(rate, algorithm=algorithm)
    name = parse_key("ratelimit", redis_key("ratelimit", key, limit))
    assert name is not None
    expected = (key, algorithm, limit.rate.window_us)
    assert (name.key, name.algorithm, name.window_us) == expected


def test_what_the_script_writes_is_what_the_layout_reads(limiter: Limiter) -> None:
    limit = Limit("10/s")
    (key,) = limiter.keys_for("layout", limit)
    for cost in (1, 3, 2):
        assert limiter.acquire("layout", limit, cost=cost).allowed
    written = log_entries(limiter.client, key)
    assert [weight for _, weight in written] == [1, 3, 2]
    assert all(instant >= ENTRY_FLOOR for instant, _ in written)
    assert log_total(limiter.client, key) == 6


def test_an_override_reads_back_until_it_lapses(limiter: Limiter) -> None:
    limiter.override("layout", "50/s", ttl=60)
    (settings,) = limiter.client.scan_iter(f"{limiter.prefix}:*:settings")
    value = limiter.client.hget(settings, RATE_FIELD)
    now = int(limiter.client.time()[0]) * 1_000_000
    limit, window_us, until = parse_override(value, now) or (0, 0, 0)
    assert (limit, window_us) == (50, 1_000_000)
    assert 0 < until - now <= 61_000_000
    assert parse_override(value, until) is None


def tag_of(name: str) -> str:
    return name.split("{", 1)[1].split("}", 1)[0]


@pytest.mark.parametrize(
    ("templates", "arguments", "tags"),
    [
        (["api:{tenant}"], {"tenant": "t1"}, ["api:t1"]),  # a slot per tenant
        (["yt:quota:{k}", "yt:search:{k}"], {"k": "K"}, ["yt:K", "yt:K"]),  # one call, one slot
        (["yt:quota", "yt:search"], {}, ["yt:quota", "yt:search"]),
        (["{{yt}}:quota", "{{yt}}:search"], {}, ["yt", "yt"]),  # a tag of the key's own
        (["{{yt:{k}}}:quota", "{{yt:{k}}}:search"], {"k": "K"}, ["yt:K", "yt:K"]),
        (["{tenant}:erp", "erp"], {"tenant": "t1"}, ["t1:erp", "erp"]),
        (["{tenant}:{region}:calls"], {"tenant": "t", "region": "eu"}, ["t:calls"]),
    ],
)
def test_a_keys_hash_tag_is_its_own_or_its_first_and_last_segments(
    templates: list[str], arguments: dict[str, str], tags: list[str]
) -> None:
    limit = Limit("10/s")
    for template, tag in zip(templates, tags, strict=True):
        rendered = render(template, arguments, ())
        name = redis_key("ratelimit", rendered, limit)
        assert tag_of(name) == tag
        # read back as written, and the same Redis key whichever call it is in
        assert parse_key("ratelimit", name) == KeyName(name, rendered, "log", 1_000_000)
        # the rendered key is the string a user would give, and names the same Redis key
        assert rendered == escape_key(template.format(**arguments))
        assert hash_tag(rendered) == tag


def test_a_templated_key_is_reset_overridden_and_shown_by_the_key_as_written(
    limiter: Limiter,
) -> None:
    rate = Limit("2/m")
    rendered = render("api:{tenant}", {"tenant": "t1"}, ())
    keys = limiter.keys_for([rendered], rate)
    assert keys == [f"{limiter.prefix}:{{api:t1}}:log:60000000"]
    assert limiter.acquire([rendered], rate).allowed
    assert keys_of(limiter.client, limiter.prefix, "api:t1") == keys
    # `celery ratelimit set api:t1 1/m` reaches the calls of the template
    run_set(None, limiter_url(limiter), limiter.prefix, "api:t1", "1/m", None)
    assert not limiter.acquire([rendered], rate).allowed
    assert [row.key for row in key_settings(limiter)] == ["api:t1"]
    assert limiter.reset("api:t1") == keys


def limiter_url(limiter: Limiter) -> str:
    kwargs = limiter.client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"


def test_a_script_is_composed_from_the_files_read_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose package is upgraded in place under it composes its later scripts
    from the files its Python was written for: composing reads no file."""
    import pathlib

    from celery_ratelimit._engine import scripts

    def refuse(*args: object, **kwargs: object) -> str:
        raise AssertionError("a Lua file was read after import")

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    scripts.source.cache_clear()
    try:
        assert all(scripts.source(name) for name in NAMES)
    finally:
        monkeypatch.undo()
        scripts.source.cache_clear()
