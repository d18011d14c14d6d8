"""deploy/grafana-shapegate.json queries only metrics (and labels) the gateway exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from gateway.config import LatencyHints
from gateway.contracts import ENGINE_ERROR, OK, LoadSample
from gateway.observe.metrics import Metrics
from gateway.stats.rolling import LatencyModel

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-shapegate.json"
METRIC = re.compile(r"\bshapegate_[a-z0-9_]+")
SELECTOR = re.compile(r"(shapegate_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def exposed() -> dict[str, set[str]]:
    """Every sample name a gateway serves, with its label names, after each metric has moved once."""
    load = SimpleNamespace(running=1.0, waiting=2.0, kv_usage=0.5, at=0.0)
    backend = SimpleNamespace(id="b", engine="vllm", health=SimpleNamespace(state="ready"), in_flight=0,
                              breaker=SimpleNamespace(state=lambda now: "closed"),
                              load=LoadSample(1.0, 2.0, 0.5, at=0.0), fresh_load=lambda now: load,
                              reported=SimpleNamespace(ttft=0.1, itl=0.01),
                              latency=LatencyModel(LatencyHints()))
    m = Metrics(lambda: [backend])
    m.observe("b", "m", "default", 200, 0.01, 0.002, 0.1, 10, 5, 0.0001, OK)
    m.count("b", "m", "default", 500, 10, 0, ENGINE_ERROR)
    m.refuse(503, "m", "default")
    m.breaker_opened("b", 1)
    m.decision("shape", "b", "shape:long_output itl=2ms")
    m.affinity(True)
    m.retry("b")
    m.client_error("b", 400)
    m.reject(503)
    m.stream_error("b")
    m.health_change("b", "ready")
    m.reload("ok")
    m.log_drop(1)
    names: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            names.setdefault(s.name, set()).update(s.labels)
    return names


def exprs(panels: list[dict]) -> list[str]:
    out = []
    for p in panels:
        out += [t["expr"] for t in p.get("targets", ())]
        out += exprs(p.get("panels", ()))
    return out


def test_every_query_uses_exposed_metrics_and_labels():
    dash = json.loads(DASHBOARD.read_text())
    names = exposed()
    queries = exprs(dash["panels"])
    assert len(queries) >= 20
    variable = dash["templating"]["list"][1]["query"]["query"]
    for expr in [*queries, variable]:
        used = METRIC.findall(expr)
        assert used, expr
        for name in used:
            assert name in names, f"{name} is not exposed by the gateway ({expr})"
        for name, matchers in SELECTOR.findall(expr):
            assert set(MATCHER.findall(matchers)) <= names[name], expr
        known = set().union(*(names[n] for n in used)) | {"le"}
        for group in GROUPING.findall(expr):
            assert {x.strip() for x in group.split(",")} <= known, expr


def test_dashboard_covers_the_operator_questions():
    dash = json.loads(DASHBOARD.read_text())
    text = " ".join(exprs(dash["panels"]))
    for needed in ("shapegate_ttft_seconds_bucket", "shapegate_itl_seconds_bucket", "shapegate_e2e_seconds_bucket",
                   "shapegate_requests_total", "shapegate_completion_tokens_total", "shapegate_in_flight",
                   "shapegate_engine_waiting", "shapegate_backend_health", "shapegate_backend_breaker",
                   "shapegate_routing_decisions_total", "shapegate_prefix_affinity_total",
                   "shapegate_breaker_openings_total", 'outcome="engine_error"', "by (outcome)"):
        assert needed in text
    # The error share is the engines' own: neither a client's 4xx nor a client that left counts against them.
    assert 'status!~"2.."' not in text
    assert dash["uid"] and all(p.get("datasource", {}).get("uid") == "${datasource}"
                               for p in dash["panels"] if p["type"] != "row")
