"""The package's layout shows its architecture (issue 26): each layer imports only from the layers above
it, no module imports itself back through others, and no module grows past a few hundred lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "harness"
# Each layer may import from the layers before it in this list (ARCHITECTURE.md, "Layers").
LAYERS = ("spec", "estimate", "alloc", "runner", "sweep", "analysis", "cli")
MAX_LINES = 450  # "files of a few hundred lines" (STYLE.md 10): about 400, with room for a docstring


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The harness modules ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            for alias in node.names:  # ``from harness.x import module`` names a module
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("harness"))
    return out & known


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


MODULES = _modules()
GRAPH = {m: _imports(p, set(MODULES)) for m, p in MODULES.items()}


def test_every_module_belongs_to_a_layer():
    loose = [m for m in MODULES if m.count(".") >= 1 and _layer(m) is None and m != "harness.__main__"]
    assert loose == []


def test_layers_import_only_from_the_layers_above():
    upward = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if _layer(m) and _layer(t) and LAYERS.index(_layer(t)) > LAYERS.index(_layer(m))
    ]
    assert upward == []


def test_no_import_circle():
    # A package's __init__ is where its names are gathered; its submodules importing it is no circle.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in GRAPH.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(" -> ".join([*path[path.index(t) :], t]))
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_a_few_hundred_lines_with_a_docstring(module):
    text = MODULES[module].read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert ast.get_docstring(ast.parse(text)), f"{module} says in a docstring what it is for"


def test_only_the_runner_imports_torch_and_only_the_cli_imports_hydra():
    found = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                root = name.split(".")[0]
                if root == "torch" and _layer(m) != "runner":
                    found.append(f"{m} imports {name}")
                if root in ("hydra", "omegaconf") and _layer(m) != "cli":
                    found.append(f"{m} imports {name}")
    assert found == []
