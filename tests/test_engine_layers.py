"""engine/'s packages depend on each other one way, in the layers engine/__init__.py lists, with no cycle, and no two
modules import each other, directly or round a circle, inside a package either.

Imports are read from the source with ``ast`` (function-level and ``TYPE_CHECKING`` imports included), so a
lazy import inside a function cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"

LAYERS: list[set[str]] = [
    {"errors", "events", "quiet", "redact", "demo", "crash_guard"},
    {"rewards"},
    {"config", "method_facts"},
    {"data", "hardware", "setup"},
    {"model", "speed"},
    {"vision"},
    {"run", "export"},
    {"distributed"},
    {"train"},
    {"cli"},
    {"bench"},
]
"""Lowest first; a component may import its own modules and components of lower layers only."""

ALLOWED: set[tuple[str, str]] = set()
"""(importer component, imported component) pairs that break the layers on purpose; none today."""


def component(module: str) -> str | None:
    """``engine.run.loop`` -> ``run``; None for the root package, which holds only a docstring."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "engine" else None


def rank_of(name: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if name in layer:
            return rank
    raise AssertionError(f"engine.{name} is in no layer: add it to LAYERS and to engine/__init__.py's list")


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every engine module ``path`` imports, wherever in the file the import is."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # ``from engine import events``
    return {name for name in found if name == "engine" or name.startswith("engine.")}


def _exists(name: str) -> bool:
    return (ENGINE / name / "__init__.py").exists() or (ENGINE / f"{name}.py").exists()


def engine_files() -> list[Path]:
    return sorted(ENGINE.rglob("*.py"))


def dependencies() -> dict[str, dict[str, list[str]]]:
    """component -> imported component -> the modules that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in engine_files():
        importer = component(module_name(path))
        if importer is None:
            continue
        for name in imported_modules(path):
            imported = component(name)
            if (
                imported is None
                or imported == importer
                or (not (ENGINE / imported).exists() and not (ENGINE / f"{imported}.py").exists())
            ):
                continue  # the root package, the component itself, or a name imported from a module
            graph.setdefault(importer, {}).setdefault(imported, []).append(module_name(path))
    return graph


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The engine modules ``path`` imports: ``from a import b`` is ``a.b`` where that is a module, else ``a``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in modules else base)
    return (found & modules) - {module_name(path)}


def module_dependencies() -> dict[str, dict[str, list[str]]]:
    """module -> the engine modules it imports (the graph :func:`cycles` reads)."""
    paths = {module_name(path): path for path in engine_files()}
    return {name: {target: [name] for target in module_imports(path, set(paths))} for name, path in paths.items()}


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Each strongly connected group of more than one component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_component_has_a_layer() -> None:
    names = {p.stem for p in ENGINE.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()}
    for name in sorted(names):
        rank_of(name)


def test_no_import_cycle_between_components() -> None:
    assert cycles(dependencies()) == []


def test_no_import_cycle_between_modules() -> None:
    """A package's ``__init__`` may import its modules; they may not import it back, nor each other round a
    circle: such a pair cannot be read, tested or moved one at a time."""
    assert cycles(module_dependencies()) == []


def test_no_component_imports_a_higher_layer() -> None:
    upward = [
        f"engine.{imported} (layer {rank_of(imported) + 1}) imported by {', '.join(sorted(set(modules)))} "
        f"(layer {rank_of(importer) + 1})"
        for importer, targets in dependencies().items()
        for imported, modules in targets.items()
        if rank_of(imported) >= rank_of(importer) and (importer, imported) not in ALLOWED
    ]
    assert upward == []


def test_the_root_package_imports_nothing() -> None:
    assert imported_modules(ENGINE / "__init__.py") == set()


# --- the checker itself ---------------------------------------------------------------------------------------


def test_function_level_and_relative_imports_are_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "engine" / "data"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    source = package / "files.py"
    source.write_text("def f():\n    from engine.run import loop\n    from . import packing\n    import engine.cli\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", tmp_path / "engine")
    assert imported_modules(source) >= {"engine.run.loop", "engine.data.packing", "engine.cli"}


def test_a_module_cycle_through_a_lazy_import_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "engine" / "speed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from engine.speed import loss\n")
    (package / "loss.py").write_text("def f():\n    from engine.speed import SpeedController\n")
    (package / "kernel.py").write_text("from . import loss\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", tmp_path / "engine")
    assert cycles(module_dependencies()) == [["engine.speed", "engine.speed.loss"]]


def test_a_cycle_is_found() -> None:
    graph = {"run": {"distributed": ["engine.run.loop"]}, "distributed": {"run": ["engine.distributed.worker"]}}
    assert cycles(graph) == [["distributed", "run"]]
    assert cycles({"run": {"data": ["engine.run.loop"]}}) == []
