"""The Grafana dashboard (infra/grafana/stoker.json) and the alert rules (infra/prometheus/stoker-alerts.yml).

- The rules pass `promtool check rules`, and `promtool test rules` with
  tests/infra/fixtures/stoker-alerts.test.yml (alerts firing, and not, on scripted series).
- Every metric name in every dashboard query and every rule expression is one the platform really
  exports: read from a real `stoker up` with the tiny model deployed and one request answered
  (`/metrics`, and `/metrics/engines` for the CPU engine's `vllm:` families), from the families
  vLLM's CPU build exports (fixtures/vllm_cpu_metric_names.txt, captured by
  fixtures/capture_vllm_metric_names.py), from the NVML collector's names (registered only where
  a GPU is: tests/platform/node/test_gpu_metrics.py pins them) and Prometheus's own `up`. The cost
  panels' `stoker_cost_usd_total` and `stoker_tokens_total` are the platform's own (`stoker.control.cost`).
- The dashboard's shape: every panel has a query, ids are unique, the data source is a variable.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from stoker.node.gpu_metrics import GPU_METRICS
from tests.conftest import promtool
from tests.deadlines import CLI, deadline
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "infra" / "grafana" / "stoker.json"
RULES = REPO / "infra" / "prometheus" / "stoker-alerts.yml"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
RULE_TESTS = FIXTURES / "stoker-alerts.test.yml"
VLLM_NAMES = FIXTURES / "vllm_cpu_metric_names.txt"
ADMIN = "sk-admin-dashboards-test"

PROMETHEUS_OWN = frozenset({"up"})  # the scrape's own series, for "no gateway answers"

# ---- PromQL: the metric names an expression reads ----------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")  # label matchers (strings are gone by then)
_RANGE = re.compile(r"\[[^\]]*\]")  # [5m], [$__rate_interval], subqueries' [1h:1m]
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring"}
)
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,")


def metric_names(expr: str) -> set[str]:
    """The series an expression selects: identifiers left once strings, label matchers, ranges and
    label lists (`by (…)`, `on (…)`, …) are cut out, less function calls and keywords."""
    if templated := _LABEL_VALUES.match(expr.strip()):  # Grafana's variable query: label_values(m, l)
        return {templated.group(1)}
    names: set[str] = set()
    text = _GROUPING.sub(" ", _RANGE.sub(" ", _BRACES.sub(" ", _STRING.sub('""', expr))))
    for m in _IDENT.finditer(text):
        name, call = m.groups()
        if not call and name not in _KEYWORDS:
            names.add(name)
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (deployment) (rate(stoker_requests_total{code=~"5.."}[5m]))', {"stoker_requests_total"}),
        (
            'histogram_quantile(0.99, sum by (le, deployment) (rate(vllm:time_to_first_token_seconds_bucket{deployment=~"$d"}[$__rate_interval])))',
            {"vllm:time_to_first_token_seconds_bucket"},
        ),
        ("a / on (x) group_left (y) b * 1e6 > bool 0.5", {"a", "b"}),
        ('absent(up{job="stoker-gateway"} == 1)', {"up"}),
        ("sum(rate(x_total[1h] offset 5m)) unless y", {"x_total", "y"}),
        ("label_values(stoker_instances, deployment)", {"stoker_instances"}),
        ('max(z{a="sum(w)"})', {"z"}),
    ],
)
def test_metric_names_are_read_out_of_promql(expr, names):
    assert metric_names(expr) == names


def dashboard_exprs() -> list[str]:
    out: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "datasource":  # the data source variable: its query names a kind
                return
            for k, v in node.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    out.append(v)
                elif k == "query" and isinstance(v, str):
                    out.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(DASHBOARD.read_text()))
    return out


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


# ---- what the platform exports -------------------------------------------------------------------


def sample_names(text: str) -> set[str]:
    """The sample names a Prometheus text page declares (from `# TYPE`), samples or not yet."""
    out: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("# TYPE "):
            continue
        _, _, name, kind = line.split(None, 3)
        if kind == "counter":
            base = name.removesuffix("_total")
            out |= {base + "_total", base + "_created"}
        elif kind == "histogram":
            out |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
        elif kind == "summary":
            out |= {name, *(name + s for s in ("_sum", "_count", "_created"))}
        elif kind == "info":
            out.add(name + "_info")
        else:
            out.add(name)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir) -> set[str]:
    """Every name a real platform exports once a deployment has started and answered."""
    home = tmp_path_factory.mktemp("dashboards") / "home"
    p = PlatformProcess(home, free_port(), ("--stable-window", "2"), extra_env={"STOKER_ADMIN_KEY": ADMIN})
    p.start()
    try:
        p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
        headers = {"authorization": f"Bearer {ADMIN}"}
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4}
        answer = httpx.post(f"{p.url}/v1/completions", json=body, headers=headers, timeout=deadline(300))
        assert answer.status_code == 200, answer.text
        platform = httpx.get(f"{p.url}/metrics", headers=headers, timeout=deadline(30)).text
        engines = httpx.get(f"{p.url}/metrics/engines", headers=headers, timeout=deadline(30)).text
    finally:
        p.stop()
    names = sample_names(platform) | sample_names(engines)
    assert "stoker_requests_total" in names and "vllm:kv_cache_usage_perc" in names  # both pages read
    return names


def vllm_names() -> set[str]:
    return {line for line in VLLM_NAMES.read_text().splitlines() if line and not line.startswith("#")}


def test_every_metric_in_the_dashboard_and_the_rules_is_exported(exported):
    known = exported | vllm_names() | set(GPU_METRICS) | PROMETHEUS_OWN
    used = {
        "dashboard": {n for e in dashboard_exprs() for n in metric_names(e)},
        "rules": {n for e in rule_exprs() for n in metric_names(e)},
    }
    for where, names in used.items():
        assert names, where
        assert names <= known, f"{where} uses metrics nothing exports: {sorted(names - known)}"
    # The panels the issue asks for read what they should.
    dash = used["dashboard"]
    for name in (
        "stoker_request_ttft_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket",
        "stoker_queue_length",
        "stoker_cold_start_seconds_bucket",
        "stoker_instances",
        "stoker_scaler_forecast_requests_per_second",
        "vllm:kv_cache_usage_perc",
        "stoker_cost_usd_total",
        "stoker_tokens_total",
        "stoker_revision_requests_total",
        "stoker_revision_first_byte_seconds_bucket",
        "stoker_revision_traffic_percent",
        *GPU_METRICS,
    ):
        assert name in dash, name


def test_the_vllm_fixture_holds_the_families_the_cpu_engine_mirrors(exported):
    """The captured vLLM names and the CPU engine's `vllm:` families agree where the engine mirrors
    vLLM (`stoker.engine.metrics`): a stale or truncated fixture fails here."""
    mirrored = {n for n in exported if n.startswith("vllm:") and not n.endswith("_created")}
    captured = vllm_names()
    assert len(captured) > 50
    assert mirrored <= captured, sorted(mirrored - captured)


# ---- the dashboard's shape and the rules under promtool ----------------------------------------


def test_the_dashboard_is_a_grafana_dashboard_with_a_query_on_every_panel():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] == "Stoker"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 30
    for p in graphs:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        box = p["gridPos"]
        assert 0 <= box["x"] and box["x"] + box["w"] <= 24, p["title"]


needs_promtool = pytest.mark.skipif(
    promtool() is None and not os.environ.get("CI"),  # in CI `make test` fetches it: there it must run
    reason="promtool not found: `make test` fetches it into .tools/",
)


@needs_promtool
def test_the_rules_pass_promtool_check():
    assert promtool(), "promtool not found: `make test` fetches it into .tools/"
    out = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=CLI
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"SUCCESS: (\d+) rules found", out.stdout)


@needs_promtool
def test_the_rules_pass_their_unit_tests():
    assert promtool(), "promtool not found: `make test` fetches it into .tools/"
    out = subprocess.run(
        [promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=CLI
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert {"StokerHighErrorRate", "StokerCanaryRolledBack", "StokerDeploymentUnavailable"} <= tested
