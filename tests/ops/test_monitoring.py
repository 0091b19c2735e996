"""deploy/prometheus/alerts.yml and deploy/grafana/queuekeeper.json: the rules pass
`promtool check rules` and their unit tests (`promtool test rules`), and every metric the
rules and the dashboard query is one the service really exports (scraped from a live
/metrics after some traffic) or one of the few documented external ones."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SERVICE_TOKEN
from tests.events.support import order_event, post_event, register
from tests.helpers import Backend, Operator
from tests.ops.tools import require

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "queuekeeper.json"

# Not queuekeeper's: Prometheus' own target health, the blackbox exporter's probe of
# /readyz, and RabbitMQ's rabbitmq_prometheus plugin (/metrics/detailed). Each is named in
# the header of alerts.yml with the scrape set-up it needs.
EXTERNAL = {
    "up",
    "probe_success",
    "rabbitmq_detailed_queue_messages",
    "rabbitmq_detailed_queue_consumers",
}
# The alerts the issue asks for, by what they watch.
REQUIRED_ALERTS = {
    "QueuekeeperOutboxStuck",  # outbox age
    "QueuekeeperOutboxDeep",  # outbox depth
    "QueuekeeperRelayNotPublishing",
    "QueuekeeperDeliveriesGivenUp",
    "QueuekeeperDeliveriesRejected",
    "QueuekeeperReconcileNotSucceeding",  # a scheduled job not succeeding in its interval
    "QueuekeeperStaleCleanupNotSucceeding",
    "QueuekeeperDeadLettersGrowing",
    "QueuekeeperNotReady",
    "QueuekeeperManagementApiErrors",
    "QueuekeeperQueueWithoutConsumer",  # consumers missing on registered queues
    "QueuekeeperAgentAway",  # contract §11: an agent away longer than a threshold
    "QueuekeeperParkedNearingRetention",  # parked copies nearing retention
}

_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label names,
    durations, strings and Grafana variables left out)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def rule_expressions() -> dict[str, str]:
    document: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return {
        rule.get("alert") or rule["record"]: rule["expr"]
        for group in document["groups"]
        for rule in group["rules"]
    }


def dashboard_expressions() -> dict[str, str]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    found: dict[str, str] = {}

    def panels(items: list[dict[str, Any]]) -> None:
        for panel in items:
            for target in panel.get("targets", []):
                found[f"{panel['title']} / {target['refId']}"] = target["expr"]
            panels(panel.get("panels", []))

    panels(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query["query"])
            assert match, variable
            found[f"variable {variable['name']}"] = match.group(1)
    return found


def exported_names(metrics_text: str) -> set[str]:
    """Every sample name the exposition declares: families with no sample yet (a labelled
    counter never incremented) count by their type, as Prometheus would name them."""
    suffixes = {
        "counter": ["_total", "_created"],
        "histogram": ["_bucket", "_count", "_sum", "_created"],
        "summary": ["_count", "_sum", "_created", ""],
        "gauge": [""],
        "info": ["_info"],
    }
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, [""]))
    return names


def test_rules_pass_promtool_check() -> None:
    promtool = require("promtool")
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_expressions())} rules found" in result.stdout


def test_rules_pass_their_unit_tests() -> None:
    promtool = require("promtool")
    result = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        check=False,
        cwd=RULE_TESTS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested >= REQUIRED_ALERTS, REQUIRED_ALERTS - tested


def test_the_alerts_the_operations_guide_promises_exist() -> None:
    assert set(rule_expressions()) >= REQUIRED_ALERTS
    guide = (ROOT / "docs" / "reference" / "monitoring.md").read_text()
    assert "deploy/prometheus/alerts.yml" in guide
    assert "deploy/grafana/queuekeeper.json" in guide


def test_dashboard_is_importable_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "queuekeeper"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_metric_name_extraction() -> None:
    assert metric_names(
        'sum by (le, route) (rate(a_bucket{instance=~"$instance",x="y"}[5m])) / on () b'
        ' and ignoring(x) time() - max(c) > 13 * 3600 or absent(d{job="x"})'
    ) == {"a_bucket", "b", "c", "d"}


async def test_every_metric_queried_is_exported(
    client: httpx.AsyncClient, backend: Backend, operator: Operator
) -> None:
    # Traffic that touches every subsystem: a registration (Management API, create_queue),
    # an event published and confirmed (outbox, relay, AMQP), a job run.
    registered = await register(backend)
    response = await post_event(client, order_event(registered.offering), wait=True)
    assert response.status_code == 200, response.text
    assert response.json()["deliveries"][0]["state"] == "published"
    await operator.reconcile(dry_run=True)
    await client.get(
        "/api/admin/dead-letters/", headers={"Authorization": f"Bearer {SERVICE_TOKEN}"}
    )
    scrape = await client.get("/metrics")
    assert scrape.status_code == 200
    exported = exported_names(scrape.text)
    assert "queuekeeper_deliveries_total" in exported
    assert any(
        sample.name == "queuekeeper_deliveries_total" and sample.labels["outcome"] == "published"
        for family in text_string_to_metric_families(scrape.text)
        for sample in family.samples
    )

    queried = {**{f"rule {k}": v for k, v in rule_expressions().items()}}
    queried.update({f"dashboard {k}": v for k, v in dashboard_expressions().items()})
    unknown = {
        f"{where}: {name}"
        for where, expr in queried.items()
        for name in metric_names(expr)
        if name not in exported and name not in EXTERNAL
    }
    assert unknown == set()
    used = set().union(*(metric_names(expr) for expr in queried.values()))
    # The dashboard and the rules between them look at every queuekeeper metric.
    own = {name for name in exported if name.startswith("queuekeeper_")}
    families = {re.sub(r"_(total|created|bucket|count|sum)$", "", name) for name in own}
    unwatched = {
        family
        for family in families
        if not any(re.sub(r"_(total|bucket|count|sum)$", "", name) == family for name in used)
    }
    assert unwatched == set()
