"""install(app): worker-wide rate limits for plain tasks, from ``app.conf.ratelimit_rules``.

How it hooks in, and why:

- **Task annotations** (``app.conf.task_annotations``). Celery applies annotations to
  each task class when it is bound to the app, which happens for every task,
  including tasks registered after ``install`` runs (late imports, ``@shared_task``
  in modules loaded by ``autodiscover_tasks``). Our annotation object sets the
  task's ``ratelimit`` and wraps its ``before_start`` (the same check the base class
  runs), so the worker's tracer, built after binding, calls it.
- **Tasks already bound** when ``install`` is called were annotated before our
  annotation existed; ``install`` attaches to them directly, and again on the app's
  ``on_after_finalize`` signal for anything bound in between.
- A ``task_cls`` swap was not used: it changes the base of tasks declared after it
  only, and overrides a base class the project may already set.

A task's own ``ratelimit`` (base class option or decorator) wins over the rules.
Built-in ``celery.*`` tasks are never limited.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from .._engine.exceptions import InvalidLimit, InvalidRate
from .._engine.limit import Limit, to_limits
from .settings import check_app_settings, setting
from .task import wrap_before_start


class Rules:
    """Task name patterns mapped to limits; an exact name wins over a glob, and among
    globs the first in the mapping's order wins."""

    def __init__(self, rules: Mapping[str, Any]) -> None:
        self.exact: dict[str, tuple[Limit, ...]] = {}
        self.globs: list[tuple[str, tuple[Limit, ...]]] = []
        for pattern, spec in rules.items():
            if not isinstance(pattern, str) or not pattern:
                raise InvalidLimit(
                    f"ratelimit_rules keys must be task name patterns, got {pattern!r}"
                )
            what = f"ratelimit_rules[{pattern!r}]"
            try:
                limits = to_limits(spec, what)
            except (InvalidRate, InvalidLimit) as exc:
                raise type(exc)(f"{what}: {exc}") from None  # which rule, not only what
            if any(ch in pattern for ch in "*?["):
                self.globs.append((pattern, limits))
            else:
                self.exact[pattern] = limits

    def match(self, name: str) -> tuple[Limit, ...] | None:
        if not name or name.startswith("celery."):
            return None
        if name in self.exact:
            return self.exact[name]
        for pattern, limits in self.globs:
            if fnmatchcase(name, pattern):
                return limits
        return None


class _Annotation:
    """A Celery task annotation that attaches the rule matching the task's name."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules

    def annotate(self, task: Any) -> None:
        _apply(task, self.rules)  # returns None so that later annotations still apply

    def annotate_any(self) -> None:
        return None


#: The task class attribute that keeps the limits a rule gave it (see :func:`from_rules`).
_RULE = "_ratelimit_rule"


def from_rules(task: Any) -> bool:
    """Whether the task's limits are a rule's, not its own declaration (a base class
    option, or ``@ratelimit``, which may attach after a rule was applied)."""
    cls = task if isinstance(task, type) else type(task)
    limits = cls.__dict__.get("ratelimit")
    return limits is not None and limits is cls.__dict__.get(_RULE)


def _apply(task: Any, rules: Rules) -> None:
    cls: Any = task if isinstance(task, type) else type(task)
    if cls.__dict__.get("ratelimit") is not None and not from_rules(cls):
        return  # the task declared its own limits
    limits = rules.match(getattr(cls, "name", None) or "")
    if limits is None:
        return
    cls.ratelimit = limits
    setattr(cls, _RULE, limits)
    wrap_before_start(cls)


def _annotations(app: Any) -> list[Any]:
    """``app.conf.task_annotations`` as a list (Celery takes None, one, or a sequence)."""
    existing = app.conf.task_annotations
    if existing is None:
        return []
    if isinstance(existing, (list, tuple)):
        return list(existing)
    return [existing]


def install(app: Any) -> Rules:
    """Apply ``app.conf.ratelimit_rules`` to the app's tasks, now and later.

    Validates the rules and every ``ratelimit_*`` setting now (import time).

    Example::

        app.conf.ratelimit_rules = {
            "proj.tasks.fetch_*": "100/m",
            "proj.tasks.search": Limit("10/s"),
        }
        install(app)

    Raises:
        InvalidRate, InvalidLimit, TypeError: a bad rule or setting, naming it.
    """
    check_app_settings(app)
    rules = Rules(setting("ratelimit_rules", app))
    annotation = _Annotation(rules)
    annotations = [a for a in _annotations(app) if not isinstance(a, _Annotation)]
    app.conf.task_annotations = [annotation, *annotations]
    # Celery prepares the annotations once (a cached property): prepare them again
    with contextlib.suppress(AttributeError):
        del app.annotations

    def attach_all(**_: Any) -> None:
        for task in list(app.tasks.values()):
            _apply(task, rules)

    if app.finalized:  # else every task is bound by then; reading app.tasks would finalize
        attach_all()
    app.on_after_finalize.connect(attach_all, weak=False)
    return rules


def rule_warnings(app: Any) -> list[str]:
    """What a worker node says at its start of rules in ``app.conf.ratelimit_rules`` that
    limit nothing: ``install(app)`` never called, or a pattern no task of this node
    matches (a typo in a task name is otherwise silent: the task just runs unlimited)."""
    rules = setting("ratelimit_rules", app)
    if not rules:
        return []
    if not any(isinstance(a, _Annotation) for a in _annotations(app)):
        return ["app.conf.ratelimit_rules is set but install(app) was not called: no rule applies"]
    names = sorted(name for name in app.tasks if not name.startswith("celery."))
    said = []
    for pattern in rules:
        if not any(fnmatchcase(name, pattern) for name in names):
            near = difflib.get_close_matches(pattern, names, n=1)
            said.append(
                f"the rule {pattern!r} of ratelimit_rules matches no task of this worker"
                + (f" (did you mean {near[0]!r}?)" if near else "")
            )
    return said
