"""Issue 47: one kind of job per room. ``Pixal3D`` (``pipelines/pipeline.py``) consults this process's rank
(``pipelines.ranks``) at its few points and names no parallel type; the kind of input (``pipelines.inputs``) is one
value with its own checks, so the pipeline names no kind either; and the room stays small (well under 400 lines: at
most 330, its planning steps in ``plan.py``, its loaders in ``loaders.py``, its results in ``result.py``), with no
function over 60 lines in it or anywhere in ``pipelines/``. Controls: a parallel type or a kind's branch written back
into the pipeline is found, and so is a long function."""
from __future__ import annotations

import ast

from tests.support.cascade_fixtures import REPO

PARALLEL_TYPES = {"ParallelSettings", "ParallelRuntime", "RankPlan", "JoinedRank", "DataJob", "Leader",
                  "FollowerState", "FollowerStage", "Skipping", "BetweenImages", "Topology"}
"""The types of ``pixal3d.parallel``, ``pipelines.parallel``, ``pipelines.data_parallel``: a single run needs none."""
PARALLEL_MODULES = ("pixal3d.parallel", "pipelines.data_parallel")
KIND_WORDS = {"ViewSet", "read_views", "view_name", "probe_image", "as_image", "takes_views"}
"""What the image-or-views branches named before the kinds of input were values."""


def names_in(source: str) -> set[str]:
    """Every name and attribute the module's code uses, and every module it imports from."""
    tree = ast.parse(source)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found.add(f"module:{'.' * node.level}{node.module or ''}")
            found |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {f"module:{alias.name}" for alias in node.names}
    return found


def parallel_names(source: str) -> set[str]:
    used = names_in(source)
    modules = {n for n in used if n.startswith("module:") and
               any(n.removeprefix("module:").startswith(m) for m in (*PARALLEL_MODULES, ".data_parallel"))}
    return (used & PARALLEL_TYPES) | modules


def kind_branches(source: str) -> set[str]:
    """The views-or-image words the pipeline used, and any ``config.views`` test."""
    used = names_in(source) & KIND_WORDS
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "views" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "config":
            used.add("config.views")
    return used


def long_functions(source: str, limit: int = 60) -> list[str]:
    tree = ast.parse(source)
    return [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


PIPELINE = REPO / "pipelines" / "pipeline.py"


def test_the_pipeline_names_no_parallel_type_and_no_kind_of_input():
    source = PIPELINE.read_text()
    assert parallel_names(source) == set()
    assert kind_branches(source) == set()
    assert "rank_of" in source and "self._rank" in source  # it does consult the rank


def test_the_pipeline_is_a_room_one_can_live_in():
    source = PIPELINE.read_text()
    assert len(source.splitlines()) <= 330
    assert long_functions(source) == []


def test_no_function_in_pipelines_is_over_60_lines():
    found = {str(path.relative_to(REPO)): long_functions(path.read_text())
             for path in sorted((REPO / "pipelines").rglob("*.py"))}
    assert {path: functions for path, functions in found.items() if functions} == {}


def test_controls_a_parallel_type_or_a_kinds_branch_written_back_is_found():
    source = PIPELINE.read_text()
    assert parallel_names(source + "\nfrom pixal3d.parallel import ParallelRuntime\n") == \
        {"ParallelRuntime", "module:pixal3d.parallel"}
    assert parallel_names(source + "\nfrom .data_parallel import DataJob\n") == {"DataJob", "module:.data_parallel"}
    assert kind_branches(source + "\nviews = self.config.views is not None\n") == {"config.views"}
    assert kind_branches(source + "\nfrom pixal3d.models.views import read_views\n") == {"read_views"}
    assert long_functions("def f():\n" + "    x = 1\n" * 60) == ["f: 61 lines"]
    assert not long_functions("def f():\n" + "    x = 1\n" * 59)
