"""infra/grafana/switchyard-dashboard.json queries only metrics Switchyard's services export.

Two checks, because one process cannot tell which service exports what:

* Attribution: each service's entry module is imported in a fresh interpreter (the process `switchyard <service>`
  runs), and its exposition (`generate_latest`, byte for byte what its /metrics serves) is parsed for the series
  names it can carry. Every metric the dashboard queries must be among the union. A fresh process per service,
  not this test process, because here every module any test imported shares one registry. Families appear in the
  exposition (HELP and TYPE lines) from registration on, labelled ones without children too, so registration is
  what decides the name; the samples need traffic, which the second check drives.
* Traffic: a real gateway (deciding in-process with the router's core), the real router service and a stub engine
  on the test nats-server serve one streamed request; the gateway's /metrics, fetched over HTTP, must then carry
  samples for the routing, engine and latency series the dashboard plots, so a panel is not only named right but
  filled. Placement and migration need a database and an EP fleet to act; their services' tests drive them.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchyard.engine_agents.stub import StubConfig
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings
from tests.gateway_helpers import deployment

DASHBOARD = Path(__file__).resolve().parents[1] / "infra" / "grafana" / "switchyard-dashboard.json"

#: The process each service runs, by the module its command imports.
SERVICE_MODULES = {
    "gateway": "switchyard.services.gateway.service",
    "router": "switchyard.services.router.service",
    "placement": "switchyard.services.placement.service",
    "migration": "switchyard.services.migration.service",
}

#: Words that may stand in a PromQL expression unfollowed by "(" and are not metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
#: Series name suffixes each metric type adds to its family name in the text exposition.
_SUFFIXES = {"counter": ("", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL `expr` of every panel target, rows' nested panels included."""
    found: list[str] = []
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        found.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression selects: identifiers that are not functions (followed by "("),
    aggregation keywords, label names (inside {...}, by (...), without (...)), strings, durations or numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: label values, $__rate_interval in quotes
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery windows
    text = re.sub(r"\boffset\s+-?\w+", " ", text)  # offset durations
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    names = set()
    for match in _IDENT.finditer(text):
        name, rest = match.group(), text[match.end() :].lstrip()
        before = text[match.start() - 1 : match.start()]
        if rest.startswith("(") or name in _KEYWORDS or before == "$" or before.isdigit() or before == ".":
            continue
        names.add(name)
    return names


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    return set().union(*(metric_names(e) for e in expressions(dashboard)))


def series_names(exposition: str) -> set[str]:
    """The series names an exposition can carry, from its `# TYPE` lines (labelled families without samples
    have those too)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.update(family + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names


def missing(dashboard: dict[str, Any], exported: set[str]) -> set[str]:
    """Dashboard metrics no service exports (the check; empty when the dashboard is right)."""
    return dashboard_metrics(dashboard) - exported


def service_exposition(module: str) -> str:
    """What a fresh process running `module`'s service serves at /metrics, before any traffic."""
    code = f"import {module}\nfrom prometheus_client import generate_latest\nprint(generate_latest().decode())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return {service: series_names(service_exposition(module)) for service, module in SERVICE_MODULES.items()}


def test_the_tokenizer_finds_metrics_not_functions_or_labels() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, kind) (rate(a_seconds_bucket{kind!="x y"}[$__rate_interval]))) '
        "/ ignoring (engine) sum without (pod) (b_total[5m] offset 1m) * 1e3 + on (job) group_left (role) c"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c"}


def test_every_dashboard_metric_is_exported_by_a_service(
    dashboard: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    queried = dashboard_metrics(dashboard)
    assert len(queried) >= 30  # the tokenizer read the dashboard (an empty set would pass any check)
    assert all(name.startswith("switchyard_") for name in queried), queried
    assert missing(dashboard, set().union(*exported.values())) == set()
    # Each row's metrics come from the service the row is named for.
    assert "switchyard_router_decisions_total" in exported["router"] & exported["gateway"]  # in-process core
    assert "switchyard_router_engine_kv_usage" in exported["router"] & exported["gateway"]
    assert "switchyard_placement_plans_total" in exported["placement"]
    assert "switchyard_migration_steps_total" in exported["migration"]
    assert "switchyard_gateway_time_to_first_token_seconds_bucket" in exported["gateway"]


def test_a_misspelled_metric_fails_the_check(dashboard: dict[str, Any], exported: dict[str, set[str]]) -> None:
    broken = json.loads(json.dumps(dashboard))
    target = next(p for p in broken["panels"] if p.get("title") == "TTFT p50 / p99 by kind")["targets"][0]
    target["expr"] = target["expr"].replace("_to_first_token_seconds_bucket", "_to_frist_token_seconds_bucket")
    assert missing(broken, set().union(*exported.values())) == {"switchyard_gateway_time_to_frist_token_seconds_bucket"}


def samples(exposition: str) -> dict[str, float]:
    """Series name -> sum of its sample values, from a text exposition."""
    totals: dict[str, float] = {}
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


async def test_one_request_fills_the_routing_engine_and_latency_panels(
    bus: Bus, settings: SwitchyardSettings, dashboard: dict[str, Any]
) -> None:
    chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        deployment(settings, bus, [StubConfig("e0", tokens=4, token_interval_s=0.01)], shape="inprocess") as (gw, _),
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
            assert response.status_code == 200
            assert [line async for line in response.aiter_lines()][-2:] == ["data: [DONE]", ""]

        # The core folds decisions and engine gauges into the metrics at housekeeping (every second).
        seen: dict[str, float] = {}

        def folded() -> bool:
            return seen.get("switchyard_router_decision_seconds_count", 0.0) >= 1 and (
                "switchyard_router_engine_kv_usage" in seen
            )

        async with asyncio.timeout(10):  # not a timed assertion: the bound only stops a broken test hanging
            while not folded():
                seen = samples((await client.get("/metrics")).text)
                await asyncio.sleep(0.1)
    plotted = dashboard_metrics(dashboard)
    counted = {  # counters and histograms: the request added to them
        "switchyard_router_decisions_total",
        "switchyard_router_decision_seconds_bucket",
        "switchyard_gateway_requests_total",
        "switchyard_gateway_time_to_first_token_seconds_bucket",
        "switchyard_gateway_inter_token_latency_seconds_bucket",
        "switchyard_gateway_e2e_request_latency_seconds_bucket",
        "switchyard_gateway_prompt_tokens_total",
        "switchyard_gateway_generation_tokens_total",  # the stream's four token events (it carried no usage)
    }
    gauges = {  # one sample per live engine (or role), whatever its value (an idle engine runs 0 requests)
        "switchyard_router_live_engines",
        "switchyard_router_engine_running",
        "switchyard_router_engine_waiting",
        "switchyard_router_engine_inflight",
        "switchyard_router_engine_kv_usage",
        "switchyard_router_engine_expert_pressure",
    }
    assert counted | gauges <= plotted
    assert {name for name in counted if seen.get(name, 0.0) <= 0} == set()
    assert gauges - seen.keys() == set()
    assert seen["switchyard_router_live_engines"] >= 1
    assert seen["switchyard_router_engine_kv_usage"] == pytest.approx(0.1)  # the stub's telemetry
    assert seen["switchyard_router_engine_expert_pressure"] == pytest.approx(1.0)  # balanced (floored at 1)
