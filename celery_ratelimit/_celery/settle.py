"""settle(cost): inside a task body, the real cost of the call the task was granted for.

An LLM call's tokens are known only from its response; a metered API charges quota for
failed requests. The task was counted at the cost its limits declare (an estimate);
``settle`` replaces it, for this execution's grant, on every limit that weighs calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from celery import current_task

from .._engine.decision import Decision
from .._engine.limit import Concurrency
from .check import DECISION_ATTR
from .plan import plan_for
from .settings import limiter_for


def settle(cost: int | Sequence[int]) -> Decision | None:
    """Replace the cost the running task was counted at with its real one.

    Call it in the body of a rate-limited task once the cost is known. An int replaces
    the cost of every limit that weighs calls (a ``cost`` other than the default 1,
    or a cost function), or of every limit when none does: a per-call cap stacked with
    a units quota stays counted as one call. A sequence gives one cost per limit, in the
    order the task declares them. A refund frees budget at once; a surcharge may put a
    window over its limit, and the next calls wait it out.

    Returns:
        The :class:`Decision` of the settle (``allowed`` when the grant was found), or
        None when this execution holds no grant (an eager call, a task without limits,
        a limit the Redis-error policy let through).

    Raises:
        RuntimeError: called outside a task body.
        InvalidLimit / TypeError: a cost that is not an int of 0 or more.
    """
    task = current_task
    if task is None or not getattr(task, "request", None):
        raise RuntimeError("celery_ratelimit.settle() is called in a task's body")
    request = task.request
    decision = getattr(request, DECISION_ATTR, None)
    plan = plan_for(task)
    if plan is None or decision is None or decision.token is None:
        return None
    keys, costs, limits = plan.resolve(tuple(request.args or ()), request.kwargs or {})
    if isinstance(cost, Sequence) and not isinstance(cost, (str, bytes)):
        real = tuple(cost)
    else:
        weighed = [
            not isinstance(limit, Concurrency) and (callable(limit.cost) or limit.cost != 1)
            for limit in plan.limits
        ]
        every = not any(weighed)
        real = tuple(
            cost if every or weighs else counted  # type: ignore[misc]
            for weighs, counted in zip(weighed, costs, strict=True)
        )
    settled = limiter_for(task.app).settle(decision.token, keys, limits, real)
    if settled.allowed:
        # its token now carries the settled costs: a second settle starts from them
        setattr(request, DECISION_ATTR, replace(decision, token=settled.token))
    return settled


__all__ = ["settle"]
