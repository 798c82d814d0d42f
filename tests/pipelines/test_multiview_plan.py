"""The real multi-view cascade planned from headers (as ``--plan`` does): pipeline_mv.json is the only download,
the ``*_mv`` flows are read at their real sizes, and 4 views fit an 8 GiB memory budget and the 4 GiB one of the
8 GB issue (``--memory-budget 4G``).

The ``*_mv`` checkpoints have the single-view ones' tensors (public ports list the same byte sizes), so the fake
Hub serves assets/checkpoints.json's headers under the ``_mv`` names."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from pipelines import Pixal3D
from pixal3d.memory_budget import MemoryBudgetError
from pixal3d.pipeline_json import PINNED_CHECKPOINTS
from tests.support.header_hub import CHECKPOINTS, DINOV3_BYTES, REPO, _header, install_hub
from tests.support.header_hub import FakeHub as SingleViewHub

MV = REPO / "configs" / "1024_cascade_mv.yaml"
MV_STEMS = PINNED_CHECKPOINTS[("TencentARC/Pixal3D", "b0cb2e1b794cab9aa0ac38a95d794a4d9337437f", "pipeline_mv.json")]


class FakeHub(SingleViewHub):
    """The single-view fake Hub serving pipeline_mv.json and the ``_mv`` names."""

    def __init__(self, root):
        super().__init__(root)
        self.pipeline["args"]["models"] = dict(MV_STEMS)
        by_file = {entry["file"]: entry for entry in CHECKPOINTS.values()}
        self.headers = {f"{stem}.safetensors": _header(by_file[stem.removesuffix("_mv")])
                        for stem in MV_STEMS.values()}
        self.headers["model.safetensors"] = (SimpleNamespace(tensors={"w": SimpleNamespace(
            data_offsets=(0, DINOV3_BYTES))}), DINOV3_BYTES)

    def snapshot_download(self, repo_id, revision=None, allow_patterns=None, local_files_only=False, **_):
        self.calls.append(("snapshot_download", repo_id, tuple(allow_patterns or ()), local_files_only))
        if local_files_only:
            if self.snapshot is None or list(allow_patterns) != ["pipeline_mv.json"]:
                raise self.missing("not in the cache")
            return str(self.snapshot)
        assert list(allow_patterns) == ["pipeline_mv.json"], allow_patterns  # nothing else is ever downloaded
        self.snapshot = self.root / "snapshot"
        self.snapshot.mkdir(exist_ok=True)
        (self.snapshot / "pipeline_mv.json").write_text(json.dumps(self.pipeline))
        return str(self.snapshot)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return install_hub(FakeHub(tmp_path), tmp_path, monkeypatch)


def test_the_real_multiview_cascade_is_planned_from_headers_and_4_views_fit_8_gib(hub):
    plan = Pixal3D.plan(MV, device="cpu", memory_budget="8G")
    assert [s.name for s in plan.stages][:3] == ["views", "features", "structure"]
    assert "moge" not in plan.model_names() and "rembg" in plan.model_names()
    sizes = plan.memory.model_bytes
    for name, stem in MV_STEMS.items():
        assert sizes[name] == hub.headers[f"{stem}.safetensors"][1] > 0, name
    downloads = [c for c in hub.calls if c[0] == "snapshot_download" and not c[3]]
    assert downloads == [("snapshot_download", "TencentARC/Pixal3D", ("pipeline_mv.json",), False)]
    assert {c[2] for c in hub.calls if c[0] == "header"} == set(hub.headers)
    assert plan.memory.staged_peak <= 8 * 2**30  # the largest stage, its weights and its work, 4 views counted
    by_stage = {s.name: s.working_bytes for s in plan.memory.stages}
    assert by_stage["features"] > 0 and by_stage["texture"] > 0


def test_4_views_plan_within_the_4_gib_that_the_1024_cascade_needs_on_an_8_gb_machine(hub):
    """The 8 GB issue's budget is 4 GiB a stage (``--memory-budget 4G``): the multi-view cascade with its 4 views
    (DINOv3 on all of them as one batch, NAF one view at a time) plans within it too."""
    plan = Pixal3D.plan(MV, device="cpu", memory_budget="4G")
    assert plan.memory.staged_peak <= 4 * 2**30


def test_views_beyond_the_budget_are_refused_naming_the_features_stage(hub, tmp_path):
    """Control: the plan does count the views; 64 of them do not fit 8 GiB (DINOv3 on all of them as one batch)."""
    config = tmp_path / "many.yaml"
    config.write_text(yaml.safe_dump({"base": str(MV), "views": {"plan_views": 64}}))
    with pytest.raises(MemoryBudgetError, match="stage 'features' needs at least"):
        Pixal3D.plan(config, device="cpu", memory_budget="8G")
