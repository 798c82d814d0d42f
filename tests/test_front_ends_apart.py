"""Issue 38: the three front ends are peers over one floor. No front end imports another (the command:
``pipelines/cli.py`` and ``cli_args.py``; the web app: ``pipelines/app/``; the job server: ``pipelines/serve/``), and
no module of the floor (the job, the session, the process roles, the cascade) imports a front end, so none reaches
another through it either. Every import statement is read (``tests/test_import_cycles.import_graph``: at module
level, in functions, under ``TYPE_CHECKING``). Before, the server was built on the app's worker, and the app and
the server imported the command's body. Control: one such import added back is found."""
from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.cascade_fixtures import REPO
from tests.support.imports import PACKAGES, import_graph


def front_end(module: str) -> str | None:
    """Which front end a module of ours belongs to (None: the floor)."""
    if module in ("pipelines.cli", "pipelines.cli_args"):
        return "cli"
    for name in ("app", "serve"):
        if module == f"pipelines.{name}" or module.startswith(f"pipelines.{name}."):
            return name
    return None


def crossings(root: Path) -> list[tuple[str, str]]:
    """(importer, imported) for every import that crosses from one front end, or the floor, into another."""
    found = []
    for module, imports in import_graph(root).items():
        for other in imports:
            if front_end(other) is not None and front_end(other) != front_end(module):
                found.append((module, other))
    return sorted(found)


def test_no_front_end_imports_another_and_the_floor_imports_none():
    graph = import_graph(REPO)
    assert {front_end(m) for m in graph} == {"cli", "app", "serve", None}  # the walk sees all three
    assert "pipelines.session" in graph["pipelines.serve.worker"] and "pipelines.job" in graph["pipelines.cli"]
    assert crossings(REPO) == []


def test_control_an_import_of_another_front_end_is_found(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    worker = tmp_path / "pipelines" / "serve" / "worker.py"
    worker.write_text(worker.read_text() + "\n\ndef _late():\n    from ..app import job  # noqa: F401\n")
    session = tmp_path / "pipelines" / "session.py"
    session.write_text(session.read_text() + "\n\ndef _late():\n    from . import cli  # noqa: F401\n")
    assert crossings(tmp_path) == [("pipelines.serve.worker", "pipelines.app.job"),
                                   ("pipelines.session", "pipelines.cli")]


FRONT_DOOR = ("pipelines.job", "pipelines.session", "pipelines.launch")
"""Over the cascade, below the front ends: the job value, the session, the process roles."""


def above_the_floor(module: str) -> bool:
    """A front end, or the front door's modules that the front ends share."""
    return front_end(module) is not None or module in FRONT_DOOR


def floor_reaches_up(root: Path) -> list[tuple[str, str]]:
    """(importer, imported) for every import from the floor (``pixal3d`` and the cascade: the stages, the pipeline,
    the plan, the errors, ...) into the front door or a front end."""
    return sorted((module, other) for module, imports in import_graph(root).items() if not above_the_floor(module)
                  for other in imports if above_the_floor(other))


def test_the_floor_imports_nothing_of_the_front_door():
    """Issue 47: errors and checks live below the front door (``pixal3d.config``: ``UsageError``, ``check_seed``,
    ``check_fov``), so no module of ``pixal3d`` or the cascade imports ``job.py``, the session, the roles or a front
    end; before, ``state.py`` took its checks from ``job.py`` and ``plan.py``/``errors.py`` its ``UsageError``."""
    graph = import_graph(REPO)
    assert "pipelines.pipeline" in graph and "pixal3d.config" in graph and "pipelines.state" in graph
    assert floor_reaches_up(REPO) == []


def test_control_a_floor_module_importing_the_job_is_found(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    state = tmp_path / "pipelines" / "state.py"
    state.write_text(state.read_text() + "\n\nfrom .job import check_fov  # noqa: E402,F401\n")
    models = tmp_path / "pixal3d" / "models" / "camera.py"
    models.write_text(models.read_text() + "\n\ndef _late():\n    from pipelines import session  # noqa: F401\n")
    assert floor_reaches_up(tmp_path) == [("pipelines.state", "pipelines.job"),
                                          ("pixal3d.models.camera", "pipelines.session")]
