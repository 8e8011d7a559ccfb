"""The packages import in one direction, function-level imports included: memory <- models <- decoding <-
chat, training <- serve, page <- app, and no two modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"memory": 0, "models": 1, "decoding": 2, "chat": 3, "training": 3, "serve": 4, "page": 4, "app": 5}


def imports() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports anywhere in its file."""
    files = [p for p in ROOT.glob("*.py") if p.stem in LAYERS] + \
        [p for package in LAYERS for p in (ROOT / package).glob("*.py")]
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def test_packages_import_only_the_layers_below_them():
    wrong = [f"{a} imports {b}" for a, deps in imports().items() for b in sorted(deps)
             if a.split(".")[0] != b.split(".")[0] and LAYERS[b.split(".")[0]] >= LAYERS[a.split(".")[0]]]
    assert wrong == []


def test_no_two_modules_import_each_other():
    graph = imports()
    seen, cycles = set(), []

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append(" -> ".join(path[path.index(node):] + [node]))
            return
        if node in seen:
            return
        seen.add(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []
