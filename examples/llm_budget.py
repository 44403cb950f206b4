"""An LLM API whose plan is lower than the limits declared: the workers follow the
budget it reports on every answer.

The LLM (simulated here by a small HTTP server the producer starts) allows
``LLM_RPS`` requests and ``LLM_TPS`` tokens in any second. As the big providers do, it
counts a request's prompt plus its ``max_tokens`` when it arrives, gives back what the
completion did not use when it answers, and reports what is left on every answer:
``x-ratelimit-limit/remaining/reset-requests`` and ``-tokens`` (resets as ``"250ms"``).
Over a budget it answers 429 with a ``Retry-After``.

The tasks declare twice its budgets (the plan was lowered since the code was written):

- ``Limit(f"{2 * LLM_RPS}/s", key="llm:calls")``: requests (cost 1), which follow the
  ``-requests`` headers;
- ``Limit(f"{2 * LLM_TPS}/s", key="llm:tokens", cost=prompt + max_tokens)``: tokens,
  which follow the ``-tokens`` headers;
- each body calls ``celery_ratelimit.observe(response.headers)`` (every worker now
  knows what the LLM has left) and ``celery_ratelimit.settle(usage)`` (its real tokens).

Run it (a Redis on localhost, or the URLs below)::

    celery -A examples.llm_budget worker -c 4 -n a@%h &
    celery -A examples.llm_budget worker -c 4 -n b@%h &
    python -m examples.llm_budget produce

Environment: ``CELERY_BROKER_URL`` (default ``redis://localhost:6379/1``),
``RATELIMIT_REDIS_URL`` (default ``redis://localhost:6379/0``), ``LLM_PORT`` (8766),
``LLM_RPS`` (8), ``LLM_TPS`` (2000), ``LLM_PROMPTS`` (60).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Any

from celery import Celery

import celery_ratelimit
from celery_ratelimit import Limit, RateLimitedTask, UpstreamRateLimited
from examples.harness import produce_command, serve

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/1")
REDIS_URL = os.environ.get("RATELIMIT_REDIS_URL", "redis://localhost:6379/0")
LLM_PORT = int(os.environ.get("LLM_PORT", "8766"))
LLM_RPS = int(os.environ.get("LLM_RPS", "8"))
LLM_TPS = int(os.environ.get("LLM_TPS", "2000"))
LLM_PROMPTS = int(os.environ.get("LLM_PROMPTS", "60"))
MAX_TOKENS = 200

app = Celery("llm_budget", broker=BROKER_URL)
app.conf.update(
    ratelimit_redis_url=REDIS_URL,
    ratelimit_key_prefix="example-llm",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


def prompt_tokens(i: int) -> int:
    """The tokens of prompt ``i`` (known before the call, as a tokenizer would say)."""
    return 50 + (i * 37) % 150


def asked(i: int) -> int:
    """What the LLM counts a request at when it arrives: its prompt and max_tokens."""
    return prompt_tokens(i) + MAX_TOKENS


@app.task(
    base=RateLimitedTask,
    bind=True,
    ratelimit=[
        Limit(f"{2 * LLM_RPS}/s", key="llm:calls"),
        Limit(f"{2 * LLM_TPS}/s", key="llm:tokens", cost=asked),
    ],
)
def complete(self: Any, i: int) -> int:
    """Ask the LLM to complete prompt ``i``; return the tokens it used."""
    url = f"http://127.0.0.1:{LLM_PORT}/complete?i={i}&task={self.request.id}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            celery_ratelimit.observe(response.headers)
            used = int(json.loads(response.read())["usage"])
    except urllib.error.HTTPError as exc:
        if exc.code != 429:
            raise
        celery_ratelimit.observe(exc.headers)
        raise UpstreamRateLimited(exc.headers.get("Retry-After")) from exc
    celery_ratelimit.settle(used)  # the tokens limit now counts what the call used
    return used


class LLM:
    """The simulated LLM: its sliding budgets, what it answered."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: deque[float] = deque()
        self.tokens: deque[list[float]] = deque()  # [arrival, tokens], refunded in place
        self.answered: dict[str, int] = {}
        self.refused = 0

    def _prune(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - 1:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - 1:
            self.tokens.popleft()

    def _headers(self, now: float) -> dict[str, str]:
        used = sum(t for _, t in self.tokens)
        requests_back = self.requests[0] + 1 - now if self.requests else 0.0
        tokens_back = self.tokens[0][0] + 1 - now if self.tokens else 0.0
        return {
            "x-ratelimit-limit-requests": str(LLM_RPS),
            "x-ratelimit-remaining-requests": str(LLM_RPS - len(self.requests)),
            "x-ratelimit-reset-requests": f"{math.ceil(requests_back * 1000)}ms",
            "x-ratelimit-limit-tokens": str(LLM_TPS),
            "x-ratelimit-remaining-tokens": str(max(LLM_TPS - int(used), 0)),
            "x-ratelimit-reset-tokens": f"{math.ceil(tokens_back * 1000)}ms",
        }

    def handle(self, i: int, task: str) -> tuple[int, dict[str, str], str]:
        with self.lock:
            now = time.time()
            self._prune(now)
            used = sum(t for _, t in self.tokens)
            if len(self.requests) >= LLM_RPS or used + asked(i) > LLM_TPS:
                self.refused += 1
                headers = self._headers(now)
                firsts = [self.requests[0]] if self.requests else []
                firsts += [self.tokens[0][0]] if self.tokens else []
                headers["Retry-After"] = str(math.ceil(min(firsts) + 1 - now))
                return 429, headers, "rate limited"
            self.requests.append(now)
            entry = [now, float(asked(i))]
            self.tokens.append(entry)
        time.sleep(0.05)  # the completion
        usage = prompt_tokens(i) + (i * 53) % MAX_TOKENS
        with self.lock:
            entry[1] = usage  # what max_tokens did not use is given back
            self.answered[task] = self.answered.get(task, 0) + 1
            return 200, self._headers(time.time()), json.dumps({"usage": usage})


def produce(prompts: int, timeout: float = 120.0) -> int:
    """Start the LLM, send ``prompts`` completions, wait until every one is answered,
    and report what the LLM saw."""
    llm = LLM()
    server = serve(LLM_PORT, lambda q: llm.handle(int(q["i"]), q["task"]))
    try:
        ids = {complete.delay(i).id for i in range(prompts)}
        print(f"sent {prompts} prompts; the LLM allows {LLM_RPS}/s and {LLM_TPS} tokens/s")
        deadline = time.monotonic() + timeout
        while not ids <= set(llm.answered):
            if time.monotonic() > deadline:
                print(f"timed out: {len(ids & set(llm.answered))} of {prompts}", file=sys.stderr)
                return 1
            time.sleep(0.1)
        time.sleep(0.5)  # a second answer to one prompt would show now
    finally:
        server.shutdown()
    once = all(llm.answered[i] == 1 for i in ids)
    print(f"prompts answered                 {len(ids & set(llm.answered))} of {prompts}")
    print(f"answered twice                   {sum(n > 1 for n in llm.answered.values())}")
    print(f"429s answered                    {llm.refused}")
    print("result: " + ("every prompt answered once" if once else "A PROMPT WAS LOST OR REPEATED"))
    return 0 if once else 1


main = produce_command(produce, "prompts", LLM_PROMPTS, "start the LLM, send the prompts, report")


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: task names come from the module name.
    from examples.llm_budget import main as _main

    sys.exit(_main())
