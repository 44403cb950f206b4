"""Option plumbing, without a worker: settings resolution, validation, rules matching.

These tests only look at how options reach a task (Celery apps, task classes and a
request ``Context``; one follows a message's options into the script, on the suite's
redis-server); whether the limit holds is proven against real worker nodes in
``test_celery_nodes.py``.
"""

from __future__ import annotations

import ast
import re
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, shared_task
from celery.app.task import Context

import celery_ratelimit
from celery_ratelimit import (
    InvalidLimit,
    InvalidRate,
    Limit,
    Limiter,
    Rate,
    RateLimitedTask,
    install,
    ratelimit,
)
from celery_ratelimit._celery import compat as _compat
from celery_ratelimit._celery.install import Rules, rule_warnings
from celery_ratelimit._celery.plan import plan_for
from celery_ratelimit._celery.settings import DEFAULTS, TASK_OPTIONS, redis_url, setting
from celery_ratelimit._celery.task import DECISION_ATTR, enforce
from celery_ratelimit._engine.decision import Decision


@pytest.fixture
def app() -> Celery:
    app = Celery("plumbing", broker="memory://", set_as_current=False)
    app.conf.ratelimit_redis_url = "redis://127.0.0.1:1/0"  # nothing listens: no Redis used
    return app


# (setting, app.conf value, task option value, call option value)
LAYERS = [
    ("ratelimit_max_deferrals", 5, 3, 1),
    ("ratelimit_max_countdown", 30.0, 10.0, 2.5),
    ("ratelimit_reserve", False, True, False),
    ("ratelimit_on_redis_error", "allow", "raise", "defer"),
]


@pytest.mark.parametrize(("name", "conf", "own", "call"), LAYERS)
def test_each_setting_resolves_call_then_task_then_app_conf_then_default(
    app: Celery, name: str, conf: Any, own: Any, call: Any
) -> None:
    @app.task(base=RateLimitedTask, ratelimit="5/s", shared=False)
    def plain() -> None: ...

    @app.task(base=RateLimitedTask, ratelimit="5/s", shared=False, **{name: own})
    def with_option() -> None: ...

    @ratelimit("5/s", **{name.removeprefix("ratelimit_"): own})
    @app.task(shared=False)
    def decorated() -> None: ...

    app.finalize()
    assert setting(name, app, plain, Context()) == DEFAULTS[name]
    app.conf[name] = conf
    assert setting(name, app, plain, Context()) == conf
    for task in (with_option, decorated):
        assert setting(name, app, task, Context()) == own
        assert setting(name, app, task, Context({name: call})) == call


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("ratelimit_max_countdown", -1),
        ("ratelimit_max_countdown", 0),
        ("ratelimit_max_countdown", "10"),
        ("ratelimit_max_deferrals", -1),
        ("ratelimit_max_deferrals", 1.5),
        ("ratelimit_max_deferrals", True),
        ("ratelimit_on_redis_error", "ignore"),
        ("ratelimit_reserve", "yes"),
        ("ratelimit_key_prefix", ""),
        ("ratelimit_rules", ["tasks.*"]),
    ],
)
def test_a_bad_setting_is_rejected_naming_the_setting_and_the_value(
    app: Celery, name: str, bad: Any
) -> None:
    app.conf[name] = bad
    with pytest.raises(InvalidLimit) as info:
        install(app)
    assert name in str(info.value)
    assert repr(bad) in str(info.value)
    # the same value given as a call option (a header) is rejected the same way
    del app.conf[name]
    with pytest.raises(InvalidLimit, match=name):
        setting(name, app, None, Context({name: bad}))


def test_an_unknown_ratelimit_setting_is_rejected_by_name(app: Celery) -> None:
    app.conf.ratelimit_max_deferal = 3
    with pytest.raises(InvalidLimit, match="ratelimit_max_deferal"):
        install(app)


def test_the_decorator_validates_when_the_module_is_imported(app: Celery) -> None:
    with pytest.raises(InvalidRate, match="10/x"):
        ratelimit("10/x")
    with pytest.raises(InvalidLimit, match="-2"):
        ratelimit("10/s", max_deferrals=-2)
    with pytest.raises(TypeError, match="max_deferal"):
        ratelimit("10/s", max_deferal=2)
    with pytest.raises(TypeError, match="key"):
        ratelimit(Limit("10/s"), key="x")
    with pytest.raises(InvalidLimit, match="cost 20"):
        ratelimit("10/s", cost=20)

    def not_a_task() -> None: ...

    with pytest.raises(TypeError, match=r"above @app\.task"):
        ratelimit("10/s")(not_a_task)


def test_a_bad_app_setting_fails_when_a_base_class_task_is_bound_without_install(
    app: Celery,
) -> None:
    app.conf.ratelimit_max_deferrals = -1

    @app.task(base=RateLimitedTask, ratelimit="5/s", name="opts.bound", shared=False)
    def job() -> None: ...

    with pytest.raises(InvalidLimit, match=r"ratelimit_max_deferrals.*-1"):
        app.finalize()  # binds every task: what a worker's start and a first .delay() do


def test_the_decorator_takes_every_task_option_and_the_task_resolves_it(app: Celery) -> None:
    given = {
        "max_countdown": 30,
        "max_deferrals": 2,
        "reserve": False,
        "guard": 0.01,
        "on_redis_error": "allow",
        "redis_error_countdown": 3,
        "concurrency_lease": 60,
    }
    assert {f"ratelimit_{name}" for name in given} == set(TASK_OPTIONS)

    @ratelimit("10/s", **given)
    @app.task(name="opts.decorated", shared=False)
    def job() -> None: ...

    app.finalize()
    for name, value in given.items():
        assert setting(f"ratelimit_{name}", app, job) == value, name


def test_the_base_class_option_is_validated_when_the_task_is_built(app: Celery) -> None:
    app.finalize()
    with pytest.raises(InvalidRate, match="ten per second"):

        @app.task(base=RateLimitedTask, ratelimit="ten per second", shared=False)
        def broken() -> None: ...


@pytest.mark.parametrize("form", ["base class", "rules"])
@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("ratelimit_max_deferrals", -1, "-1"),
        ("ratelimit_guard", "0.1", "'0.1'"),
        ("ratelimit_max_deferal", 3, "'ratelimit_max_deferal' is unknown"),
        ("ratelimit_warning_interval", 5, "is an app-wide setting"),
    ],
)
def test_a_bad_task_option_is_rejected_when_the_task_is_built(
    app: Celery, form: str, option: str, value: Any, says: str
) -> None:
    """``@app.task(ratelimit_...=...)``, on the base class or on a plain task the rules
    limit: a bad value or an unknown name fails when Celery builds the task, naming the
    task, the option and the value, not when a worker first runs it."""
    options: dict[str, Any] = {option: value}
    if form == "rules":
        app.conf.ratelimit_rules = {"opts.job": "5/s"}
        install(app)
    else:
        options.update(base=RateLimitedTask, ratelimit="5/s")
    app.finalize()
    with pytest.raises(InvalidLimit) as raised:

        @app.task(name="opts.job", shared=False, **options)
        def job() -> None: ...

        job.name  # noqa: B018 (builds the task, if the decorator did not)
    assert "opts.job" in str(raised.value) and option in str(raised.value)
    assert says in str(raised.value)
    assert raised.value.__cause__ is None


@pytest.mark.parametrize("form", ["base class", "rules", "bad rate"])
def test_a_bad_limit_raised_where_celery_builds_the_task_stands_alone(
    app: Celery, form: str
) -> None:
    """Celery builds an ``@app.task`` at its first use, inside ``PromiseProxy``'s
    ``except AttributeError``: the library's error must not come chained after that
    ``'PromiseProxy' object has no attribute '__thing'``, which says nothing of it."""
    options: dict[str, Any] = {}
    if form == "rules":
        app.conf.ratelimit_rules = {"plumbing.job": Limit("5/s", key="api:{thing}")}
        install(app)
    else:
        spec = "ten per second" if form == "bad rate" else Limit("5/s", key="api:{thing}")
        options = {"base": RateLimitedTask, "ratelimit": spec}

    @app.task(name="plumbing.job", shared=False, **options)
    def job(tenant: str) -> None: ...

    with pytest.raises((InvalidLimit, InvalidRate), match=r"thing|ten per second") as raised:
        job.delay("t1")
    error = raised.value
    assert error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__
    shown = "".join(traceback.format_exception(error))
    assert "AttributeError" not in shown and "another exception occurred" not in shown, shown


def test_rules_prefer_an_exact_name_then_the_first_matching_glob() -> None:
    rules = Rules(
        {
            "proj.*": Limit("1/s"),
            "proj.fetch_*": Limit("2/s"),
            "proj.fetch_one": Limit("3/s"),
        }
    )
    assert rules.match("proj.fetch_one") == (Limit("3/s"),)
    assert rules.match("proj.fetch_two") == (Limit("1/s"),)  # mapping order among globs
    assert rules.match("proj.other") == (Limit("1/s"),)
    assert rules.match("other.task") is None
    assert Rules({"*": "1/s"}).match("celery.chord_unlock") is None


def test_a_bad_rule_is_rejected_naming_the_pattern() -> None:
    with pytest.raises(InvalidRate, match=r"^ratelimit_rules\['proj.\*'\]: cannot parse .*'10/x'"):
        Rules({"proj.*": "10/x"})
    with pytest.raises(InvalidLimit, match=r"^ratelimit_rules\['proj.one'\]: "):
        Rules({"proj.one": []})
    with pytest.raises(TypeError, match=r"ratelimit_rules\['proj.\*'\]"):
        Rules({"proj.*": 10})


def test_install_limits_plain_tasks_declared_before_and_after_it(app: Celery) -> None:
    @app.task(name="proj.early", shared=False)
    def early() -> None: ...

    @app.task(name="proj.own", base=RateLimitedTask, ratelimit="7/s", shared=False)
    def own() -> None: ...

    @ratelimit("6/s", key="decorated")
    @app.task(name="proj.decorated_early", shared=False)
    def decorated_early() -> None: ...

    app.conf.ratelimit_rules = {"proj.*": "1/s", "proj.exact": Limit("2/s", key="x")}
    install(app)

    @app.task(name="proj.exact", shared=False)
    def exact() -> None: ...

    @ratelimit("5/s", key="decorated")
    @app.task(name="proj.decorated", shared=False)
    def decorated() -> None: ...

    app.finalize()

    @app.task(name="proj.late", shared=False)
    def late() -> None: ...

    @ratelimit("4/s", key="decorated")
    @app.task(name="proj.decorated_late", shared=False)
    def decorated_late() -> None: ...

    @app.task(name="other.free", shared=False)
    def free() -> None: ...

    def limits(task: Any) -> tuple[Limit, ...] | None:
        plan = plan_for(app.tasks[task.name])
        return plan.limits if plan else None

    assert limits(early) == (Limit("1/s"),)
    assert limits(late) == (Limit("1/s"),)
    # one glob, two tasks: each its own budget, under its own name (README, "a glob")
    keys = {plan_for(app.tasks[t.name]).resolve((), {}).keys for t in (early, late)}  # type: ignore[union-attr]
    assert keys == {("proj.early",), ("proj.late",)}
    assert limits(exact) == (Limit("2/s", key="x"),)
    # the task's own limits, base class option or decorator, win over the rules
    assert limits(own) == (Limit("7/s"),)
    assert limits(decorated_early) == (Limit("6/s", key="decorated"),)
    assert limits(decorated) == (Limit("5/s", key="decorated"),)
    assert limits(decorated_late) == (Limit("4/s", key="decorated"),)
    assert limits(free) is None


def test_rules_that_limit_nothing_are_named_for_the_workers_start(app: Celery) -> None:
    @app.task(name="proj.plain", shared=False)
    def plain() -> None: ...

    app.conf.ratelimit_rules = {"proj.plian": "1/s", "proj.p*": "2/s", "other.*": "3/s"}
    assert rule_warnings(app) == [
        "app.conf.ratelimit_rules is set but install(app) was not called: no rule applies"
    ]
    install(app)
    app.finalize()
    assert rule_warnings(app) == [
        "the rule 'proj.plian' of ratelimit_rules matches no task of this worker"
        " (did you mean 'proj.plain'?)",
        "the rule 'other.*' of ratelimit_rules matches no task of this worker",
    ]


def test_builtin_celery_tasks_are_never_limited(app: Celery) -> None:
    app.conf.ratelimit_rules = {"*": "1/s"}
    install(app)

    class Custom(RateLimitedTask):  # type: ignore[misc]
        name = "celery.custom"
        ratelimit = "1/s"

    app.register_task(Custom())
    app.finalize()
    builtins = [name for name in app.tasks if name.startswith("celery.")]
    assert "celery.chord_unlock" in builtins and "celery.custom" in builtins
    assert all(plan_for(app.tasks[name]) is None for name in builtins)


def test_key_templates_bind_positional_and_keyword_arguments(app: Celery) -> None:
    @app.task(
        base=RateLimitedTask,
        shared=False,
        ratelimit=[
            Limit("100/m", key="yt:{api_key}:{region}", cost=lambda api_key, **kw: 2),
            Limit("5/s", key=lambda api_key, **kw: f"yt:{api_key}:burst"),
        ],
    )
    def fetch(api_key: str, region: str = "eu") -> None: ...

    app.finalize()
    plan = plan_for(fetch)
    assert plan is not None
    # a template's key and a key function's string are keys as written (``_keys``)
    assert plan.resolve(("k1",), {})[:2] == (("yt:k1:eu", "yt:k1:burst"), (2, 1))
    assert plan.resolve((), {"api_key": "k1", "region": "us"})[0][0] == "yt:k1:us"
    # a value cannot reach another key or name a hash tag
    assert plan.resolve(("a:b}{c",), {})[0][0] == "yt:a%3Ab%7D%7Bc:eu"


def tier_rate(account: str, tier: str = "free") -> str:
    return {"free": "2/s", "pro": "20/s", "broken": "20/fortnight", "odd": 20}[tier]  # type: ignore[return-value]


def test_a_rate_function_gives_each_call_its_tiers_rate_and_key(app: Celery) -> None:
    @app.task(
        base=RateLimitedTask,
        shared=False,
        ratelimit=[Limit(tier_rate, key="api:{account}"), Limit("3/s", key="all", cost=3)],
    )
    def call(account: str, tier: str = "free") -> None: ...

    app.finalize()
    plan = plan_for(call)
    assert plan is not None and plan.fixed is None
    assert plan.limits[0].label == "api:{account}@tier_rate"
    keys, costs, limits = plan.resolve(("a1",), {"tier": "pro"})
    assert (keys, costs) == (("api:a1", "all"), (1, 3))
    assert limits[0].rate == Rate.parse("20/s") and limits[1] is plan.limits[1]
    assert plan.resolve(("a1",), {})[2][0].rate == Rate.parse("2/s")
    # what a rate function returns is checked per call, naming the value
    with pytest.raises(InvalidLimit, match="tier_rate returned '20/fortnight'"):
        plan.resolve(("a1", "broken"), {})
    with pytest.raises(InvalidLimit, match="tier_rate returned 20"):
        plan.resolve(("a1", "odd"), {})
    with pytest.raises(InvalidLimit, match="tier_rate raised KeyError"):
        plan.resolve(("a1", "gold"), {})
    # outside a task, a rate function has no call to give it its arguments
    with pytest.raises(InvalidLimit, match="a function of a task call's arguments"):
        Limiter.from_url("redis://127.0.0.1:1/0").acquire("k", Limit(tier_rate))


def test_a_key_template_naming_an_argument_no_call_can_have_fails_when_declared(
    app: Celery,
) -> None:
    for form in ("base class", "decorator", "rules"):
        with pytest.raises(InvalidLimit, match=r"'t:\{tenant\}' .*\{tenant\}.*\(i: 'int'\)"):
            if form == "base class":

                @app.task(
                    base=RateLimitedTask, ratelimit=Limit("5/s", key="t:{tenant}"), shared=False
                )
                def job(i: int) -> None: ...

                _ = job.ratelimit  # Celery builds the task class lazily
            elif form == "decorator":

                @ratelimit("5/s", key="t:{tenant}")
                @app.task(shared=False, name="decorated")
                def decorated(i: int) -> None: ...

                app.finalize()
            else:
                app.conf.ratelimit_rules = {"ruled": Limit("5/s", key="t:{tenant}")}
                install(app)

                @app.task(shared=False, name="ruled")
                def ruled(i: int) -> None: ...

                _ = ruled.name
    with pytest.raises(InvalidLimit, match=r"\{2\}"):

        @app.task(base=RateLimitedTask, ratelimit=Limit("5/s", key="t:{2}"), shared=False)
        def two(i: int, j: int) -> None: ...

        _ = two.ratelimit


def test_the_decorator_checks_key_templates_against_the_function_as_it_decorates(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the app is not finalized and no task is built: the decoration itself fails
    with pytest.raises(InvalidLimit, match=r"task decorated names argument \{tenant\}"):

        @ratelimit("5/s", key="t:{tenant}")
        @app.task(shared=False, name="decorated")
        def decorated(i: int) -> None: ...

    with pytest.raises(InvalidLimit, match=r"task crl-test\.shared names argument \{2\}"):

        @ratelimit("5/s", key="t:{2}")
        @shared_task(name="crl-test.shared")
        def shared(i: int, j: int) -> None: ...

    # bind=True: the task comes first; {0} is the first argument of a call
    @ratelimit("5/s", key="t:{tenant}:{0}")
    @app.task(shared=False, bind=True)
    def bound(self: Any, tenant: str) -> None: ...

    with pytest.raises(InvalidLimit, match=r"\{1\}.*\(tenant: 'str'\)"):

        @ratelimit("5/s", key="t:{1}")
        @app.task(shared=False, bind=True, name="bound_two")
        def bound_two(self: Any, tenant: str) -> None: ...

    assert not app.finalized
    # without the private path, the same template fails when Celery builds the task
    monkeypatch.setattr(_compat, "PUBLIC_ONLY", True)

    @ratelimit("5/s", key="t:{tenant}")
    @app.task(shared=False, name="late")
    def late(i: int) -> None: ...

    with pytest.raises(InvalidLimit, match=r"task late names argument \{tenant\}"):
        app.finalize()


def test_a_key_template_may_name_a_keyword_of_a_kwargs_task(app: Celery) -> None:
    @app.task(base=RateLimitedTask, ratelimit=Limit("5/s", key="kw:{b}:{0}"), shared=False)
    def job(*args: int, **kwargs: int) -> None: ...

    app.finalize()
    plan = plan_for(job)
    assert plan is not None
    assert plan.resolve((7,), {"b": 1})[:2] == (("kw:1:7",), (1,))
    # a call that lacks it can only be told per call
    with pytest.raises(InvalidLimit, match="'b'"):
        plan.resolve((7,), {"c": 1})


@pytest.mark.parametrize("form", ["base class", "decorator", "rules"])
def test_eager_calls_run_without_touching_the_limiter(app: Celery, form: str) -> None:
    app.conf.task_always_eager = True
    calls: list[int] = []

    def body(self: Any, i: int) -> int:
        calls.append(i)
        # what the README says a body reads: never deferred here, so 0; no decision
        assert self.request.ratelimit_deferrals == 0
        assert self.request.ratelimit_decision is None
        return i

    if form == "base class":
        job = app.task(base=RateLimitedTask, ratelimit="1/m", shared=False, bind=True)(body)
    elif form == "decorator":
        job = ratelimit("1/m")(app.task(name="eager.job", shared=False, bind=True)(body))
    else:
        app.conf.ratelimit_rules = {"eager.job": "1/m"}
        install(app)
        job = app.task(name="eager.job", shared=False, bind=True)(body)
    app.finalize()
    # the limiter's Redis URL points at a closed port: eager mode never calls it
    assert [job.delay(i).get() for i in range(3)] == [0, 1, 2]
    assert calls == [0, 1, 2]


def test_options_sent_with_a_message_reach_the_script_past_the_worked_out_first_call(
    app: Celery, redis_url: str
) -> None:
    # A task's first limiter call is worked out once per (mode, horizon, guard); a
    # message that overrides the guard must still send its own. Seen in the decision:
    # a call that fits is the newest entry, so reset_after is the window it was
    # placed in, 1 s plus the guard (at most 4% of the window).
    app.conf.ratelimit_redis_url = redis_url
    app.conf.ratelimit_key_prefix = f"plumbing-{uuid.uuid4().hex[:8]}"

    @app.task(base=RateLimitedTask, ratelimit="100/s", bind=True, shared=False)
    def fetch(self: Any) -> None: ...

    def reset_after(**headers: Any) -> float:
        fetch.push_request(
            id=uuid.uuid4().hex,
            args=(),
            kwargs={},
            is_eager=False,
            called_directly=False,
            **headers,
        )
        try:
            assert enforce(fetch, (), {}) is None
            decision: Decision = getattr(fetch.request, DECISION_ATTR)
            return decision.reset_after
        finally:
            fetch.pop_request()

    assert reset_after() == pytest.approx(1.03, abs=1e-6)
    assert reset_after(ratelimit_guard=0.0) == pytest.approx(1.0, abs=1e-6)
    assert reset_after(ratelimit_guard=0.01) == pytest.approx(1.01, abs=1e-6)
    assert reset_after() == pytest.approx(1.03, abs=1e-6)


def test_an_aligned_limit_reaches_the_task_through_each_form(app: Celery) -> None:
    quota = Limit("10000/d", key="yt:{api_key}", cost=100, align="America/Los_Angeles")

    @app.task(name="yt.base", base=RateLimitedTask, ratelimit=[Limit("5/s"), quota], shared=False)
    def by_base(api_key: str) -> None: ...

    @ratelimit("10000/d", key="yt:{api_key}", cost=100, align="America/Los_Angeles")
    @app.task(name="yt.decorated", shared=False)
    def by_decorator(api_key: str) -> None: ...

    app.conf.ratelimit_rules = {"yt.ruled": quota}
    install(app)

    @app.task(name="yt.ruled", shared=False)
    def by_rules(api_key: str) -> None: ...

    app.finalize()
    for task, limits in (
        (by_base, (Limit("5/s"), quota)),
        (by_decorator, (quota,)),
        (by_rules, (quota,)),
    ):
        plan = plan_for(app.tasks[task.name])
        assert plan is not None and plan.limits == limits, task.name
        keys, costs, resolved = plan.resolve(("k1",), {})
        assert keys[-1] == "yt:k1" and costs[-1] == 100 and resolved[-1].align == quota.align
    with pytest.raises(InvalidLimit, match="10/s"):
        ratelimit("10/s", align="UTC")
    with pytest.raises(TypeError, match="align"):
        ratelimit(quota, align="UTC")


def test_observe_in_an_eager_body_writes_nothing_and_outside_a_body_is_refused(
    app: Celery,
) -> None:
    app.conf.task_always_eager = True

    @app.task(base=RateLimitedTask, ratelimit="1/m", shared=False)
    def job() -> bool:
        return celery_ratelimit.observe({"Retry-After": "5"})

    app.finalize()
    # the limiter's Redis URL points at a closed port: eager mode never calls it
    assert job.delay().get() is False
    with pytest.raises(RuntimeError, match="task's body"):
        celery_ratelimit.observe({"Retry-After": "5"})


def test_the_readmes_settings_table_is_the_code_s() -> None:
    """Every setting the README's table lists, and only those, with the default the
    code has; the task options are its last seven rows ("the seven from
    `on_redis_error` down")."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(ratelimit_[a-z_]+)` \| (.+?) \|", readme, re.MULTILINE)
    assert set(DEFAULTS) == {name for name, _ in rows}
    assert tuple(name for name, _ in rows[-7:]) == TASK_OPTIONS
    for name, shown in rows:
        if name == "ratelimit_redis_url":
            assert DEFAULTS[name] is None  # worked out from the broker's URL (redis_url)
            continue
        assert ast.literal_eval(shown.strip("`")) == DEFAULTS[name], name


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis://broker.example:6380/2", "redis://broker.example:6380/2"),
        ("rediss://:pw@broker.example:6380/0", "rediss://:pw@broker.example:6380/0"),
        ("amqp://guest:guest@rabbit.example:5672//", "redis://localhost:6379/0"),
        ("sentinel://s1:26379;sentinel://s2:26379", "redis://localhost:6379/0"),
    ],
)
def test_the_limiters_url_defaults_to_a_redis_brokers_own_else_localhost(
    broker: str, expected: str
) -> None:
    """The README's default of ``ratelimit_redis_url``: the broker URL when it is
    ``redis://``/``rediss://``, else ``redis://localhost:6379/0``; a set value wins."""
    app = Celery("urls", broker=broker, set_as_current=False)
    assert redis_url(app) == expected
    app.conf.ratelimit_redis_url = "redis://elsewhere:6379/5"
    assert redis_url(app) == "redis://elsewhere:6379/5"
