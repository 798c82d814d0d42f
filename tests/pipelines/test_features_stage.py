"""The features stage: DINOv3 runs once per run, alone, before any flow model loads; the flow stages condition
from its kept tokens and give the fingerprints they gave when each ran DINOv3 itself (the eager reference, and
through it the golden)."""
from __future__ import annotations

from pipelines.build import build_stages
from pipelines.features import FeaturesStage
from pixal3d.staging.events import EventLog
from tests.support.cascade_fixtures import (  # noqa: F401
    first_difference,
    run_tiny,
    tiny,
    tiny_cache,
    tiny_reference,
)

FLOWS = {"sparse_structure_flow_model", "shape_slat_flow_model_512", "shape_slat_flow_model_1024",
         "tex_slat_flow_model_1024"}
IMAGE_MODELS = {"dinov3", "moge", "rembg"}


def _held_together(log: EventLog) -> list[tuple[str, frozenset[str]]]:
    """(stage, models loaded) after every load, replaying the registry's loads and releases."""
    loaded: set[str] = set()
    seen = []
    for event in log.events:
        if event.kind in ("load", "reload"):
            loaded.add(event.model)
            seen.append((event.stage, frozenset(loaded)))
        elif event.kind == "release":
            loaded.discard(event.model)
    return seen


def test_dinov3_loads_once_alone_and_no_image_model_shares_memory_with_a_flow(tiny, tiny_reference):
    log = EventLog()
    result = run_tiny(tiny, "staged", events=log, strict=True)
    assert result.fingerprints() == tiny_reference, first_difference(result.fingerprints(), tiny_reference)
    loads = [e.model for e in log.events if e.kind in ("load", "reload")]
    assert loads.count("dinov3") == 1
    for stage, held in _held_together(log):
        assert not (held & IMAGE_MODELS and held & FLOWS), f"{stage}: {sorted(held)} held at once"
    used = {r.stage: r.used for r in result.stages}
    assert used["features"] == ["dinov3"] and all("dinov3" not in used[s] for s in
                                                  ("structure", "shape_512", "shape_1024", "texture"))
    assert "features" not in result.fingerprints()  # stored, not fingerprinted: the conditions that use it are


def test_the_features_stage_computes_every_size_the_flow_stages_read(tiny):
    stage = FeaturesStage.from_config(tiny)
    read = {tiny.structure.condition.image_size, tiny.shape_512.condition.image_size,
            tiny.shape_1024.condition.image_size, tiny.texture.condition.image_size}
    assert set(stage.sizes) == read and len(read) == 2  # 512- and 1024-px analogues: two forwards, not four
    names = [s.name for s in build_stages(tiny)]
    assert names.index("features") < names.index("structure")
    assert stage.working_set() > 0


def test_control_a_resident_run_holds_dinov3_beside_the_flows_and_the_replay_sees_it(tiny):
    log = EventLog()
    run_tiny(tiny, "resident", events=log, until="shape_512")
    assert any(held & IMAGE_MODELS and held & FLOWS for _, held in _held_together(log))
