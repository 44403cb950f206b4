"""The Grafana dashboard and the Prometheus alert rules of ``contrib/``, against a real
Prometheus scraping a real prefork worker node (served by the recipe of
docs/operations.md): the rules pass ``promtool``, and every panel's query and every
alert's query (its expression less the threshold) returns data once the node has
run tasks that were deferred, met an upstream's 429 and lived through an outage of the
limiter's Redis.

Needs Debian's ``prometheus`` (``prometheus`` and ``promtool`` on PATH); skipped
without it, unless ``CRL_REQUIRE_PROMETHEUS=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.metrics_nodes import metrics_node
from tests.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "contrib" / "prometheus" / "celery-ratelimit-rules.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "celery-ratelimit.json"

pytest.importorskip("prometheus_client")
if not (shutil.which("prometheus") and shutil.which("promtool")):
    if os.environ.get("CRL_REQUIRE_PROMETHEUS") == "1":
        raise RuntimeError("CRL_REQUIRE_PROMETHEUS=1 but prometheus/promtool are not on PATH")
    pytest.skip(
        "needs prometheus and promtool on PATH (apt-get install prometheus)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.celery


def panel_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def alert_queries() -> list[str]:
    """Each alert's expression less its threshold (``<query> > <threshold>``)."""
    text = RULES.read_text()
    exprs = re.findall(r"expr: (?:>-\n)?((?:.+\n)+?)\s+(?:for|labels):", text)
    queries = []
    for expr in exprs:
        joined = " ".join(line.strip() for line in expr.splitlines())
        query, _, threshold = joined.rpartition(" > ")
        assert query and threshold.strip().replace(".", "").isdigit(), joined
        queries.append(query)
    return queries


def test_the_alert_rules_pass_promtool() -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(alert_queries()) == 4


@pytest.fixture
def node(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A prefork node of tests.apps.metrics_node, its broker and its limiter's Redis
    apart (the limiter's can be stopped while the broker stays up)."""
    broker, limiter = RedisServer(), RedisServer()
    try:
        with metrics_node(broker.url, limiter.url, tmp_path) as started:
            yield {
                "broker": broker,
                "limiter": limiter,
                "prefix": started.prefix,
                "port": started.port,
                "log": started.log,
            }
    finally:
        broker.close()
        limiter.close()


@pytest.fixture
def prometheus(node: dict[str, Any], tmp_path: Path) -> Iterator[str]:
    """A Prometheus scraping the node every second, the rules loaded; its API URL."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n"
        "  - job_name: celery\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{node['port']}']}}]\n"
    )
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                "prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def query(url: str, expr: str) -> list[Any]:
    encoded = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{encoded}", timeout=10) as reply:
        answer = json.loads(reply.read())
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


def scraped(node: dict[str, Any], name: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{node['port']}/metrics", timeout=10) as r:
        return any(line.startswith(name) for line in r.read().decode().splitlines())


def test_every_panel_and_alert_query_returns_data_from_a_real_worker(
    node: dict[str, Any], prometheus: str
) -> None:
    sender = Celery("dash_sender", broker=node["broker"].url, set_as_current=False)
    runs = node["broker"].client()
    key = f"{node['prefix']}:runs"
    deadline = time.monotonic() + 90

    def wait_runs(count: int) -> None:
        while runs.llen(key) < count:
            assert time.monotonic() < deadline, node["log"].read_text()
            time.sleep(0.1)

    for i in range(8):  # at 4/s: some are deferred on reserved slots
        sender.send_task("tests.apps.metrics_node.call", args=(i,))
    sender.send_task("tests.apps.metrics_node.upstream", args=(0,))  # a 429, then runs
    wait_runs(9)
    node["limiter"].stop()  # an outage of the limiter's Redis: decisions fail
    for i in range(2):
        sender.send_task("tests.apps.metrics_node.call", args=(100 + i,))
    while not scraped(node, "celery_ratelimit_redis_errors_total"):
        assert time.monotonic() < deadline, node["log"].read_text()
        time.sleep(0.2)
    node["limiter"].start()
    wait_runs(11)
    empty = []
    while True:
        empty = [q for q in panel_queries() + alert_queries() if not query(prometheus, q)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)  # a few more scrapes
    assert not empty, empty
