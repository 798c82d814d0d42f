"""``--plan`` from headers only (issue 30, item 5): the real 1024 cascade planned on an empty cache reads each
checkpoint's and DINOv3's safetensors header through the Hub's metadata API (HTTP range reads, faked here),
MoGe-2's size from the Hub's file listing, and downloads nothing but ``pipeline.json``; offline, one error lists
what it needs."""
from __future__ import annotations


import pytest

from pipelines import Pixal3D
from pixal3d.hub import MissingWeightsError
from pixal3d.pipeline_json import PINNED_CHECKPOINTS
from tests.support.header_hub import REAL, CHECKPOINTS, DINOV3_BYTES, MOGE_BYTES, hub  # noqa: F401


def test_the_real_cascade_is_planned_from_headers_without_downloading_any_weight(hub):
    """Every model's planned bytes are its header's (the flows and decoders at the real sizes of
    assets/checkpoints.json, DINOv3 from its header, MoGe-2 from the listing); the only download is
    pipeline.json, and DINOv3 was asked for its header, not its config or weights."""
    plan = Pixal3D.plan(REAL, device="cpu")
    sizes = plan.memory.model_bytes
    for name, entry in CHECKPOINTS.items():
        assert sizes[name] == hub.headers[f"{entry['file']}.safetensors"][1], name
    assert sizes["dinov3"] == DINOV3_BYTES and sizes["moge"] == MOGE_BYTES
    downloads = [c for c in hub.calls if c[0] == "snapshot_download" and not c[3]]
    assert downloads == [("snapshot_download", "TencentARC/Pixal3D", ("pipeline.json",), False)]
    headers = {c[2] for c in hub.calls if c[0] == "header"}
    # the seven checkpoints and DINOv3's model.safetensors; not the shape encoder's (a --mesh run's only)
    assert headers == set(hub.headers) - {"ckpts/shape_enc_next_dc_f16c32_fp16.safetensors"}
    assert plan.table()  # the rest of the plan is made as before


def test_offline_the_plan_names_every_header_it_needs_in_one_error(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MissingWeightsError) as caught:
        Pixal3D.plan(REAL, device="cpu")
    text = str(caught.value)
    for stem in next(iter(PINNED_CHECKPOINTS.values())).values():
        assert f"{stem}.safetensors" in text, stem
    assert "pipeline.json" in text and "model.safetensors" in text and "pixal3d-fetch" in text
    assert not [c for c in hub.calls if c[0] in ("header", "listing", "get_hf_file_metadata")]
