"""The import graph of ``pixal3d/`` and ``pipelines/``, read with ``ast``."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("pixal3d", "pipelines")


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The modules of ours one import statement needs: ``from p import m`` needs ``p.m`` when that is a module,
    else ``p`` (a name it defines); ``import a.b`` needs ``a.b``."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
            prefix = ".".join([*base, *([node.module] if node.module else [])])
        else:
            prefix = node.module or ""
        subs = [f"{prefix}.{alias.name}" for alias in node.names]
        names = [name for name in subs if name in modules] or [prefix]
    found = set()
    for name in names:
        while name and name not in modules:  # ``import pixal3d.nn.attention as x`` needs that module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of ours it imports, for the two packages under ``root``."""
    modules = _modules(root)
    graph = {}
    for module, path in modules.items():
        nodes = (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom)))
        graph[module] = set().union(*(_imported(module, path, node, modules) for node in nodes))
    return graph
