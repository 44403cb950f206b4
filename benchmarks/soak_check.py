"""What the soak judges at the end: the record the task bodies kept on disk (never in a
server the soak breaks), and what Redis still holds once everything is idle.

Windows are judged by the limiter's Redis clock: each start record carries its
decision's instant (``Decision.at``, Redis ``TIME`` when the script granted or reserved
the slot), taken from the decision itself, so a Redis paused or restarted when the body
wrote its line changes nothing.
"""

from __future__ import annotations

import bisect
import datetime
import json
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.soak_app import AT_ONCE, LIMITS
from celery_ratelimit._celery.park import LEAD as PARK_LEAD
from tests.fault_nodes import due_times
from tests.measure import max_weight_in_window, most_at_once

#: seconds from a message's hand-off to the broker to a kill -9 within which its loss is
#: put down to kombu's ``BRPOP`` gap (a popped reply can wait unread for seconds)
GAP = 5.0
#: ... or at most this long after it: a ``BRPOP`` the killed node had sent is served
#: until Redis sees the connection closed, and ``sent`` is read after the send returns
LATE = 0.5
#: scores below this are a sorted set's meta members, not entries
META = 10**13


#: a mover's line for a parked copy it published, and a node's for a message it took in
_PUBLISHED = re.compile(r"^\[(\S+ \S+): .*ratelimit: published parked \S+\[([0-9a-f-]+)\]")
_RECEIVED = re.compile(r"^\[(\S+ \S+): .*\] Task \S+\[([0-9a-f-]+)\] received")
#: a node's line for a deferred copy it published to the broker (not to the park)
_DEFERRED = re.compile(r"^\[(\S+ \S+): .*ratelimit: deferred \S+\[([0-9a-f-]+)\](?!.*parked in)")
#: a node's lines for the loss of its broker connection
_DROPPED = re.compile(r"^\[(\S+ \S+): .*(Connection to broker lost|Unrecoverable error)")


def _stamps(lines: list[str], pattern: re.Pattern[str]) -> dict[str, list[float]]:
    """Task id -> the epoch seconds (by the log's clock) of each line ``pattern`` finds."""
    found: dict[str, list[float]] = defaultdict(list)
    for line in lines:
        if match := pattern.search(line):
            stamp, task_id = match.groups()
            when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found[task_id].append(when)
    return found


@dataclass
class Record:
    """The lines of the record file, read as they are appended."""

    path: Path
    starts: list[dict[str, Any]] = field(default_factory=list)
    done: Counter[str] = field(default_factory=Counter)
    ends: dict[str, float] = field(default_factory=dict)
    finished: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    _offset: int = 0

    def read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        for raw in whole.splitlines():
            line = json.loads(raw)
            if line["e"] == "s":
                self.starts.append(line)
            else:
                self.done[line["id"]] += 1
                self.finished[line["id"]].append(line["t"])
                if "run" in line:
                    self.ends[line["run"]] = line["t"]


@dataclass
class Verdict:
    tasks: int
    ran: int
    lost: int
    dup: int
    over_limit: int
    details: list[str]
    gap: int
    #: each task counted apart in kombu's gap: when it was lost (the kill -9, or the
    #: first connection lost while its neighbours were taken in)
    gap_at: dict[str, float] = field(default_factory=dict)


def judge(
    sent: dict[str, float],
    record: Record,
    kills: list[float],
    logs: Path,
    popped: bool = True,
    aof: Path | None = None,
    queued: frozenset[str] = frozenset(),
) -> Verdict:
    """Every task ran (at least once); no window started more than its limit; no more
    bodies at once than a ``Concurrency`` allows; every run had a decision.

    One loss is not the limiter's: kombu pops a message from a Redis broker's list
    (``BRPOP``) before it records it as unacknowledged, so a node SIGKILLed with a
    popped message not yet taken in loses it, with or without this library
    (docs/operations.md, "Worker killed"). A task that no node ever logged as received
    (nor deferred since), whose last hand-off to the broker (``sent``: epoch seconds it
    was sent; or its newest deferred copy, due by a node's log) came at most
    :data:`GAP` s before a kill -9 of a node (``kills``, epoch seconds), or :data:`LATE`
    s after it, is counted apart as lost in that gap; so is a task taken in once whose
    parked copy a mover published (its log line) within the same bounds of a kill -9 and
    no node took in after. So is a task whose neighbours in the broker's FIFO list (the
    messages handed over just before and just after its last hand-off) were taken in
    while a node lost its broker connection or was killed -9 (within :data:`LATE` s):
    it was popped then, on a connection that did not read it (:class:`Fifo`). So, last,
    is a task whose message the Redis broker's own log (``aof``: its append-only file)
    shows pushed onto a queue (sent, deferred, parked copy published, or given back by a
    node's shutdown) and never recorded as delivered after (kombu's ``unacked`` hash)
    and not in the broker at the end (``queued``): popped by a ``BRPOP`` whose reply no
    consumer took in, whichever fault cut it (:func:`popped_unseen`; nothing of this
    library pops a broker's queue). Every other missing task is lost. ``popped``: the
    broker is a Redis one (a RabbitMQ broker gives an unacknowledged message back
    whatever became of its consumer)."""
    ids = set(sent)
    details = []
    over = 0
    undecided = [s for s in record.starts if s["at"] is None]
    if undecided:
        over += len(undecided)
        details.append(f"{len(undecided)} bodies ran without a decision: {undecided[:3]}")
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for start in record.starts:
        by_task[start["task"]].append(start)
    for task, limits in LIMITS.items():
        events = [(s["at"], int(s.get("cost", 1))) for s in by_task[task] if s["at"] is not None]
        for key, limit, window in limits:
            worst = max_weight_in_window(events, round(window * 1_000_000)) if events else 0
            details.append(
                f"{task:<9} {key}: {limit}/{window:g}s, {len(events)} grants, worst window {worst}"
            )
            over += max(0, worst - limit)
    for task, most in AT_ONCE.items():
        spans = [
            (round(s["t"] * 1e6), round(record.ends[s["run"]] * 1e6))
            for s in by_task[task]
            if s.get("run") in record.ends
        ]
        worst = most_at_once(spans)
        details.append(f"{task:<9} bodies at once: at most {most}, worst {worst}")
        over += max(0, worst - most)
    lost = ids - set(record.done)
    lines = [ln for p in logs.glob("*.log") for ln in p.read_text("utf-8", "replace").split("\n")]
    due = due_times(lines)
    published, receipts = _stamps(lines, _PUBLISHED), _stamps(lines, _RECEIVED)
    received = lost & set(receipts)
    gap = set()
    gap_at: dict[str, float] = {}
    for i in lost:
        if i in received:
            # taken in once, deferred and parked: its copy's hand-off is the mover's
            # publish, and no node took the copy in after it
            if i not in published or max(receipts.get(i, [0.0])) >= max(published[i]):
                continue
            handed = max(published[i])
        else:
            handed = max(sent[i], due.get(i, 0.0) - PARK_LEAD, *published.get(i, []))
        near = [kill for kill in kills if -LATE <= kill - handed <= GAP]
        if near:
            gap.add(i)
            gap_at[i] = near[0]
    if gap:
        details.append(f"kombu: {len(gap)} lost at a kill -9, never taken in: {sorted(gap)}")
    lost -= gap
    fifo = Fifo(sent, lines, kills)
    cut = {
        i for i in lost if popped and (span := fifo.span(i)) is not None and fifo.drops(*span[1:])
    }
    if cut:
        details.append(
            f"kombu: {len(cut)} lost at a lost broker connection, popped then: {sorted(cut)}"
        )
        details += fifo.trace(sorted(cut)[:10])
    for i in cut:
        span = fifo.span(i)
        assert span is not None
        gap_at[i] = min(w for w, _ in fifo.lost_at if span[1] - LATE <= w <= span[2] + LATE)
    gap |= cut
    lost -= cut
    unseen = popped_unseen(aof, lost) - queued if popped and aof is not None and lost else set()
    if unseen:
        details.append(
            f"kombu: {len(unseen)} popped from the broker's queue and never delivered "
            f"(its AOF: pushed, then no unacked record): {sorted(unseen)}"
        )
        details += fifo.trace(sorted(unseen)[:10])
        for i in unseen:
            gap_at[i] = max([*fifo.handed.get(i, []), *fifo.receipts.get(i, []), sent.get(i, 0.0)])
    gap |= unseen
    lost -= unseen
    if lost:
        # a mover's line for each parked copy it published (celery_ratelimit/_celery/park.py)
        moved = lost & set(published)
        details.append(
            f"lost: {sorted(lost)[:10]} ({len(lost & received)} were received, "
            f"{len(moved)} published from the park)"
        )
        details += fifo.trace(sorted(lost)[:10])
    return Verdict(
        tasks=len(ids),
        ran=len(ids & set(record.done)),
        lost=len(lost),
        dup=sum(1 for i in ids if record.done[i] > 1),
        over_limit=over,
        details=details,
        gap=len(gap),
        gap_at=gap_at,
    )


#: a fault is put down as the cause of what happened at most this long after it ends
#: (seconds): a duplicate's first run interrupted or its ack lost, a loss in kombu's gap
CAUSE = 5.0
#: a fault's effect on the grants: those in this many seconds after it over the same
#: span before it
SPAN = 10.0


def by_class(
    faults: list[tuple[float, Any]],
    record: Record,
    gap_at: dict[str, float],
    logs: Path | None = None,
) -> list[str]:
    """A line per fault class: how many ran, the duplicates (:func:`_dup_causes`) and
    the losses in kombu's gap (:func:`_gap_causes`) put down to it, and the median, over
    its faults, of the grants in the :data:`SPAN` s after it over those in the span
    before (``faults``: the epoch seconds each began, and the fault)."""
    ordered = sorted(faults, key=lambda f: f[0])
    dups, lost = _dup_causes(ordered, record, logs), _gap_causes(ordered, gap_at)
    grants = sorted(s["t"] for s in record.starts)
    effect: dict[str, list[float]] = defaultdict(list)
    for when, f in ordered:
        before = bisect.bisect_left(grants, when) - bisect.bisect_left(grants, when - SPAN)
        after = bisect.bisect_left(grants, when + SPAN) - bisect.bisect_left(grants, when)
        if before:
            effect[f.kind].append(after / before)
    out = []
    for kind in sorted({f.kind for _, f in faults} | set(dups) | set(lost)):
        ratios = sorted(effect.get(kind, []))
        median = f"{ratios[len(ratios) // 2]:.2f}" if ratios else "-"
        count = sum(1 for _, f in faults if f.kind == kind)
        out.append(
            f"{kind:<14} faults={count} dup={dups[kind]} lost_in_gap={lost[kind]} "
            f"grants_after/before={median}"
        )
    return out


def _dup_causes(
    ordered: list[tuple[float, Any]], record: Record, logs: Path | None
) -> Counter[str]:
    """The class of the fault each duplicate is put down to: the first that hit the node
    of its first run, or its broker, from that run's start (1 s of slack: a fault's
    instant is taken just before it is done) to :data:`CAUSE` s after its end (its
    acknowledgement lost), or to the second run when it never ended; else the first that
    hit a node within :data:`CAUSE` s after it received the task (in its log,
    ``logs/<node>.log``: a deferral's acknowledgement lost), or the broker then (the
    faults that can lose an acknowledgement: :func:`_loses_acks`)."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for start in record.starts:
        runs[start["id"]].append(start)
    receipts: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for path in sorted(logs.glob("node*.log")) if logs is not None else []:
        lines = path.read_text("utf-8", "replace").split("\n")
        for i, stamps in _stamps(lines, _RECEIVED).items():
            receipts[i] += [(when, path.stem) for when in stamps]
    dups: Counter[str] = Counter()
    for i, n in record.done.items():
        if n < 2 or len(runs[i]) < 2:
            continue
        first, second = sorted(runs[i], key=lambda s: s["t"])[:2]
        ends = [t for t in record.finished[i] if first["t"] <= t < second["t"]]
        spans = [(first["t"], ends[0] + CAUSE if ends else second["t"], first.get("node", ""))]
        spans += [(w, w + CAUSE, node) for w, node in sorted(receipts[i]) if w < second["t"]]
        causes = (
            f.kind
            for begin, until, node in spans
            for when, f in ordered
            if when + f.hold >= begin - 1.0
            and when <= until
            and _loses_acks(f, str(node).split("@")[0])
        )
        dups[next(causes, "none found")] += 1
    return dups


def _loses_acks(fault: Any, node: str) -> bool:
    """Can ``fault`` lose the acknowledgement of a message ``node`` holds? A kill or a
    stop of that node, or a fault of the broker's server (the limiter's Redis, when the
    limiter has one, holds no message; a ``SCRIPT FLUSH`` drops no connection)."""
    if fault.target.startswith("node"):
        return bool(fault.target == node)
    return fault.target in ("broker", "rabbitmq") and fault.kind != "script_flush"


def _gap_causes(ordered: list[tuple[float, Any]], gap_at: dict[str, float]) -> Counter[str]:
    """The class of the fault each loss in kombu's gap is put down to: the latest that
    began before it (1 s of slack) and was going on, or ended at most :data:`CAUSE` s
    before it."""
    lost: Counter[str] = Counter()
    for at in gap_at.values():
        near = [f.kind for when, f in ordered if when - 1.0 <= at <= when + f.hold + CAUSE]
        lost[near[-1] if near else "none found"] += 1
    return lost


#: the commands of a Redis broker's AOF that push a message onto a queue, and record
#: one delivered (kombu's QoS: ``HSET unacked <tag> <message>``)
_PUSHES = (b"LPUSH", b"RPUSH")
_DELIVERED = b"HSET"


def _aof_files(data_dir: Path) -> list[Path]:
    """The append-only files of a server's data directory, in order: Redis 7's
    ``appendonlydir`` (its base, then its increments; an RDB base is empty, the soak's
    servers never rewrite), or 6.2's one ``appendonly.aof``."""
    folder = data_dir / "appendonlydir"
    manifest = folder / "appendonly.aof.manifest"
    if manifest.exists():
        names = [line.split()[1] for line in manifest.read_text().split("\n") if line]
        return [folder / name for name in names if name.endswith(".aof")]
    return [data_dir / "appendonly.aof"] if (data_dir / "appendonly.aof").exists() else []


def _aof_commands(files: list[Path]) -> Any:
    """Each command (a list of its arguments, bytes) of the append-only ``files``."""
    for path in files:
        data = path.read_bytes()
        i, end = 0, len(data)
        while i < end:
            if data[i : i + 1] != b"*":  # an annotation line
                i = data.index(b"\n", i) + 1
                continue
            j = data.index(b"\r\n", i)
            count, i = int(data[i + 1 : j]), j + 2
            args = []
            for _ in range(count):
                j = data.index(b"\r\n", i)
                size, i = int(data[i + 1 : j]), j + 2
                args.append(data[i : i + size])
                i += size + 2
            yield args


def popped_unseen(aof: Path, ids: set[str]) -> set[str]:
    """Those of ``ids`` whose message the broker's AOF (in its data directory ``aof``)
    shows pushed onto a queue with no delivery recorded after the last push."""
    files = _aof_files(aof)
    if not ids or not files:
        return set()
    wanted = re.compile("|".join(re.escape(i) for i in sorted(ids)).encode())
    pushed: dict[str, int] = {}
    delivered: dict[str, int] = {}
    for n, args in enumerate(_aof_commands(files)):
        name = args[0].upper() if args else b""
        if name not in _PUSHES and not (name == _DELIVERED and args[1:2] == [b"unacked"]):
            continue
        for match in wanted.finditer(b" ".join(args[1:])):
            task_id = match.group().decode()
            (pushed if name in _PUSHES else delivered)[task_id] = n
    return {i for i, n in pushed.items() if delivered.get(i, -1) < n}


def queued_ids(client: Any) -> frozenset[str]:
    """The ids of the task messages a Redis broker still holds: in a queue or unacked."""
    found: set[str] = set()
    for raw in client.scan_iter(count=500):
        key, kind = raw.decode(), client.type(raw).decode()
        if kind == "list" and not key.startswith("_kombu"):
            payloads = client.lrange(raw, 0, -1)
        elif key == "unacked" and kind == "hash":
            payloads = client.hvals(raw)
        else:
            continue
        for payload in payloads:
            found.update(_MESSAGE_ID.findall(payload.decode("utf-8", "replace")))
    return frozenset(found)


#: a task message's id in its headers (Celery's message protocol 2)
_MESSAGE_ID = re.compile(r'[{,] ?"id": "([0-9a-f-]{36})"')


class Fifo:
    """The broker's queue as the logs show it: every hand-off of a message (a send, a
    node's deferred copy, a mover's publish of a parked one), every receipt, and every
    loss of a node's broker connection or kill -9. The queue is a FIFO list, so the
    messages handed over just before and just after a message were taken in about when
    it was popped; a popped message is lost with a connection that had not read it
    (kombu's gap)."""

    def __init__(self, sent: dict[str, float], lines: list[str], kills: list[float]) -> None:
        self.handed: dict[str, list[float]] = defaultdict(list)
        for i, when in sent.items():
            self.handed[i].append(when)
        for pattern in (_PUBLISHED, _DEFERRED):
            for i, stamps in _stamps(lines, pattern).items():
                self.handed[i] += stamps
        self.order = sorted((when, i) for i, stamps in self.handed.items() for when in stamps)
        self.times = [when for when, _ in self.order]
        self.receipts = {i: sorted(stamps) for i, stamps in _stamps(lines, _RECEIVED).items()}
        self.lost_at = sorted(
            [(when, "a connection lost") for when in _drops(lines)]
            + [(k, "a kill -9") for k in kills]
        )

    def span(self, i: str) -> tuple[float, float, float] | None:
        """``i``'s last hand-off, and when the nearest messages handed over before and
        after it were taken in (of those taken in after their hand-off): about when
        ``i`` was popped; None without such a neighbour."""
        if not self.handed.get(i):
            return None
        last = max(self.handed[i])
        at = bisect.bisect_left(self.times, last)
        taken = []
        for side in (range(at - 1, -1, -1), range(at, len(self.order))):
            for n in side:
                when, j = self.order[n]
                receipts = self.receipts.get(j, [])
                after = bisect.bisect_left(receipts, when)
                if j != i and after < len(receipts):
                    taken.append(receipts[after])
                    break
        return (last, min(taken), max(taken)) if taken else None

    def drops(self, first: float, end: float) -> Counter[str]:
        """The connection losses and kills -9 from :data:`LATE` s before ``first`` to as
        long after ``end``."""
        return Counter(what for when, what in self.lost_at if first - LATE <= when <= end + LATE)

    def trace(self, lost: list[str]) -> list[str]:
        """A line for each of ``lost``: when its neighbours were taken in, and what was
        lost or killed then."""
        out = []
        for i in lost:
            span = self.span(i)
            if span is None:
                out.append(f"  {i}: no neighbour taken in")
                continue
            last, first, end = span
            near = self.drops(first, end)
            out.append(
                f"  {i}: its neighbours taken in {first - last:+.1f}..{end - last:+.1f} s after "
                f"its hand-off; then {dict(near) or 'no connection lost, no kill'}"
            )
        return out


def _drops(lines: list[str]) -> list[float]:
    """The epoch seconds (by the log's clock) of each loss of a broker connection."""
    found = []
    for line in lines:
        if match := _DROPPED.search(line):
            when = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            found.append(when.timestamp())
    return found


def held(client: Any, prefix: str) -> list[str]:
    """What the limiter's Redis still holds under ``prefix`` once idle (past every
    window, lease and claim): reservations, concurrency holders, waiters and turns,
    handoff lists, fair queues, parked copies and claims, and any key without an
    expiry. A sorted set's meta members (scored below 10**13, docs/storage.md: a log's
    totals, a holders set's average hold) are not entries, nor is a concurrency holder
    whose lease has run out (its slot is free: the key's next decision sweeps it, a
    node killed mid-body leaves one) or that holder's start; the park's counts (a
    monitoring hash) and wake-up list may stay, and the indexes of paused and overridden
    keys hold only until their entries lapse."""
    left = []
    seconds, micros = client.time()
    now = seconds * 1_000_000 + micros
    for raw in client.scan_iter(match=f"{prefix}:*", count=500):
        key = raw.decode()
        if key.endswith((":counts", ":wake")) and "{park:" in key:
            continue  # a monitoring hash; a mover's wake-up (one item, lapsing)
        kind = client.type(raw).decode()
        ttl = client.pttl(raw)
        if key.endswith(("{index}:paused", "{index}:overrides")):
            # the metrics' indexes: an entry lapses when its pause or override ends
            size = client.zcount(raw, f"({time.time() * 1e6}", "+inf")
            if size or ttl == -1:
                left.append(f"{key} ({kind}, {size} in force, ttl {ttl} ms)")
            continue
        if key.endswith(":conc:0"):
            size = client.zcount(raw, f"({now}", "+inf")  # leases still running
        elif key.endswith(":conc:0:s"):
            # the starts of holders whose lease still runs, or that have no holder
            holders = dict(client.zrange(raw[:-2], 0, -1, withscores=True))
            starts = client.zrange(raw, 0, -1)
            size = sum(1 for t in starts if holders.get(t, now + 1) > now)
        else:
            size = {
                "zset": lambda k: client.zcount(k, META, "+inf"),
                "hash": client.hlen,
                "list": client.llen,
                "set": client.scard,
            }.get(kind, lambda _: 1)(raw)
        if size or ttl == -1:
            left.append(f"{key} ({kind}, {size} entries, ttl {ttl} ms)")
    return left


def broker_leftovers(client: Any) -> list[str]:
    """Messages a Redis broker still has once the soak is idle: in its queues, unacked,
    or waiting in its ``unacked_index``. Not the replies to pings that came after their
    ping's timeout (a ``*.reply.celery.pidbox`` list: no task)."""
    left = []
    for raw in client.scan_iter(count=500):
        key = raw.decode()
        kind = client.type(raw).decode()
        if key.endswith(".reply.celery.pidbox"):
            continue
        if kind == "list" and not key.startswith("_kombu") and client.llen(raw):
            left.append(f"queue {key}: {client.llen(raw)}")
        elif key in ("unacked", "unacked_index") and (
            client.hlen(raw) if kind == "hash" else client.zcard(raw)
        ):
            left.append(f"{key}: {client.hlen(raw) if kind == 'hash' else client.zcard(raw)}")
    return left
