"""The chart's Grafana dashboard: every metric its PromQL names is one the services export
(read from their own metric classes' registries), and ``helm template`` renders its ConfigMap
only when ``grafana.dashboard.enabled``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "agentserving"
DASHBOARD = CHART / "dashboards" / "agentserving.json"

# PromQL words that are not metric names
_PROMQL = {"sum", "rate", "irate", "increase", "by", "without", "histogram_quantile", "scalar",
           "avg", "max", "min", "count", "topk", "bottomk", "on", "ignoring", "group_left",
           "group_right", "and", "or", "unless", "offset", "bool", "clamp_min", "clamp_max",
           "vector", "label_values", "abs", "delta", "deriv"}


def exported_series() -> set[str]:
    """Every series name the worker, proxy and kvindex metric classes can export."""
    from agentserving.engine.metrics import WorkerMetrics
    from agentserving.kvindex.http_apis.deps import ServiceMetrics
    from agentserving.proxy.metrics import ProxyMetrics

    registries = [WorkerMetrics().registry]
    for cls in (ProxyMetrics, ServiceMetrics):
        r = CollectorRegistry()
        cls(r)
        registries.append(r)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                "gauge": ("",), "summary": ("_count", "_sum")}
    out: set[str] = set()
    for r in registries:
        for family in r.collect():
            out |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges, grouping lists and
    strings dropped; function calls and keywords skipped)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if m.group() not in _PROMQL and not rest.startswith("("):
            names.add(m.group())
    return names


def _exprs(dashboard: dict) -> list[str]:
    out = []
    for panel in dashboard["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    out += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def test_metric_names_are_read_from_promql() -> None:
    assert metric_names('histogram_quantile(0.95, sum by (le) (rate(proxy_ttft_seconds_bucket'
                        '{pod=~"$pod"}[$__rate_interval])))') == {"proxy_ttft_seconds_bucket"}
    assert metric_names("sum by (pod) (rate(a_total[5m])) / scalar(sum(b))") == {"a_total", "b"}


def test_every_dashboard_metric_is_exported_by_a_service() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series()
    used: set[str] = set()
    for expr in _exprs(dashboard):
        names = metric_names(expr)
        if expr.startswith("label_values("):  # label_values(metric, label)
            names = {expr[len("label_values("):].split(",")[0].strip()}
        assert names, expr
        used |= names
    assert used - exported == set(), f"not exported by any service: {sorted(used - exported)}"
    # the panels the dashboard promises
    for metric in ("agentserving_worker_cached_tokens_total",
                   "agentserving_worker_prompt_tokens_total", "agentserving_worker_kv_bytes",
                   "proxy_ttft_seconds_bucket", "proxy_request_seconds_bucket",
                   "proxy_routing_decisions_total", "kvindex_lookups_total"):
        assert metric in used, metric
    # grouping and variables use labels the metrics carry
    text = json.dumps(dashboard)
    assert "sum by (tenant, tier)" in text and "sum by (pod, tier)" in text


def _helm() -> Path:
    cache = Path(os.environ.get("AGENTSERVING_K8S_CACHE", Path.home() / ".cache" / "agentserving"))
    tools = Path(os.environ.get("AGENTSERVING_K8S_TOOLS", cache / "tools-current" / "bin"))
    helm = tools / "helm"
    if not helm.exists():
        pytest.skip(f"no helm at {helm} (scripts build it; AGENTSERVING_K8S_TOOLS)")
    return helm


def _render(*sets: str) -> list[dict]:
    args = [str(_helm()), "template", "r", str(CHART), "--namespace", "obs"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _dashboards(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ConfigMap"
            and "agentserving.json" in (d.get("data") or {})]


def test_chart_renders_the_dashboard_configmap_only_when_enabled() -> None:
    assert _dashboards(_render()) == []  # off by default
    (cm,) = _dashboards(_render("grafana.dashboard.enabled=true"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "obs"
    assert json.loads(cm["data"]["agentserving.json"]) == json.loads(DASHBOARD.read_text())
    (cm,) = _dashboards(_render("grafana.dashboard.enabled=true",
                                "grafana.dashboard.namespace=monitoring",
                                "grafana.dashboard.annotations.grafana_folder=AgentServing"))
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "AgentServing"}
