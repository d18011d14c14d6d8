"""Import rules: the layers below, no import circles, contracts import nothing of ours, policies and backends
only contracts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.import_graph import circles, module_graph, unit_of

ROOT = Path(__file__).resolve().parents[2]
OURS = ("gateway", "policies", "backends")
STDLIB = set(sys.stdlib_module_names)

# The layers, bottom first. A module imports only from its own unit (package or top-level module) or from a unit
# on a lower line; units on one line do not import each other. Every import counts, type-only and function-level
# ones too: a unit that needs something from above it declares a Protocol and is handed the object.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gateway", "gateway.contracts", "gateway.errors"),  # records, protocols and errors everything shares
    ("gateway.apis",),  # the public APIs: routes, bodies, events and error shapes, one module each
    ("backends", "policies"),  # engine adapters and routing policies: plug-ins on the contracts
    ("gateway.config_base", "gateway.config_errors"),
    ("gateway.config_experiments", "gateway.config_usage", "gateway.config_queue"),
    ("gateway.config",),
    # the HTTP server (handed its handler: it knows no routing), self-reporting, per-request settings, the
    # dashboard's page and the engine simulator: each stands on the configuration at most
    ("gateway.http", "gateway.observe", "gateway.hot_settings", "gateway.dashboard", "gateway.sim"),
    ("gateway.stats",),
    ("gateway.fleet", "gateway.keys"),
    ("gateway.limits",),
    ("gateway.state",),  # the state kept for clients: stored responses, conversations (on the limits' Redis wire)
    ("gateway.routing",),  # its request state is a leaf: it imports only the contracts and the Api type
    ("gateway.queueing",),  # the queue in front of saturated backends: seats, order, waiting
    ("gateway.experiments",),
    ("gateway.runtime",),  # the long-lived objects of one gateway
    ("gateway.upstream",),  # dispatch with failover, one attempt, the relay of the reply
    ("gateway.background",),  # `background: true` responses, run to their end
    ("gateway.pipeline",),  # one request's stages
    ("gateway.ops",),  # reloads, workers, shutdown, replica sync, admin routes
    ("gateway.app",),
    ("gateway.cli",),
)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_contracts_import_nothing_of_ours():
    assert not [n for n in imports(ROOT / "gateway/contracts.py") if n.split(".")[0] in OURS]


def test_policies_import_only_contracts_pydantic_stdlib():
    for f in (ROOT / "policies").glob("*.py"):
        for n in imports(f):
            top = n.split(".")[0]
            assert top in STDLIB or top in ("pydantic", "__future__") or n == "gateway.contracts" \
                or top == "policies", f"{f.name} imports {n}"


def test_backends_import_only_contracts_apis_aiohttp_httptools_orjson():
    for f in (ROOT / "backends").glob("*.py"):
        for n in imports(f):
            top = n.split(".")[0]
            assert top in STDLIB or top in ("aiohttp", "httptools", "orjson", "__future__", "backends") \
                or n == "gateway.contracts" or n.startswith("gateway.apis."), f"{f.name} imports {n}"


def test_only_app_layer_touches_registries():
    for f in (ROOT / "gateway").rglob("*.py"):
        if f.name in ("runtime.py", "app.py"):
            continue
        text = f.read_text()
        assert "REGISTRY" not in text, f"{f.relative_to(ROOT)} uses a registry"


def test_every_module_has_a_docstring():
    for pkg in OURS:
        for f in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(f.read_text())
            if f.name == "__init__.py" and not tree.body:
                continue
            assert ast.get_docstring(tree), f"{f.relative_to(ROOT)} has no module docstring"


def layer_breaches(graph, layers=LAYERS) -> list[str]:
    """Every import that runs up the layers or sideways between units of one line, as "a -> b" lines."""
    rank = {unit: i for i, line in enumerate(layers) for unit in line}
    found = []
    for module, targets in sorted(graph.items()):
        src = unit_of(module, rank)
        for target in sorted(targets):
            dst = unit_of(target, rank)
            if src != dst and rank[dst] >= rank[src]:
                found.append(f"{module} -> {target}")
    return found


def unplaced(graph, layers=LAYERS) -> list[str]:
    units = {u for line in layers for u in line}
    return [m for m in graph if not unit_of(m, units)]


def test_every_module_is_in_a_layer():
    graph = module_graph()
    units = {u for line in LAYERS for u in line}
    assert unplaced(graph) == []
    assert [u for u in units if u not in graph] == []  # a unit that no longer exists is a stale rule


def test_a_package_left_out_of_the_layers_is_unplaced():
    # Not placed at the bottom with the `gateway` package's own __init__: it would then import anything unseen.
    assert unplaced({"gateway.newpkg.mod": set(), "gateway.newmod": set(), "gateway": set()}) == \
        ["gateway.newpkg.mod", "gateway.newmod"]


def test_no_import_runs_up_the_layers():
    assert layer_breaches(module_graph()) == []


def test_no_import_circles():
    assert circles(module_graph()) == []


def test_the_request_state_is_a_leaf():
    # Features return what they decide and the pipeline stores it: the state imports none of them (only the
    # contracts, and the Api type of the route it is a request of).
    assert module_graph()["gateway.routing.request"] <= {"gateway.contracts", "gateway.apis.api"}


def test_the_rules_catch_a_back_edge_and_a_circle():
    # The checks above pass on the tree; this shows they would fail on the two faults they are for.
    graph = {"gateway.routing.shape": {"gateway.runtime"}, "gateway.runtime": {"gateway.routing.shape"},
             "gateway.http.front": {"gateway.observe.metrics"}, "gateway.observe.metrics": set()}
    assert layer_breaches(graph) == ["gateway.http.front -> gateway.observe.metrics",
                                     "gateway.routing.shape -> gateway.runtime"]
    assert circles(graph) == [["gateway.routing.shape", "gateway.runtime"]]
