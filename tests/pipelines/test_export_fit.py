"""The export fitted to its memory (pipelines/export.py ``ExportStage.fitted``): where the slab remesh's forked
workers do not fit what the stage may use, the plan runs the slabs one at a time (``export.workers: 1``, the same
mesh; tests/pixal3d/mesh/test_mesh_remesh_slabs.py) and counts the smaller, measured line of that mode."""
from __future__ import annotations

import pytest

from pipelines import Pixal3D
from pipelines.build import build_stages
from pipelines.stage import StageBudget
from pixal3d.config import load_config
from pixal3d.memory_budget import GIB, PROCESS_BYTES
from pixal3d.mesh.settings import ExportSettings
from tests.support.header_hub import REAL, hub  # noqa: F401

REFERENCE = "configs/1024_cascade.yaml"


def _export():
    return next(s for s in build_stages(load_config(REFERENCE)) if s.name == "export")


def test_the_slabs_run_one_at_a_time_only_where_the_forked_workers_do_not_fit():
    export = _export()
    forked = export.working_set()
    assert export.settings.workers is None and export.choices() == {}
    roomy = export.fitted(StageBudget(PROCESS_BYTES + forked, 0, explicit=True))
    assert roomy is export  # the workers fit: nothing changes
    between = PROCESS_BYTES + forked - GIB // 4
    tight = export.fitted(StageBudget(between, 0, explicit=True))
    assert tight.settings.workers == 1 and tight.choices() == {"workers": 1}
    assert tight.working_set() < between - PROCESS_BYTES < forked  # the serial line, which fits
    assert export.settings.workers is None  # the config's stage is not changed: the fitted one is a copy
    # the machine's usable memory bounds it too (no explicit budget), as NAF's auto mode
    assert export.fitted(StageBudget(between, 0, explicit=False)).settings.workers == 1


def test_a_config_that_asks_for_one_worker_is_counted_at_the_serial_line_and_left_as_it_is():
    export = _export()
    export.settings = ExportSettings(**{**export.settings.__dict__, "workers": 1})
    assert export.working_set() < _export().working_set()
    assert export.fitted(StageBudget(PROCESS_BYTES + GIB, 0, explicit=True)) is export and export.choices() == {}


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_workers_must_be_a_process_count(workers):
    with pytest.raises(ValueError, match="workers must be a process count"):
        ExportSettings(workers=workers)


def test_the_plan_names_the_serial_slabs_where_it_chose_them(hub):  # noqa: F811
    export = _export()
    forked, serial = export.working_set(), export.fitted(StageBudget(0, 0)).working_set()
    budget = (PROCESS_BYTES + (forked + serial) / 2) / GIB
    plan = Pixal3D.plan(REAL, device="cpu", memory_budget=f"{budget:.2f}G")
    assert plan.choices()["export"] == {"workers": 1}
    assert "export: the remesh's slabs one at a time" in plan.table()
    roomy = Pixal3D.plan(REAL, device="cpu", memory_budget="8G")  # control: with room, the forked workers
    assert "export" not in roomy.choices() and "slabs one at a time" not in roomy.table()


def test_the_shape_only_export_is_fitted_the_same_way_and_the_mesh_input_export_has_no_slabs_to_bound():
    from pipelines.mesh_export import MeshExportStage
    from pipelines.shape_export import ShapeExportStage

    export = _export()
    shape = ShapeExportStage(export.settings, export.hr_resolution, export.upsample_times)
    forked = shape.working_set()
    tight = shape.fitted(StageBudget(PROCESS_BYTES + forked - GIB // 4, 0, explicit=True))
    assert tight.settings.workers == 1 and tight.working_set() < forked - GIB // 4
    onto = MeshExportStage(export.settings, export.hr_resolution, export.upsample_times)
    assert onto.fitted(StageBudget(PROCESS_BYTES + GIB, 0, explicit=True)) is onto  # its bake runs as it is
