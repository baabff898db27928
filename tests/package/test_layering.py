"""The package's layering: packages in one declared order (each imports only those below it), no import cycle
between modules, not even through imports made only for type checkers, and nothing below the Engine imports it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "gsync"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every gsync module ``path`` imports, wherever the import stands (top level, TYPE_CHECKING, a function)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import module`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {target for target in found if target.startswith("gsync")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    # A package's __init__ re-exporting its modules is how a package shows its surface, not a layer above them.
    return {
        name: {target for target in imports_of(path) if target in modules and target != name}
        for name, path in modules.items()
        if not path.name == "__init__.py"
    }


# Bottom first: a package may import only the packages before it. A package is a subpackage of gsync._core (or
# of gsync), or a module that stands alone at that level. A new package goes where what it imports puts it.
LAYERS = (
    "gsync.errors",
    "gsync.types",
    "gsync._core.threads",
    "gsync._core.base",  # what a failure means, outcomes, the per-step facts: the shared bottom
    "gsync._core.topology",
    "gsync._core.devices",
    "gsync.checkpoint",
    "gsync.elastic",
    "gsync.trace",
    "gsync.comm",
    "gsync._core.streams",
    "gsync._core.data",
    "gsync._core.monitoring",  # loggers' dispatch, the process's counters, pictures: FitResult.plot draws with it
    "gsync.result",
    "gsync.loggers",
    "gsync.metrics",
    "gsync.report",
    "gsync._core.trace_files",
    "gsync._core.gradients",
    "gsync._core.distributed",
    "gsync._core.transports",
    "gsync._core.step",
    # Features over the step: the step path names them only through step/features.py's protocols.
    "gsync._core.batchnorm",
    "gsync._core.sharding",
    "gsync._core.state",
    "gsync._core.settings",
    "gsync._core.elastic",
    "gsync._core.arguments",
    "gsync._core.session",
    "gsync.session",
    "gsync.engine",
    "gsync.testing",
)


def package_of(module: str) -> str:
    parts = module.split(".")
    depth = 3 if parts[1] == "_core" else 2
    return ".".join(parts[:depth])


def test_packages_import_only_packages_below_them() -> None:
    order = {package: position for position, package in enumerate(LAYERS)}
    undeclared = sorted({package_of(module) for module in graph()} - set(order))
    assert undeclared == [], f"declare {undeclared} in LAYERS, above every package it imports"
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph().items()
        for target in targets
        if order[package_of(target)] > order[package_of(module)]
    )
    assert upward == [], "imports against the declared package order (move the shared part down):\n" + "\n".join(upward)


def test_no_import_cycle_between_modules() -> None:
    edges = graph()
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        path.append(node)
        for target in sorted(edges.get(node, ())):
            visit(target)
        path.pop()
        done.add(node)

    for node in sorted(edges):
        visit(node)


def test_nothing_below_the_engine_imports_it() -> None:
    importers = sorted(name for name, targets in graph().items() if "gsync.engine" in targets and name != "gsync.testing")
    assert importers == [], f"{importers} import gsync.engine: hand them EngineSettings instead"
