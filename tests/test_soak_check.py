"""The soak's verdict reads the Redis broker's append-only file: a message pushed onto a
queue and popped with no delivery recorded after (kombu's ``BRPOP`` gap) is told apart
from one delivered, on a real redis-server's AOF; what the limiter's Redis still holds
counts a concurrency slot while its lease runs, not after (``benchmarks.soak_check``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.soak_check import held, popped_unseen, queued_ids
from celery_ratelimit import Concurrency, Limiter
from tests.redis_server import RedisServer


def message(task_id: str) -> str:
    """A task message as kombu pushes it (Celery's protocol 2: the id in its headers)."""
    return json.dumps({"body": "e30=", "headers": {"id": task_id, "root_id": "r" * 36}})


def test_a_pop_without_a_delivery_is_told_from_a_delivered_or_waiting_message() -> None:
    ids = [f"{n:08d}-0000-0000-0000-000000000000" for n in range(4)]
    lost, delivered, redelivered, waiting = ids
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always")
    try:
        client = server.client()
        for task_id in (lost, delivered, redelivered):
            client.lpush("celery", message(task_id))
            client.rpop("celery")  # a consumer's BRPOP, as Redis logs it
        for task_id in (delivered, redelivered):
            tag = f"tag-{task_id[:8]}"
            client.hset("unacked", tag, json.dumps([json.loads(message(task_id)), "", "celery"]))
        client.rpush("celery", message(redelivered))  # given back at a node's shutdown...
        client.rpop("celery")
        client.hset("unacked", "tag-again", json.dumps([json.loads(message(redelivered))]))
        client.lpush("celery", message(waiting))  # ...and one still in the queue
        assert queued_ids(client) >= {waiting, delivered, redelivered}
        assert lost not in queued_ids(client)
        time.sleep(0.1)
        data = Path(server.dir)
        assert popped_unseen(data, set(ids)) == {lost, waiting}
        assert popped_unseen(data, set(ids)) - queued_ids(client) == {lost}
        assert popped_unseen(data, {delivered}) == set()
    finally:
        server.close()


def test_a_slot_is_held_while_its_lease_runs_and_not_after() -> None:
    """A body killed mid-run leaves its slot to lapse: held (its holder and its start)
    until the lease runs out, then not (the key's next decision sweeps it)."""
    server = RedisServer()
    try:
        limiter = Limiter(server.client(), prefix="soakcheck")
        assert limiter.acquire("k", Concurrency(1), lease=0.5).allowed
        assert sorted(line.split(" ")[0] for line in held(server.client(), "soakcheck")) == [
            "soakcheck:{k}:conc:0",
            "soakcheck:{k}:conc:0:s",
        ]
        time.sleep(0.6)
        assert held(server.client(), "soakcheck") == []
        assert limiter.acquire("k", Concurrency(1), lease=30).allowed  # it was free
        assert len(held(server.client(), "soakcheck")) == 2
    finally:
        server.close()
