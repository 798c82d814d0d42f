"""No import circle anywhere in ``pixal3d/`` or ``pipelines/``: every import statement of every module (at
module level, inside functions and under ``TYPE_CHECKING`` alike) is read with ``ast``, and the graph of
module → module must have no cycle. Control: the same walk over a copy of both packages with one import added
back (``pixal3d.config`` importing ``pipelines.pipeline``, which imports it) finds that cycle."""
from __future__ import annotations

import shutil

from tests.support.cascade_fixtures import REPO
from tests.support.imports import PACKAGES, import_graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
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
    return sorted(found)


def test_no_module_of_pixal3d_or_pipelines_imports_itself_back():
    graph = import_graph(REPO)
    assert "pipelines.pipeline" in graph and "pixal3d.staging.executor" in graph  # the walk sees the packages
    assert "pipelines.batch" in graph["pipelines.pipeline"]  # and their imports
    assert cycles(graph) == []


def test_control_one_import_added_back_is_a_cycle(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "pixal3d" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _late():\n    from pipelines import pipeline  # noqa: F401\n")
    found = cycles(import_graph(tmp_path))
    assert len(found) == 1 and {"pixal3d.config", "pipelines.pipeline"} <= set(found[0]), found
