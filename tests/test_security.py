"""Security and bad input: key isolation, least privilege (ACL), TLS, malformed input.

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import functools
import itertools
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_ratelimit import (
    AsyncLimiter,
    Concurrency,
    InvalidLimit,
    InvalidRate,
    InvalidRedisURL,
    Limit,
    Limiter,
    LimiterMisconfigured,
    LimiterUnavailable,
    Rate,
    RateLimitedTask,
    install,
    ratelimit,
)
from celery_ratelimit._celery.settings import check_app_settings
from celery_ratelimit._engine import failures as _failures
from celery_ratelimit._engine.keys import MAX_KEY, escape_key, hash_tag, render
from celery_ratelimit._engine.layout import redis_key
from celery_ratelimit._engine.scripts import source
from tests.calls import ACQUIRE, CONFIRM, PEEK, RELEASE, RESERVE, RESTAMP, decide
from tests.fault_nodes import Fleet, deferred_ids, print_on_failure
from tests.nodes import unique_prefix
from tests.redis_server import RedisServer, tls_redis

LOG = Limit("3/200ms")

# -- 8. key isolation ------------------------------------------------------------------

values = st.one_of(
    st.text(max_size=40), st.binary(max_size=40), st.integers(), st.sampled_from(["", ":", "}"])
)


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(values, values), b=st.tuples(values, values))
def test_two_field_keys_of_distinct_tenants_never_collide_or_move_the_tag(
    a: tuple[object, object], b: tuple[object, object]
) -> None:
    template = "{tenant}:{region}:calls"
    Limit("10/s", key=template)  # accepted: the fields are separated by ':'
    ka = render(template, {"tenant": a[0], "region": a[1]}, ())
    kb = render(template, {"tenant": b[0], "region": b[1]}, ())

    def same(x: object, y: object) -> bool:
        as_bytes = [
            v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogatepass") for v in (x, y)
        ]
        return as_bytes[0] == as_bytes[1]

    assert (ka == kb) == (same(a[0], b[0]) and same(a[1], b[1]))
    full = redis_key("ratelimit", ka, LOG)
    assert full.count("{") == full.count("}") == 1
    assert ka.count(":") == 2
    # the tag: the first and last segments, the tenant and "calls" (one slot per tenant)
    tag = full.split("{", 1)[1].split("}", 1)[0]
    assert tag == hash_tag(ka) == f"{ka.split(':')[0]}:calls"


@pytest.mark.parametrize("template", ["{a}{b}", "t:{a}-{b}", "{a}_{b}", "{a} {b}", "{a}%{b}"])
def test_templates_whose_fields_could_run_together_are_refused(template: str) -> None:
    # "{a}-{b}" would give ("x-y", "z") and ("x", "y-z") the same key
    with pytest.raises(InvalidLimit, match="must be separated"):
        Limit("10/s", key=template)


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=3000))
def test_any_code_given_key_gives_one_hash_tag_and_a_bounded_printable_key(key: str) -> None:
    limiter = Limiter(redis.Redis(), prefix="p")  # keys_for never talks to Redis
    if not key:
        with pytest.raises(InvalidLimit):
            limiter.keys_for(key, LOG)
        return
    [full] = limiter.keys_for(key, LOG)
    escaped = escape_key(key)
    # the name's first brace pair is the tag, the key's own if it names one (at most one
    # pair is left in a key: its own tag), and the key follows it as escaped
    tag = hash_tag(escaped)
    assert full == (f"p:{{{tag}}}" + (f":{escaped}" if tag != escaped else "") + ":log:200000")
    assert escaped.count("{") == escaped.count("}") <= 1
    assert len(escaped) <= MAX_KEY
    assert len(full) <= len("p:{}:") + 2 * MAX_KEY + len(":log:") + 12
    assert all(0x21 <= ord(c) <= 0x7E for c in full)


# -- 9. least privilege -----------------------------------------------------------------

#: Commands the worker side needs (the list the limiter's NOPERM message gives): EVALSHA
#: and SCRIPT LOAD (the first call loads both scripts; redis-py's Script reloads on
#: NOSCRIPT), TIME and PING (clock offset, _clock), DEL (Limiter.reset), and every
#: command the scripts call (checked against the user's ACL too).
ACL_COMMANDS = _failures.ACL_COMMANDS


def acl_line(commands: tuple[str, ...] = ACL_COMMANDS) -> str:
    return (
        "ACL SETUSER ratelimit on >{password} resetkeys ~ratelimit:* resetchannels -@all "
        + " ".join(f"+{c}" for c in commands)
    )


ACL_LINE = acl_line()


@pytest.mark.parametrize("page", ["README.md", "docs/operations.md"])
def test_the_acl_line_the_docs_give_is_the_one_the_tests_run_under(page: str) -> None:
    """The least-privilege line a user pastes from the docs is the one every test of
    this section grants (its commands, and the ones a NOPERM error names)."""
    text = (Path(__file__).resolve().parents[1] / page).read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if "ACL SETUSER ratelimit on" in line]
    assert lines == [ACL_LINE.format(password="PASSWORD")]


_round = itertools.count()


def exercise(limiter: Limiter, admin: redis.Redis) -> None:
    """Every operation a worker makes: grant, deny, reserve, confirm early and on time,
    release, peek, reset, the counter algorithm, a script reload."""
    admin.script_flush()
    n = next(_round)
    limit = Limit("2/600ms", key=f"acl:a{n}")
    keys = limiter.keys_for(f"acl:a{n}", limit)
    assert limiter.acquire(f"acl:a{n}", limit).allowed
    assert limiter.acquire(f"acl:a{n}", limit).allowed
    assert not limiter.acquire(f"acl:a{n}", limit).allowed
    reserved = decide(limiter, keys, (limit,), 1, RESERVE)
    assert reserved.reserved and reserved.token
    early = decide(limiter, keys, (limit,), 1, CONFIRM, token=reserved.token)
    assert early.reserved
    time.sleep(reserved.retry_after + 0.01)
    assert decide(limiter, keys, (limit,), 1, CONFIRM, token=reserved.token).allowed
    decide(limiter, keys, (limit,), 1, ACQUIRE)
    other = decide(limiter, keys, (limit,), 1, RESERVE)
    assert other.reserved
    decide(limiter, keys, (limit,), 1, RELEASE, token=other.token)  # removes the newest
    decide(limiter, keys, (limit,), 1, RESERVE)  # which is then looked up again
    decide(limiter, keys, (limit,), 1, PEEK)
    decide(limiter, keys, (limit,), 1, ACQUIRE)
    # mixed weights: a denial walks the entries
    mixed = Limit("3/600ms", key=f"acl:m{n}")
    assert [limiter.acquire(f"acl:m{n}", mixed, cost=c).allowed for c in (1, 2, 1)] == [
        True,
        True,
        False,
    ]
    # a start moved into the window before a slot pushes that slot later (by rank)
    one = Limit("1/600ms", key=f"acl:s{n}")
    ones = limiter.keys_for(f"acl:s{n}", one)
    granted = decide(limiter, ones, (one,), 1, RESERVE)
    slot = decide(limiter, ones, (one,), 1, RESERVE)
    assert granted.allowed and slot.reserved
    time.sleep(max(slot.retry_after - 0.2, 0))
    assert decide(limiter, ones, (one,), 1, RESTAMP, token=granted.token).allowed
    time.sleep(0.22)
    assert decide(limiter, ones, (one,), 1, CONFIRM, token=slot.token).reserved
    counter = Limit("2/600ms", key=f"acl:c{n}", algorithm="counter")
    got = [limiter.acquire(f"acl:c{n}", counter) for _ in range(3)]
    assert [d.allowed for d in got] == [True, True, False], got
    # concurrency slots: held, denied, a turn in line, renewed, released; a pause
    slots = [Limit("5/600ms", key=f"acl:k{n}"), Concurrency(1, key=f"acl:k{n}", lease=0.4)]
    held = limiter.acquire(f"acl:k{n}", slots)
    assert held.allowed and held.token
    waiter = limiter.acquire(f"acl:k{n}", slots, reserve=True)
    assert waiter.reserved and waiter.token
    assert limiter.renew(held.token, f"acl:k{n}", slots)
    limiter.release(held.token, f"acl:k{n}", slots)
    time.sleep(waiter.retry_after + 0.01)  # its turn
    assert limiter.confirm(waiter.token, f"acl:k{n}", slots).allowed
    time.sleep(0.5)  # its lease runs out
    assert limiter.acquire(f"acl:k{n}", [Concurrency(1, key=f"acl:k{n}")]).allowed
    # a turn handed over: to a waiter blocked for it, then to one that confirms
    alone = [Concurrency(1, key=f"acl:h{n}")]
    running = limiter.acquire(f"acl:h{n}", alone)
    first, second = (limiter.acquire(f"acl:h{n}", alone, reserve=True) for _ in range(2))
    assert running.token and first.token and second.token
    limiter.release(running.token, f"acl:h{n}", alone)
    assert limiter.handed(first.token, f"acl:h{n}", alone, 0.5) is not None
    limiter.release(first.token, f"acl:h{n}", alone)
    assert limiter.confirm(second.token, f"acl:h{n}", alone).allowed
    limiter.pause(f"acl:k{n}", 0.4)
    assert limiter.acquire(f"acl:k{n}", slots).paused
    # overrides: for good, then for a while, then removed (the pause keeps the hash)
    limiter.override(f"acl:k{n}", "1/s")
    limiter.override(f"acl:k{n}", "2/s", ttl=1)
    limiter.override(f"acl:k{n}", None)
    limiter.override(f"acl:o{n}", "1/s", ttl=1)
    limiter.override(f"acl:o{n}", None)
    # a calendar-aligned hour beside a sliding limit: grants, a reservation into the
    # next window, a release; settling costs on the log, the counter and the calendar
    aligned = [Limit("5/s", key=f"acl:d{n}"), Limit("2/h", key=f"acl:d{n}", align="UTC")]
    first = limiter.acquire(f"acl:d{n}", aligned)
    assert limiter.acquire(f"acl:d{n}", aligned).allowed and first.token
    ahead = limiter.acquire(f"acl:d{n}", aligned, reserve=True, horizon=7200)
    assert ahead.reserved and ahead.token
    limiter.release(ahead.token, f"acl:d{n}", aligned)
    assert limiter.settle(first.token, f"acl:d{n}", aligned, 2).allowed
    minute = Limit("2/h", key=f"acl:e{n}", algorithm="counter")
    counted = limiter.acquire(f"acl:e{n}", minute)
    assert limiter.settle(counted.token, f"acl:e{n}", minute, 2).allowed  # type: ignore[arg-type]
    alone = Limit("3/h", key=f"acl:h{n}", align="Europe/Berlin")
    assert limiter.acquire(f"acl:h{n}", alone).allowed
    limiter.reset(f"acl:a{n}", limit)
    limiter.client.time()
    limiter.client.ping()
    # the park: a deferred copy parked, claimed by a mover, dropped once published
    park = limiter.client.register_script(source("park"))
    base = f"{limiter.prefix}:{{park:acl{n}}}"
    parked = [f"{base}:due", f"{base}:copies", f"{base}:counts", f"{base}:claims"]
    claim = ["claim", 1_000_000, 30_000_000, 10, "mover"]
    try:
        park(keys=parked, args=[*claim, "0"])  # a mover is seen
        assert park(keys=parked, args=["park", "copy", 0, b"payload", 5_000_000]) > 0
        claimed = park(keys=parked, args=[*claim, "0"])
        assert claimed[2:] == [b"copy", claimed[3]] and claimed[3].endswith(b"|payload")
        # its reply lost: the mover takes back what its claims hold
        assert park(keys=parked, args=[*claim, "1"])[2:] == claimed[2:]
        assert park(keys=parked, args=["drop", "copy"]) == 1
    except redis.RedisError as exc:  # as _park raises it
        raise limiter.translate(exc, "parking") from exc


def error_without(command: str) -> Exception | None:
    """What the first operation to fail raised for the ACL user lacking ``command``, on
    a server of its own (each round flushes the scripts); None if none failed."""
    line = acl_line(tuple(c for c in ACL_COMMANDS if c != command)).format(password="s3cret")
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command(*line.split())
        limiter = Limiter.from_url(f"redis://ratelimit:s3cret@127.0.0.1:{server.port}/0")
        try:
            exercise(limiter, admin)
        except (LimiterMisconfigured, redis.exceptions.NoPermissionError) as exc:
            return exc
        finally:
            limiter.client.close()
            admin.close()
        return None


@functools.cache
def errors_without_each() -> dict[str, Exception | None]:
    """:func:`error_without` of each listed command (a few rounds at a time: they mostly
    sleep through their windows), once for the tests that read them."""
    with ThreadPoolExecutor(max_workers=6) as pool:
        return dict(zip(ACL_COMMANDS, pool.map(error_without, ACL_COMMANDS), strict=True))


def script_commands() -> set[str]:
    """Every command the Lua scripts call (``redis.call('X'``, ``redis.pcall("X"``)."""
    lua = Path(__file__).resolve().parent.parent / "lua"
    calls = re.compile(r"redis\.p?call\(\s*['\"]([A-Za-z|]+)['\"]")
    return {name.lower() for path in lua.rglob("*.lua") for name in calls.findall(path.read_text())}


def test_the_suggested_acl_line_names_every_command_the_scripts_run() -> None:
    commands = script_commands()
    assert {"zadd", "time", "hmget"} <= commands  # the grep finds them
    line = _failures.acl_setuser("u", "ratelimit").split()
    assert sorted(c for c in commands if f"+{c}" not in line) == []


def test_a_user_without_any_one_script_command_is_given_the_whole_acl_line() -> None:
    """The scripts' commands are checked against the ACL when they run, and a refusal
    there reads differently from a NOPERM reply (Redis 6.2/7.0: "The user executing the
    script can't run this command"): it is a missing permission all the same, told with
    the whole ACL SETUSER line, not a script failure to report."""
    errors = errors_without_each()
    full = _failures.acl_setuser("ratelimit", "ratelimit")
    for command in sorted(script_commands()):
        error = errors[command]
        assert isinstance(error, LimiterMisconfigured), (command, error)
        assert "lacks a permission" in str(error) and full in str(error), (command, error)
        assert "please report" not in str(error), (command, error)


def test_an_acl_user_with_only_its_prefix_and_the_listed_commands_suffices(
    redis_server: RedisServer,
) -> None:
    admin = redis_server.client()
    admin.execute_command(*ACL_LINE.format(password="s3cret").split())
    admin.set("other:secret", "x")
    url = f"redis://ratelimit:s3cret@127.0.0.1:{redis_server.port}/0"
    limiter = Limiter.from_url(url)
    try:
        exercise(limiter, admin)
        user = limiter.client
        # nothing outside its prefix, no other command
        for command in (("GET", "other:secret"), ("SET", "other:x", "1"), ("KEYS", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                user.execute_command(*command)
        # not even through a script: the scripts' commands are checked against the ACL
        with pytest.raises(LimiterMisconfigured, match=r"(?i)permission.*ACL SETUSER"):
            Limiter(user, prefix="other").acquire("x", "10/s")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.eval("return redis.call('GET', KEYS[1])", 1, "ratelimit:x")
        assert admin.get("other:secret") == b"x"
        # and each listed command is needed by some operation
        unneeded = [c for c, error in errors_without_each().items() if error is None]
        print(f"\n[ACL] {ACL_LINE}\ncommands no operation needed: {unneeded}")
        assert unneeded == [], unneeded
    finally:
        admin.execute_command("ACL", "DELUSER", "ratelimit")
        admin.delete("other:secret")
        admin.close()
        limiter.client.close()


# -- 10. TLS ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A redis-server on TLS only, its certificate signed by a CA made here."""
    with tls_redis(tmp_path_factory.mktemp("tls")) as served:
        yield served


def test_rediss_verifies_the_certificate_by_default(tls_server: tuple[int, Path]) -> None:
    port, ca = tls_server
    unverified = Limiter.from_url(f"rediss://127.0.0.1:{port}/0")
    with pytest.raises(LimiterMisconfigured, match=r"(?i)certificate verify failed.*ssl_ca_certs"):
        unverified.acquire("tls", "5/s")
    plain = Limiter.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5)
    with pytest.raises(LimiterUnavailable):
        plain.acquire("tls", "5/s")
    limiter = Limiter.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}")
    assert [limiter.acquire("tls", "2/s").allowed for _ in range(3)] == [True, True, False]
    # a name that is not in the certificate is refused too
    wrong_host = Limiter.from_url(f"rediss://localhost.localdomain:{port}/0?ssl_ca_certs={ca}")
    with pytest.raises((LimiterMisconfigured, LimiterUnavailable)):  # or unresolvable here
        wrong_host.acquire("tls", "2/s")
    for lim in (unverified, plain, limiter, wrong_host):
        lim.client.close()


# -- 11. bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("declare", "error", "names"),
    [
        (lambda: ratelimit("ten/s"), InvalidRate, "'ten/s'"),
        (lambda: ratelimit("10/s", key="api:{"), InvalidLimit, "'api:{'"),
        (lambda: ratelimit("10/s", cost=0), InvalidLimit, "0"),
        (lambda: ratelimit("10/s", cost=11), InvalidLimit, "11"),
        (lambda: ratelimit("10/s", cost="1"), TypeError, "'1'"),
        (lambda: ratelimit([]), InvalidLimit, "empty"),
        (lambda: ratelimit([Limit("1/s"), "5"]), InvalidRate, "'5'"),
        (lambda: ratelimit("10/s", max_deferrals=-1), InvalidLimit, "-1"),
        (lambda: ratelimit("10/s", on_redis_error="ignore"), InvalidLimit, "'ignore'"),
        (lambda: Limiter(redis.Redis(), prefix="x{y}"), InvalidLimit, "'x{y}'"),
        (lambda: Limiter.from_url("http://x"), InvalidRedisURL, "'http'"),
        (lambda: Limiter.from_url("redis+sentinel://h:1"), InvalidRedisURL, "master name"),
        (lambda: Limiter.from_url("redis+cluster://h:port"), InvalidRedisURL, "'h:port'"),
    ],
)
def test_bad_declarations_fail_at_import_time_naming_the_value(
    declare: object, error: type[Exception], names: str
) -> None:
    with pytest.raises(error) as info:
        declare()  # type: ignore[operator]
    assert names in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ratelimit_on_redis_error", "ignore"),
        ("ratelimit_max_countdown", 0),
        ("ratelimit_max_countdown", "600"),
        ("ratelimit_max_deferrals", 1.5),
        ("ratelimit_reserve", "yes"),
        ("ratelimit_guard", -1),
        ("ratelimit_key_prefix", ""),
        ("ratelimit_rules", ["10/s"]),
        ("ratelimit_redis_url", 6379),
        ("ratelimit_redis_url", "http://x"),
        ("ratelimit_redis_url", "redis://127.0.0.1:notaport/0"),
        ("ratelimit_redis_url", "redis://127.0.0.1:6379/zero"),
        ("ratelimit_max_countdown", float("inf")),
        ("ratelimit_guard", float("nan")),
        ("ratelimit_warning_intervall", 60),
    ],
)
def test_bad_settings_fail_at_install_naming_the_setting(name: str, value: object) -> None:
    app = Celery("bad", set_as_current=False)
    app.conf[name] = value
    error = InvalidRedisURL if name == "ratelimit_redis_url" else InvalidLimit
    with pytest.raises(error) as info:
        install(app)
    assert name in str(info.value)
    with pytest.raises(error):
        check_app_settings(app)


@pytest.mark.parametrize(
    "url", ["notaurl", "http://x", "redis://h:port/0", "redis://h/zero", "redis+cluster://h:port"]
)
def test_a_bad_redis_url_is_an_invalid_redis_url_wherever_it_is_given(url: str) -> None:
    """Not an ``InvalidLimit`` (a URL is no limit): the limiter is misconfigured, and
    ``except ValueError`` still catches it."""
    app = Celery("bad", set_as_current=False)
    app.conf.ratelimit_redis_url = url
    for give in (
        lambda: Limiter.from_url(url),
        lambda: AsyncLimiter.from_url(url),
        lambda: check_app_settings(app),
    ):
        with pytest.raises(InvalidRedisURL) as info:
            give()
        error = info.value
        assert isinstance(error, LimiterMisconfigured) and isinstance(error, ValueError)
        assert not isinstance(error, InvalidLimit)
        assert url.partition("://")[0] in str(error)  # it names the URL, or its scheme


def test_bad_rules_and_a_bad_base_class_rate_fail_when_declared() -> None:
    app = Celery("bad", set_as_current=False)
    app.conf.ratelimit_rules = {"proj.*": "10 per second"}
    with pytest.raises(InvalidRate, match="'10 per second'"):
        install(app)
    with pytest.raises(InvalidRate, match="'fast'"):

        @app.task(base=RateLimitedTask, ratelimit="fast", shared=False)
        def t() -> None: ...

        _ = t.ratelimit  # Celery builds the task class lazily


@settings(max_examples=500, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=30),
        st.from_regex(
            r"\s*-?\d{0,14}\s*/\s*\d{0,4}(\.\d{0,8})?\s*[a-zA-Z]{0,8}\s*", fullmatch=True
        ),
    )
)
def test_the_rate_parser_raises_only_invalid_rate(text: str) -> None:
    try:
        rate = Rate.parse(text)
    except InvalidRate as exc:
        assert repr(text) in str(exc) or "rate" in str(exc)
        return
    assert rate.limit >= 1 and rate.window_us >= 1000
    assert Rate.parse(str(rate)) == rate


@settings(max_examples=400, deadline=None)
@given(template=st.text(max_size=40), value=st.one_of(st.text(max_size=20), st.binary(max_size=20)))
def test_the_key_builder_raises_only_documented_errors(template: str, value: object) -> None:
    try:
        limit = Limit("10/s", key=template)
    except InvalidLimit:
        return
    arguments = dict.fromkeys(limit.fields, value)
    try:
        key = render(template, arguments, (value,) * 3)
    except InvalidLimit as exc:  # a position beyond the call's arguments
        assert "positional" in str(exc)
        return
    full = redis_key("p", key, limit)
    assert full.count("{") == full.count("}") == 1
    assert len(key) <= MAX_KEY


@pytest.mark.celery
@pytest.mark.timeout(240)
def test_errors_only_a_call_can_reveal_fail_the_task_without_deferring_it(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    broker, limiter = RedisServer(), RedisServer()
    fleet = Fleet(
        tmp_path,
        broker_url=f"redis://127.0.0.1:{broker.port}/1",
        limiter_url=limiter.url,
        runs_url=f"redis://127.0.0.1:{broker.port}/3",
        prefix=unique_prefix("bad-calls"),
    )
    try:
        fleet.add(1)
        cases = {
            fleet.send("zero_cost", 1): "must be a positive int, got 0",
            fleet.send("bad_key_function", 1): "returned None",
            fleet.send("too_few_arguments", "only-one"): "needs positional argument 1",
        }
        # a token the limiter never wrote is no token: that task competes afresh and runs
        forged = fleet.send("limited", 1, headers={"ratelimit_token": "zz"})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            failed = fleet.grep("raised unexpected")
            if all(any(i in line for line in failed) for i in cases):
                break
            time.sleep(0.2)
        assert [r["id"] for r in fleet.wait_for_runs([forged], 10)] == [forged]
        assert any(
            "WARNING" in line and "not a reservation token: 'zz'" in line
            for line in fleet.grep(forged)
        )
        failed = fleet.grep("raised unexpected")
        for task_id, message in cases.items():
            lines = [line for line in failed if task_id in line]
            assert lines and message in lines[0], (task_id, message, lines)
        assert not deferred_ids(fleet.grep("ratelimit: deferred ")) & set(cases)
        assert [r["id"] for r in fleet.runs()] == [forged]
        print(
            "\n[bad calls] "
            + "; ".join(line.split("raised unexpected: ")[1][:110] for line in failed)
        )
    finally:
        print_on_failure(request, fleet)
        fleet.stop()
        broker.close()
        limiter.close()
