"""Multi-region quota ingestion: eight regional jobs share one API quota, in seconds.

The situation (background: a trending-video site ingesting 8 regions from the YouTube
Data API): one API key has 10,000 units a day; ``videos.list`` costs 1 unit and
``search.list`` costs 100. All eight regional jobs spend from the same key, so they
share one budget per key (``yt:quota:{api_key}``), kept at 9,500 to leave headroom for
manual use. On top of it, ``search.list`` has a dedicated cap
(``yt:search:{api_key}``), because a pagination bug once burned 4,000 units in ten
minutes. Both limits are checked in one script, all or nothing, and they share the
Redis Cluster hash tag ``yt:<api_key>`` (the key's first and last segments),
so both keys sit in one slot, a slot per API key.

The API's daily quota resets at midnight Pacific Time (its Quota Calculator page), so
the real declaration is a calendar day in that zone:
``Limit("9500/d", key=..., align="America/Los_Angeles")`` (``YT_CALENDAR=day``); a
sliding day would hold back units the API has already given back. A demo cannot wait
for midnight: ``YT_CALENDAR=minute`` makes the "day" a minute of the Pacific clock (the
run takes until the next minute or two), and by default time is scaled instead, a
"day" lasting ``YT_DAY_SECONDS`` seconds (default 4, a sliding window: a calendar
window cannot be shortened). The search cap's "hour" is a 24th of the "day".

Run it (a Redis on localhost, or the URLs below)::

    celery -A examples.quota_ingestion worker -c 4 -n a@%h &
    celery -A examples.quota_ingestion worker -c 4 -n b@%h &
    python -m examples.quota_ingestion

Environment: ``CELERY_BROKER_URL`` (default ``redis://localhost:6379/1``),
``RATELIMIT_REDIS_URL`` (default ``redis://localhost:6379/0``), ``YT_CALENDAR``,
``YT_DAY_SECONDS``, ``YT_SEARCHES`` and ``YT_PAGES`` (calls per region).
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import redis
from celery import Celery

from celery_ratelimit import Limit, Rate, RateLimitedTask
from examples.harness import wait_for_records

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/1")
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://localhost:6379/0")
CALENDAR = os.environ.get("YT_CALENDAR", "")  # "day", "minute" or "" (scaled)
PACIFIC = ZoneInfo("America/Los_Angeles")  # where the API's day begins and ends
DAY_US = {"day": 86_400_000_000, "minute": 60_000_000}.get(
    CALENDAR, int(float(os.environ.get("YT_DAY_SECONDS", "4")) * 1_000_000)
)
SEARCHES = int(os.environ.get("YT_SEARCHES", "15"))  # search.list calls per region
PAGES = int(os.environ.get("YT_PAGES", "25"))  # videos.list pages per region

REGIONS = ("US", "GB", "DE", "FR", "IN", "BR", "AU", "CA")
API_KEY = "key1"
COSTS = {"search.list": 100, "videos.list": 1}
QUOTA_UNITS = 9_500  # of 10,000: the limiter must run out before Google does
SEARCH_CAP = 25  # search.list calls per scaled hour
RUNS = "example:yt:runs"  # where each execution records itself (for the report)

#: The shared daily quota, in units, for every call made with one API key: a calendar
#: day (or minute) of the Pacific clock, or a scaled sliding "day".
QUOTA = Rate(QUOTA_UNITS, DAY_US)
ALIGN = "America/Los_Angeles" if CALENDAR else None
#: The dedicated cap on the expensive call, in calls.
SEARCH_HOURLY = Rate(SEARCH_CAP, DAY_US // 24)

app = Celery("quota_ingestion", broker=BROKER_URL)
app.conf.update(
    ratelimit_redis_url=REDIS_URL,
    ratelimit_key_prefix="example",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_client: redis.Redis | None = None


def _record(task: Any, endpoint: str, region: str) -> None:
    """Append (grant time by Redis's clock, endpoint, region) to the run log."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS_URL)
    decision = task.request.ratelimit_decision
    _client.rpush(RUNS, f"{int(decision.at * 1_000_000)} {endpoint} {region}")


@app.task(
    base=RateLimitedTask,
    bind=True,
    ratelimit=Limit(QUOTA, key="yt:quota:{api_key}", cost=COSTS["videos.list"], align=ALIGN),
)
def videos_list(self: Any, api_key: str, region: str, page: int) -> None:
    """One page of a region's trending videos (videos.list: 1 unit)."""
    _record(self, "videos.list", region)


@app.task(
    base=RateLimitedTask,
    bind=True,
    ratelimit=[
        Limit(QUOTA, key="yt:quota:{api_key}", cost=COSTS["search.list"], align=ALIGN),
        Limit(SEARCH_HOURLY, key="yt:search:{api_key}"),
    ],
)
def search_list(self: Any, api_key: str, region: str, query: str) -> None:
    """One search in a region (search.list: 100 units, and one call of the cap)."""
    _record(self, "search.list", region)


def regional_job(region: str) -> int:
    """What one region's cron job sends: its searches and its pages. Returns the count."""
    for i in range(SEARCHES):
        search_list.delay(API_KEY, region, f"trending {i}")
    for page in range(PAGES):
        videos_list.delay(API_KEY, region, page)
    return SEARCHES + PAGES


def _max_in_window(points: list[tuple[int, int]], window: int) -> int:
    """Most weight inside any sliding window (t - window, t]."""
    points = sorted(points)
    best = total = start = 0
    for t, weight in points:
        total += weight
        while points[start][0] <= t - window:
            total -= points[start][1]
            start += 1
        best = max(best, total)
    return best


def lines_head(day: int) -> list[str]:
    what = f"{CALENDAR} of the Pacific clock" if CALENDAR else f"scaled day ({day / 1e6:g}s)"
    return [
        f"quota {QUOTA_UNITS} units per {what}; search.list capped at "
        f"{SEARCH_CAP} calls per scaled hour ({SEARCH_HOURLY.window:.3f}s)",
    ]


def _calendar_report(
    units: list[tuple[int, int]], searches: list[tuple[int, int]], lines: list[str]
) -> list[str]:
    """Units spent in each calendar window of the Pacific clock against the quota."""
    spent: dict[str, int] = {}
    for t, weight in sorted(units):
        local = datetime.fromtimestamp(t / 1e6, PACIFIC)
        label = local.strftime("%Y-%m-%d" if CALENDAR == "day" else "%Y-%m-%d %H:%M %Z")
        spent[label] = spent.get(label, 0) + weight
    lines += [
        f"{CALENDAR} {label}  {n:6d} units spent   (quota {QUOTA_UNITS})"
        for label, n in spent.items()
    ]
    most_search = _max_in_window(searches, SEARCH_HOURLY.window_us)
    held = max(spent.values()) <= QUOTA_UNITS and most_search <= SEARCH_CAP
    lines += [
        f"most units in one calendar {CALENDAR:6}   {max(spent.values())} / {QUOTA_UNITS}",
        f"most search.list in any sliding hour {most_search} / {SEARCH_CAP}",
        "result: " + ("the quota held" if held else "THE QUOTA WAS EXCEEDED"),
    ]
    return lines


def report(runs: list[tuple[int, str, str]]) -> list[str]:
    """Units spent per scaled day against the quota, and the sliding-window maxima."""
    units = [(t, COSTS[endpoint]) for t, endpoint, _ in runs]
    searches = [(t, 1) for t, endpoint, _ in runs if endpoint == "search.list"]
    first = min(t for t, _ in units)
    day = QUOTA.window_us
    lines = [
        *lines_head(day),
        f"executed {len(searches)} search.list x 100 + {len(units) - len(searches)} "
        f"videos.list x 1 = {sum(w for _, w in units)} units, from {len(REGIONS)} regions",
    ]
    if CALENDAR:
        return _calendar_report(units, searches, lines)
    days = (max(t for t, _ in units) - first) // day + 1
    for k in range(days):
        lo = first + k * day
        spent = sum(w for t, w in units if lo <= t < lo + day)
        lines.append(
            f"day {k + 1}  [{k * day / 1e6:6.2f}s, {(k + 1) * day / 1e6:6.2f}s)  "
            f"{spent:6d} units spent   (quota {QUOTA_UNITS})"
        )
    most = _max_in_window(units, day)
    most_search = _max_in_window(searches, SEARCH_HOURLY.window_us)
    lines += [
        f"most units in any sliding day        {most} / {QUOTA_UNITS}",
        f"most search.list in any sliding hour {most_search} / {SEARCH_CAP}",
        "result: "
        + (
            "the quota held"
            if most <= QUOTA_UNITS and most_search <= SEARCH_CAP
            else "THE QUOTA WAS EXCEEDED"
        ),
    ]
    return lines


def main(timeout: float = 120.0) -> int:
    """Send the eight regional jobs, wait for every call, print the report."""
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(RUNS)
    total = sum(regional_job(region) for region in REGIONS)
    print(f"sent {total} calls from {len(REGIONS)} regional jobs; waiting for the workers")
    if not wait_for_records(client, RUNS, total, timeout):
        return 1
    runs = []
    for raw in client.lrange(RUNS, 0, -1):
        t, endpoint, region = raw.decode().split()  # type: ignore[union-attr]
        runs.append((int(t), endpoint, region))
    print("\n".join(report(runs)))
    return 0 if "held" in report(runs)[-1] else 1


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: task names come from the module name.
    from examples.quota_ingestion import main as _main

    sys.exit(_main())
