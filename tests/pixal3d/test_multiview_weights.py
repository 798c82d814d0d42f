"""The multi-view weights: pipeline_mv.json and its checkpoints through the same fetching, listing and generating
code as the single-view ones.

- pixal3d-fetch on a multi-view config downloads pipeline_mv.json and the checkpoints it names (the ``*_mv`` flows,
  the shared decoders) at the pinned revision; afterwards the config resolves offline.
- Offline on an empty cache, 1024_cascade_mv's missing list names pipeline_mv.json and, before it is downloaded, the
  seven checkpoints it will name at the pinned revision (``PINNED_CHECKPOINTS``).
- The tiny-mv demo weights: four flows of their own, the single-view demo's decoders byte for byte; generating them
  leaves the single-view demo's folder as it was.
- The shipped multi-view configs are their single-view cascades with the multi-view weights and a views section.
"""
from __future__ import annotations

import dataclasses
import hashlib
import types

import pytest
import yaml

from pixal3d.config import load_config
from pixal3d.fetch import main
from pixal3d.hub import MissingWeightsError
from pixal3d.pipeline_json import resolve_weights
from pixal3d.tiny_weights import TINY_MV_VERSION, TINY_VERSION, ensure_tiny_mv_weights
from tests.support.cascade_fixtures import REPO, tiny_cache  # noqa: F401
from tests.support.fetch_hub import REV, FakeHub

CONFIGS = REPO / "configs"


def _digests(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def tiny_mv(tiny_cache):
    tiny = tiny_cache / "tiny" / TINY_VERSION
    before = _digests(tiny)
    folder = ensure_tiny_mv_weights(tiny_cache / "tiny")
    assert _digests(tiny) == before  # the single-view demo's weights are left as they were
    return types.SimpleNamespace(tiny=tiny, mv=folder)


def test_the_tiny_mv_weights_have_their_own_flows_and_the_demos_decoders(tiny_mv):
    assert tiny_mv.mv.name == TINY_MV_VERSION and (tiny_mv.mv / "COMPLETE").is_file()
    mv, single = _digests(tiny_mv.mv / "pixal3d"), _digests(tiny_mv.tiny / "pixal3d")
    flows = [p for p in mv if p.name.endswith("_mv.safetensors")]
    assert len(flows) == 4
    for flow in flows:  # the same networks (specs), other values
        base = flow.with_name(flow.name.replace("_mv.", "."))
        assert mv[flow] != single[base] and mv[flow.with_suffix(".json")] == single[base.with_suffix(".json")]
    decoders = [p for p in single if "dec" in p.name]
    assert len(decoders) == 6 and all(mv[p] == single[p] for p in decoders)
    assert "pipeline_mv.json" in {p.name for p in mv} and "pipeline.json" not in {p.name for p in mv}


@pytest.fixture
def fake_mv(tiny_mv, tmp_path, monkeypatch):
    """An MV config of two Hub repos (t/p serves the tiny-mv pixal3d folder, t/d DINOv3) and a local NAF."""
    import huggingface_hub
    from huggingface_hub import constants

    hub = FakeHub(tiny_mv.tiny, tmp_path / "hub")
    hub.repos["t/p"] = tiny_mv.mv / "pixal3d"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("hf_hub_url", "get_hf_file_metadata", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, getattr(hub, name))
    config = tmp_path / "fetch_mv.yaml"
    config.write_text(yaml.safe_dump({"base": str(CONFIGS / "tiny_mv.yaml"), "weights": {
        "pixal3d": {"repo": "t/p", "revision": REV},
        "dinov3": {"repo": "t/d", "revision": REV, "files": ["config.json", "model.safetensors"]},
        "naf": {"local": str(tiny_mv.tiny / "naf"), "files": ["naf.safetensors"]}, "rembg": None}}))
    return types.SimpleNamespace(hub=hub, config=config)


def test_fetch_downloads_pipeline_mv_json_and_the_checkpoints_it_names(fake_mv):
    with pytest.raises(MissingWeightsError, match="pipeline_mv.json"):  # control: nothing is there before
        resolve_weights(load_config(fake_mv.config).weights, offline=True)
    assert main(["--config", str(fake_mv.config)]) == 0
    names = {f for repo, f, _ in fake_mv.hub.downloads if repo == "t/p"}
    assert "pipeline_mv.json" in names and "pipeline.json" not in names
    assert sum(f.startswith("ckpts/") for f in names) == 14 and sum(f.endswith("_mv.safetensors") for f in names) == 4
    resolved = resolve_weights(load_config(fake_mv.config).weights, offline=True)
    assert resolved.checkpoints["sparse_structure_flow_model"].name == "ss_flow_tiny_mv"
    assert resolved.checkpoints["sparse_structure_decoder"].name == "ss_dec_tiny"


def test_offline_the_mv_configs_missing_list_names_pipeline_mv_json_and_its_checkpoints(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = load_config(CONFIGS / "1024_cascade_mv.yaml")
    weights = dataclasses.replace(config.weights, dinov3=dataclasses.replace(config.weights.dinov3, repo=None,
                                                                             revision=None, local=str(tmp_path)))
    with pytest.raises(MissingWeightsError) as info:
        resolve_weights(weights, offline=True, models=["sparse_structure_flow_model", "shape_slat_decoder"])
    text = str(info.value)
    assert "    pipeline_mv.json" in text.splitlines() and "    pipeline.json" not in text.splitlines()
    assert "ckpts/ss_flow_img_dit_1_3B_64_bf16_mv.safetensors (named by pipeline_mv.json at this revision)" in text
    assert "ckpts/shape_dec_next_dc_f16c32_fp16.safetensors (named by pipeline_mv.json at this revision)" in text
    assert "ckpts/ss_flow_img_dit_1_3B_64_bf16.safetensors" not in text  # the single-view flow is not asked for


@pytest.mark.parametrize("name, base", [("1024_cascade_mv", "1024_cascade"), ("1536_cascade_mv", "1536_cascade"),
                                        ("tiny_mv", "tiny")])
def test_the_shipped_multiview_configs_are_their_cascades_with_the_multiview_weights(name, base):
    mv, single = load_config(CONFIGS / f"{name}.yaml"), load_config(CONFIGS / f"{base}.yaml")
    assert mv.name == name and mv.views is not None and mv.views.plan_views == 4 and single.views is None
    assert mv.weights.pipeline_json == "pipeline_mv.json" and mv.weights.moge is None
    assert mv.weights.pixal3d.revision == single.weights.pixal3d.revision
    assert dataclasses.replace(mv, name=base, source="", views=None, weights=single.weights) == \
        dataclasses.replace(single, source="")
