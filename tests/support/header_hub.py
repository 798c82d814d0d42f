"""The Hub the plan asks for the real cascade's headers (faked): each checkpoint's safetensors header at its released
shapes (DINOv3's: transformers' ViT-L/16 at the released config, under the names a file saved before transformers 5
has, ``layer.N.``), MoGe-2's size from a listing; nothing downloaded but pipeline.json."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from pixal3d.pipeline_json import PINNED_CHECKPOINTS, PUBLISHED_INTERVALS
from pixal3d.tiny_weights import pipeline_json
from pixal3d.weight_sources import SHAPE_ENCODER_STEM

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "configs" / "1024_cascade.yaml"
CHECKPOINTS = json.loads((REPO / "assets" / "checkpoints.json").read_text())["models"]
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4}
DINOV3_BYTES = 1_212_518_400  # a ViT-L/16 in fp32: what the fake header of its model.safetensors says
MOGE_BYTES = 1_325_000_000


SHAPE_ENCODER_RELEASED = {"name": "FlexiDualGridVaeEncoder", "args": {
    "model_channels": [64, 128, 256, 512, 1024], "latent_channels": 32, "num_blocks": [0, 4, 8, 16, 4],
    "block_type": ["SparseConvNeXtBlock3d"] * 5, "down_block_type": ["SparseResBlockS2C3d"] * 4,
    "block_args": [{"use_checkpoint": True}] * 2 + [{"use_checkpoint": False}] * 3, "use_fp16": True}}
"""``shape_enc_next_dc_f16c32_fp16``'s config: TRELLIS.2's configs/scvae/shape_vae_next_dc_f16c32_fp16.json
``models.encoder`` (microsoft/TRELLIS.2@5565d24), which the released checkpoint's json carries."""


def shape_encoder_entry() -> dict:
    """The shape encoder's tensors at the released config (from its definition on ``meta``: it is not among
    checkpoints.json's seven), stored F16 as TRELLIS.2's decoder files are."""
    from pixal3d.models import build_model

    model = build_model(SHAPE_ENCODER_RELEASED, device="meta")
    return {"dtype": "F16", "tensors": {k: list(v.shape) for k, v in model.state_dict().items()}}


def _header(entry):
    """A fake ``parse_safetensors_file_metadata`` answer: the real checkpoint's tensors, back to back."""
    size, offset, tensors = DTYPE_BYTES[entry["dtype"]], 0, {}
    for name, shape in entry["tensors"].items():
        end = offset + math.prod(shape) * size
        tensors[name] = SimpleNamespace(data_offsets=(offset, end))
        offset = end
    return SimpleNamespace(tensors=tensors), offset


def dinov3_header():
    """A fake header of DINOv3 ViT-L/16's ``model.safetensors``: every tensor of transformers' model at the
    released config (float32), its layers named ``layer.N.`` as in a file saved before transformers 5."""
    import torch
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    from scripts.write_random_checkpoints import DINOV3_VITL16

    with torch.device("meta"):
        model = DINOv3ViTModel(DINOv3ViTConfig(**DINOV3_VITL16))
    offset, tensors = 0, {}
    for name, tensor in model.state_dict().items():
        end = offset + tensor.numel() * 4
        tensors[name.removeprefix("model.")] = SimpleNamespace(data_offsets=(offset, end))
        offset = end
    return SimpleNamespace(tensors=tensors), offset


class FakeHub:
    """The Hub's answers the plan may ask for, and a log of every call; no file download but pipeline.json."""

    def __init__(self, root: Path):
        import huggingface_hub.errors

        self.root, self.calls, self.snapshot = root, [], None
        self.missing = huggingface_hub.errors.LocalEntryNotFoundError
        stems = next(iter(PINNED_CHECKPOINTS.values()))
        self.pipeline = pipeline_json()
        self.pipeline["args"]["models"] = dict(stems)
        for section, interval in PUBLISHED_INTERVALS.items():
            self.pipeline["args"][section] = {"params": {"guidance_interval": list(interval)}}
        by_file = {entry["file"]: entry for entry in CHECKPOINTS.values()}
        self.headers = {f"{stem}.safetensors": _header(by_file[stem]) for stem in stems.values()}
        self.headers["model.safetensors"] = dinov3_header()
        assert self.headers["model.safetensors"][1] == DINOV3_BYTES
        self.headers[f"{SHAPE_ENCODER_STEM}.safetensors"] = _header(shape_encoder_entry())

    def snapshot_download(self, repo_id, revision=None, allow_patterns=None, local_files_only=False, **_):
        self.calls.append(("snapshot_download", repo_id, tuple(allow_patterns or ()), local_files_only))
        if local_files_only:  # the cache holds only what was downloaded here: pipeline.json
            if self.snapshot is None or list(allow_patterns) != ["pipeline.json"]:
                raise self.missing("not in the cache")
            return str(self.snapshot)
        assert list(allow_patterns) == ["pipeline.json"], allow_patterns  # nothing else is ever downloaded
        self.snapshot = self.root / "snapshot"
        self.snapshot.mkdir(exist_ok=True)
        (self.snapshot / "pipeline.json").write_text(json.dumps(self.pipeline))
        return str(self.snapshot)

    def get_hf_file_metadata(self, url, timeout=None, **_):
        self.calls.append(("get_hf_file_metadata", url))
        return SimpleNamespace(size=1)

    def parse_safetensors_file_metadata(self, repo_id, filename, revision=None, **_):
        self.calls.append(("header", repo_id, filename))
        return self.headers[filename][0]

    def get_paths_info(self, repo_id, paths, revision=None, **_):
        self.calls.append(("listing", repo_id, tuple(paths)))
        return [SimpleNamespace(size=MOGE_BYTES)]

    def hf_hub_download(self, *args, **kwargs):
        raise AssertionError(f"the plan downloaded a file: {args} {kwargs}")


def install_hub(fake: FakeHub, tmp_path, monkeypatch) -> FakeHub:
    """``fake`` in place of huggingface_hub's functions the plan calls, with an empty cache and the network allowed."""
    import huggingface_hub

    monkeypatch.setenv("PIXAL3D_CACHE", str(tmp_path / "pixal3d"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for name in ("snapshot_download", "get_hf_file_metadata", "parse_safetensors_file_metadata", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, getattr(fake, name))
    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", fake.get_paths_info)
    return fake


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return install_hub(FakeHub(tmp_path), tmp_path, monkeypatch)
