"""The import graph of gateway/, backends/ and policies/: every import counted (type-only and in functions too).

`python3 -m tests.import_graph` draws it by package (`--dot` for Graphviz, `--modules` module by module) and
lists the import circles; tests/unit/test_layering.py holds the rules it must keep.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("gateway", "backends", "policies")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ours (a package under its own name)."""
    found = {}
    for pkg in OURS:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return found


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name `module` imports, anywhere in the file; `from a import b` counts a.b and a."""
    names = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a package's own __init__ is not counted for its modules)."""
    files = module_files(root)

    def ours(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        targets = {ours(n) for n in imported_names(module, path)}
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one node (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


# Units that are their package's own __init__ alone: the package's modules are units of their own, so that a new
# package left out of the layers is found unplaced instead of falling into its parent's unit.
OWN_INIT_ONLY = frozenset({"gateway"})


def unit_of(module: str, units: Iterable[str]) -> str:
    """The longest unit (package or module) that holds `module` ("": none does)."""
    best = ""
    for unit in units:
        holds = module == unit or (module.startswith(unit + ".") and unit not in OWN_INIT_ONLY)
        if holds and len(unit) > len(best):
            best = unit
    return best


def unit_graph(graph: Mapping[str, Iterable[str]], units: Iterable[str]) -> dict[str, set[str]]:
    """The module graph folded onto units: an edge where any module of one imports any module of the other."""
    units = list(units)
    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        src = unit_of(module, units) or module
        folded.setdefault(src, set()).update(
            dst for dst in (unit_of(t, units) or t for t in targets) if dst != src)
    return folded


def default_units(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Each package of gateway/ (and backends, policies) as one unit, each top-level gateway module as one."""
    units = {"backends", "policies", "gateway"}
    for module in graph:
        parts = module.split(".")
        if parts[0] == "gateway" and len(parts) > 1:
            units.add(".".join(parts[:2]))
    return sorted(units)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dot", action="store_true", help="Graphviz output instead of lines")
    ap.add_argument("--modules", action="store_true", help="module by module instead of package by package")
    args = ap.parse_args()
    graph = module_graph()
    shown = graph if args.modules else unit_graph(graph, default_units(graph))
    if args.dot:
        print("digraph imports {\n  rankdir=BT;")
        for src in sorted(shown):
            for dst in sorted(shown[src]):
                print(f'  "{src}" -> "{dst}";')
        print("}")
    else:
        for src in sorted(shown):
            print(f"{src} -> {', '.join(sorted(shown[src])) or '(nothing of ours)'}")
    found = circles(graph)
    print(f"# {len(found)} import circles" + "".join(f"\n#   {' <-> '.join(c)}" for c in found),
          file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
