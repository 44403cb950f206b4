"""The park: deferred copies wait in Redis until they are nearly due, not in a worker.

A deferred copy published to the broker with an ``eta`` is held by the worker that
fetched it, in memory and unacknowledged, until it is due: a backlog of thousands
deferred at once made every node hold its share of them (350 MB a node at 5,000 tasks).
A deferral longer than ``ratelimit_park_after`` (2 s by default) is parked instead: the
copy's signature goes into a sorted set and a hash in the limiter's Redis (one script
call, ``lua/park.lua``), and every worker node runs a *mover*, a thread that claims the
copies coming due within :data:`LEAD`, publishes each with its ``eta`` (Redis time; see
``clock``), then drops them. A node thus holds the copies due in the next seconds, a
number bounded by the limits, not by the backlog.

At least once, never lost: the copy is parked before the original message is
acknowledged (as a published copy was); a mover claims copies for :data:`LEASE` seconds
and drops them only after publishing, so a mover that dies in between leaves them to be
claimed again when the claim lapses (a duplicate is possible, a loss is not). If the
park cannot be written (Redis unreachable), the copy is published to the broker as
before. Nodes with one broker URL share one park (``<prefix>:{park:<digest>}:…``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import threading
import time
import uuid
from functools import lru_cache
from typing import Any

from celery import signals
from kombu.connection import Connection
from kombu.exceptions import OperationalError
from kombu.serialization import dumps, loads, prepare_accept_content

from .._engine.limiter import REDIS_ERRORS, Limiter
from .settings import limiter_for, park_after, park_undecided, setting

logger = logging.getLogger("celery_ratelimit")

#: A parked copy is published this long (seconds) before it is due: it reaches a worker
#: early, past a queue of other messages, and waits there as an ETA message.
LEAD = 1.0
#: A mover's claim on the copies it publishes lapses after this many seconds.
LEASE = 30.0
#: At most this many copies a claim; a full claim is followed by the next at once.
BATCH = 200
#: A copy waiting for a concurrency slot that may be handed to it is published only this
#: long (seconds) before it is due: a slot handed over sooner calls it in (``call_in``).
TURN_LEAD = 0.2
#: ... and it comes by itself only this long (seconds) after its expected turn (within
#: the 2 s a place in line is kept past it): a turn comes when a body ends, which an
#: estimate cannot foresee, and a copy that came too early would be deferred again.
TURN_SLACK = 1.0
#: A mover with nothing due looks again after at most this long (seconds): less than
#: ``ratelimit_park_after`` - LEAD, so no copy is claimed late.
POLL = 0.5
#: ... and at least this long, unless its last claim was full.
TICK = 0.2
#: After an error, a mover tries again after this long (seconds).
ERROR_PAUSE = 1.0
#: A copy is parked only if some mover claimed within this many seconds; else it goes
#: to the broker (no node runs a mover: an in-process test worker, or every node down).
MOVER_SEEN = 5.0


def park_keys(app: Any, limiter: Limiter) -> list[str]:
    """The park of ``app``'s broker: its sorted set, its hash of copies, its counts,
    which mover's claim holds each claimed copy, the copies of calls waiting for a
    concurrency slot by token, and the list that wakes a mover (``lua/park.lua``)."""
    broker = str(app.conf.broker_write_url or app.conf.broker_url)
    base = f"{limiter.prefix}:{{park:{_digest(broker)}}}"
    return [f"{base}:{name}" for name in ("due", "copies", "counts", "claims", "turns", "wake")]


@lru_cache(maxsize=64)
def _digest(broker: str) -> str:
    """A short digest of the broker URL, as kombu writes it (the password left out)."""
    with contextlib.suppress(Exception):  # an unusual transport: the URL as configured
        broker = Connection(broker).as_uri()  # type: ignore[no-untyped-call]
    return hashlib.sha256(broker.encode()).hexdigest()[:16]


def park_calls(client: Any, prefix: str) -> int:
    """How many script calls every park under ``prefix`` has counted (parks, claims,
    drops and copies called in): what a count of ``EVALSHA`` calls holds besides
    rate-limit decisions."""
    calls = 0
    for key in client.scan_iter(match=f"{prefix}:{{park:*}}:counts", count=100):
        calls += sum(int(n) for n in client.hmget(key, "park", "claim", "drop", "call") if n)
    return calls


def park(task: Any, signature: Any, countdown: float, waiting: str | None = None) -> bool:
    """Park ``signature`` (a deferred copy of ``task``), due ``countdown`` seconds from
    now by Redis's clock; False if no mover serves the park (the copy is not parked).
    ``waiting``: the token of a call waiting in line for a concurrency slot that may be
    handed to it; its copy is due :data:`TURN_SLACK` later, claimed only
    :data:`TURN_LEAD` before it is due, and called in (:func:`call_in`) as soon as the
    slot is handed to it.

    Raises:
        LimiterUnavailable, LimiterMisconfigured: the park could not be written.
    """
    options = {k: v for k, v in signature.options.items() if k != "eta"}
    body = dict(signature, options=options)
    serializer = options.get("serializer") or task.serializer
    content_type, encoding, data = dumps(body, serializer=serializer)  # type: ignore[no-untyped-call]
    if isinstance(data, str):
        data = data.encode(encoding or "utf-8")
    payload = f"{content_type}|{encoding}|".encode() + data
    limiter = limiter_for(task.app)
    copy_id = uuid.uuid4().hex if waiting is None else f"{waiting}~{uuid.uuid4().hex}"
    if waiting is not None:
        countdown += TURN_SLACK
    arguments = ["park", copy_id, int(countdown * 1e6), payload, int(MOVER_SEEN * 1e6)]
    if waiting is not None:
        arguments += [waiting, int((LEAD - TURN_LEAD) * 1e6)]
    try:
        due = limiter.run_script("park", park_keys(task.app, limiter), arguments)
    except REDIS_ERRORS as exc:
        raise limiter.translate(exc, "parking a deferred task") from exc
    return int(due) >= 0


def call_in(app: Any, limiter: Limiter, token: str) -> bool:
    """The slot the waiting call ``token`` waited for was handed to it: make its parked
    copy due now and wake a mover to publish it. False if no copy of it is parked
    unclaimed (it waits in a worker or in the broker, or a mover is publishing it).

    Raises:
        LimiterUnavailable, LimiterMisconfigured: Redis failed (the copy comes when it
            was due, and confirms its turn then).
    """
    try:
        return bool(limiter.run_script("park", park_keys(app, limiter), ["call", token]))
    except REDIS_ERRORS as exc:
        raise limiter.translate(exc, "calling in a parked task") from exc


def call_in_handed(app: Any, limiter: Limiter, tokens: tuple[str, ...]) -> None:
    """:func:`call_in` the copies of the calls ``tokens`` a release handed a slot to
    (``Limiter.release_handing``); ``app`` None: nothing is parked. A copy that cannot be
    called in comes when it was due, and takes its turn then."""
    for token in tokens if app is not None else ():
        try:
            call_in(app, limiter, token)
        except Exception as exc:
            logger.debug("ratelimit: could not call in a parked copy: %s", exc)


class Claims:
    """What a mover remembers between two looks: its id (its claims carry it), whether a
    claim's reply may have been lost, and the copies it published but could not drop."""

    def __init__(self) -> None:
        self.mover = uuid.uuid4().hex
        self.lost = False
        self.undropped: list[bytes] = []


def move_once(app: Any, claims: Claims | None = None) -> float:
    """Publish the parked copies of ``app``'s broker that are due within :data:`LEAD`;
    returns how long to sleep before the next look (seconds).

    A claim that timed out may still have run (a Redis paused, then resumed): the copies
    it took would wait for their claim to lapse. So after a failure the next claim
    first takes back what this mover's claims hold (``claims``: a mover's own, kept
    across looks), and published copies whose drop failed are dropped first.

    Raises:
        LimiterUnavailable, LimiterMisconfigured: Redis failed the claim or the drop.
        kombu.exceptions.OperationalError: the broker is unreachable (the copies of the
            claim not yet published stay claimed until the claim lapses).
    """
    claims = claims or Claims()
    limiter = limiter_for(app)
    keys = park_keys(app, limiter)
    if claims.undropped:
        _drop(limiter, keys, claims)
    arguments = ["claim", int(LEAD * 1e6), int(LEASE * 1e6), BATCH, claims.mover]
    try:
        reply = limiter.run_script("park", keys, [*arguments, "1" if claims.lost else "0"])
    except REDIS_ERRORS as exc:
        claims.lost = True
        raise limiter.translate(exc, "claiming parked tasks") from exc
    claims.lost = False
    now_us, first_us = int(reply[0]), int(reply[1])
    published = []
    broker_down: OperationalError | None = None
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    for copy_id, value in zip(reply[2::2], reply[3::2], strict=True):
        try:
            _publish(app, value, accept)
        except OperationalError as exc:
            # the broker is unreachable: the rest of the claim would fail alike, each
            # after the publish retries; all of it is claimed again when the claim lapses
            broker_down = exc
            break
        except Exception as exc:  # this copy alone; claimed again when the claim lapses
            logger.error(
                "ratelimit: could not publish a parked task (%s); trying again in %.0fs",
                exc,
                LEASE,
            )
            continue
        published.append(copy_id)
    if published:
        claims.undropped = published
        _drop(limiter, keys, claims)
    if broker_down is not None:
        raise broker_down
    if len(reply) - 2 >= 2 * BATCH:
        return 0.0
    if first_us < 0:
        return POLL
    # the next copy comes due within LEAD then; copies due together go in one claim
    return min(POLL, max((first_us - now_us) / 1e6 - LEAD, TICK))


def _drop(limiter: Limiter, keys: list[str], claims: Claims) -> None:
    """Drop the copies ``claims`` published.

    Raises:
        LimiterUnavailable, LimiterMisconfigured: Redis failed (they are dropped at
            the next look).
    """
    try:
        limiter.run_script("park", keys, ["drop", *claims.undropped])
    except REDIS_ERRORS as exc:
        raise limiter.translate(exc, "dropping published parked tasks") from exc
    claims.undropped = []


def _publish(app: Any, value: bytes, accept: Any) -> None:
    due, content_type, encoding, data = value.split(b"|", 3)
    body = loads(data, content_type.decode(), encoding.decode(), accept=accept)  # type: ignore[no-untyped-call]
    signature = app.signature(body)
    # the ETA in Redis time, as a deferring worker writes it (see clock)
    eta = datetime.datetime.fromtimestamp(int(due) / 1e6, tz=datetime.timezone.utc)
    signature.apply_async(eta=eta)
    # one line per copy, as its deferral has: a copy that no node receives after this
    # was lost past the publish, one without it was never handed to the broker
    logger.info("ratelimit: published parked %s[%s] due %s", signature.task, signature.id, eta)


class Mover(threading.Thread):
    """A worker node's mover: publishes parked copies as they come due, until stopped."""

    def __init__(self, app: Any) -> None:
        super().__init__(name="celery-ratelimit-mover", daemon=True)
        self.app = app
        self.stopping = threading.Event()
        self.claims = Claims()

    def run(self) -> None:
        interval = setting("ratelimit_warning_interval", self.app)
        last_logged = -interval
        while not self.stopping.is_set():
            try:
                pause = move_once(self.app, self.claims)
            except Exception as exc:  # Redis down, the broker down: keep trying
                pause = 0.0
                self.stopping.wait(ERROR_PAUSE)
                if time.monotonic() - last_logged >= interval:
                    last_logged = time.monotonic()
                    logger.warning(
                        "ratelimit: the mover could not publish parked tasks (%s); "
                        "trying again every %.0fs",
                        exc,
                        ERROR_PAUSE,
                    )
            if pause:
                self.nap(pause)

    def nap(self, pause: float) -> None:
        """Wait ``pause`` seconds, or less if a copy is called in (``call_in``)."""
        limiter = limiter_for(self.app)
        try:
            limiter._pop_waiting(park_keys(self.app, limiter)[5], pause, "a mover's nap")
        except Exception:  # Redis away: the next look says so
            self.stopping.wait(pause)

    def stop(self) -> None:
        self.stopping.set()


_movers: dict[int, Mover] = {}


def limited(app: Any) -> bool:
    """Does any task of ``app`` have a rate limit (its own, or from the rules)?"""
    if setting("ratelimit_rules", app):
        return True
    return any(getattr(task, "ratelimit", None) is not None for task in app.tasks.values())


def _start_mover(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: start this node's mover, if the node runs rate-limited tasks."""
    app = getattr(sender, "app", None)
    if app is None or os.getpid() in _movers or not limited(app):
        return
    if park_after(app) is None:
        undecided = park_undecided(app)
        if undecided:
            logger.info("ratelimit: %s", undecided)
        return  # an app-wide setting: no node parks
    mover = _movers[os.getpid()] = Mover(app)
    mover.start()


def _stop_mover(**_: Any) -> None:
    mover = _movers.pop(os.getpid(), None)
    if mover is not None:
        mover.stop()
        mover.join(timeout=5.0)


signals.worker_ready.connect(_start_mover, weak=False)
signals.worker_shutdown.connect(_stop_mover, weak=False)

__all__ = [
    "LEAD",
    "LEASE",
    "TURN_LEAD",
    "TURN_SLACK",
    "Mover",
    "call_in",
    "call_in_handed",
    "limited",
    "move_once",
    "park",
    "park_calls",
    "park_keys",
]
