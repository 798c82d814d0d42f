"""Write the MoGe-2 reference data from the MoGe source itself (microsoft/MoGe must be importable: ``pip install
"git+https://github.com/microsoft/MoGe.git"`` or its checkout on ``PYTHONPATH``; only this script and the parity
test that reuses it import it — the package does not).

1. ``assets/moge_checkpoint.json``: every tensor (name, shape) of MoGe's own ``MoGeModel`` built at the released
   ``model_config`` of Ruicheng/moge-2-vitl (``RELEASED_MODEL_CONFIG``), its parameter count and the config.
2. ``tests/fixtures/moge_parity.{safetensors,json}``: MoGe's outputs for the offline demo's MoGe-2
   (``pixal3d.tiny_weights.MOGE_CONFIG`` and its generated ``model.pt``, loaded into MoGe's model strictly) on
   ``assets/example.png`` preprocessed and reduced to 64² (square) and a 64 × 48 crop of it, with ``infer``'s
   float16 autocast and in float32: the raw forward (points, mask), ``recover_focal_shift`` on it, and ``infer``'s
   points, depth, mask, intrinsics and the horizontal fov as the reference reads it — float32 tensors stored,
   float16 ones as fingerprints (sha256 of dtype, shape, bytes), to keep the file small. The kernels (pinned as
   the suite pins them, ``pixal3d.kernels``), threads and library versions are recorded, and the kind of CPU
   that made it (``verified_on``): the values are bit-exact for those.

    PYTHONPATH=/path/to/MoGe:/path/to/utils3d python scripts/make_moge_fixture.py

The released ``model_config``: the MoGe-2 architecture of MoGe's ``configs/train/v2.json`` (the ViT-L model)
without its ``normal_head`` — Ruicheng/moge-2-vitl is the model without normals (its model card: 326M
parameters, "-normal": 331M; this config gives 326,209,227, with the normal head 330,901,550).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d import kernels  # noqa: E402  (imports no torch)

if __name__ == "__main__":
    kernels.apply_recommended_pins()  # before torch, as tests/conftest.py does: the fixture's bits are the suite's

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "assets" / "moge_checkpoint.json"
FIXTURE = REPO / "tests" / "fixtures" / "moge_parity"
RELEASE = {"repo": "Ruicheng/moge-2-vitl", "revision": "39c4d5e957afe587e04eec59dc2bcc3be5ecd968", "file": "model.pt"}


def _stack(dim_in: Any, dim_out: Any, num_res_blocks: list[int]) -> dict[str, Any]:
    return {"dim_in": dim_in, "dim_out": dim_out, "dim_res_blocks": [1024, 256, 128, 64, 32],
            "num_res_blocks": num_res_blocks, "res_block_in_norm": "none", "res_block_hidden_norm": "none",
            "resamplers": ["conv_transpose", "conv_transpose", "conv_transpose", "bilinear"]}


RELEASED_MODEL_CONFIG: dict[str, Any] = {
    "encoder": {"backbone": "dinov2_vitl14", "intermediate_layers": [5, 11, 17, 23], "dim_out": 1024},
    "neck": _stack([1026, 2, 2, 2, 2], None, [0, 2, 2, 2, 0]),
    "points_head": _stack([1024, 256, 128, 64, 32], [None, None, None, None, 3], [0, 1, 1, 1, 0]),
    "mask_head": _stack([1024, 256, 128, 64, 32], [None, None, None, None, 1], [0, 1, 1, 1, 0]),
    "scale_head": {"dims": [1024, 1024, 1024, 1]},
    "remap_output": "exp",
    "num_tokens_range": [1200, 3600],
}

TINY_VIT = {"tiny_vit14": dict(embed_dim=32, depth=2, num_heads=2)}
"""Backbones MoGe's hub does not name, built from its ``DinoVisionTransformer`` with the hub loaders' settings."""


def moge_reference_model(model_config: dict[str, Any]) -> torch.nn.Module:
    """MoGe's own ``MoGeModel`` for ``model_config`` (CPU, MoGe's random init); a ``tiny_vit14`` backbone is
    MoGe's ``DinoVisionTransformer`` with the settings of its hub loaders at toy width."""
    from moge.model.dinov2.layers import MemEffAttention, NestedTensorBlock
    from moge.model.dinov2.models.vision_transformer import DinoVisionTransformer
    from moge.model.v2 import MoGeModel

    backbone = model_config["encoder"]["backbone"]
    if backbone not in TINY_VIT:
        return MoGeModel(**model_config).eval()
    config = json.loads(json.dumps(model_config))
    config["encoder"]["backbone"] = "dinov2_vits14"
    model = MoGeModel(**config).eval()
    vit = DinoVisionTransformer(img_size=518, patch_size=14, mlp_ratio=4, init_values=1.0, ffn_layer="mlp",
                                block_chunks=0, num_register_tokens=0, interpolate_antialias=False,
                                interpolate_offset=0.1, block_fn=functools.partial(NestedTensorBlock,
                                                                                     attn_class=MemEffAttention),
                                **TINY_VIT[backbone])
    encoder = model.encoder
    encoder.backbone = vit
    encoder.output_projections = torch.nn.ModuleList(
        torch.nn.Conv2d(vit.embed_dim, config["encoder"]["dim_out"], 1) for _ in encoder.output_projections)
    return model.eval()


def fixture_images() -> dict[str, torch.Tensor]:
    """``[3, H, W]`` float32 in [0, 1]: the example preprocessed and reduced to 64² (LANCZOS), and a 64 × 48 crop."""
    from PIL import Image

    from pixal3d.models.preprocess import load_image, preprocess_image

    image = preprocess_image(load_image(REPO / "assets" / "example.png")).resize((64, 64), Image.LANCZOS)
    square = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()
    return {"square": square, "tall": square[:, :, 8:56].contiguous()}


def horizontal_fov(intrinsics: torch.Tensor, width: int) -> float:
    """The reference's ``camera_angle_x`` (radians) from MoGe's normalised intrinsics
    (``get_camera_params_wild_moge``)."""
    k = intrinsics.squeeze().cpu().numpy()
    fx = k[0, 0] * width
    return 2 * math.atan(width / (2 * fx))


def platform_key() -> dict[str, Any]:
    """What the fixture's bits depend on: the kernels (``pixal3d.kernels.key()``: architecture and pinned family),
    the threads and the versions of torch, NumPy and SciPy (MINPACK)."""
    import scipy

    return {"kernels": kernels.key(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "numpy": np.__version__, "scipy": scipy.__version__}


def write_manifest() -> None:
    model = moge_reference_model(RELEASED_MODEL_CONFIG)
    state = model.state_dict()
    dtypes = sorted({str(t.dtype) for t in state.values()})
    manifest = {
        "about": ("Every tensor of Ruicheng/moge-2-vitl's model.pt ('model' in {'model_config', 'model'}), as "
                  "MoGe's own MoGeModel (microsoft/MoGe moge/model/v2.py) defines it at the released model_config "
                  "below, written by scripts/make_moge_fixture.py. The file itself could not be downloaded where "
                  "this was written (no Hub access): the list is derived from the model definition. Cross-checks: "
                  "the parameter count is the model card's 326M; torch.save of this state with this config is "
                  "1,305,025,803 bytes against 1,305,030,700 reported (by a third party) for the file at this "
                  "revision: the float32 payload, 1,304,836,908 bytes, accounts for all but ~5 kB of pickle."),
        **RELEASE,
        "model_config": RELEASED_MODEL_CONFIG,
        "params": sum(t.numel() for t in state.values()),
        "dtype": "F32" if dtypes == ["torch.float32"] else dtypes,
        "tensors": {k: list(t.shape) for k, t in state.items()},
    }
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {MANIFEST}: {len(state)} tensors, {manifest['params']:,} parameters")


def write_fixture() -> None:
    from moge.utils.geometry_torch import recover_focal_shift

    from pixal3d.staging.fingerprint import fingerprint_tensor
    from pixal3d.tiny_weights import MOGE_CONFIG, _write_moge

    with tempfile.TemporaryDirectory() as tmp:
        _write_moge(Path(tmp))
        state = torch.load(Path(tmp) / "model.pt", weights_only=True)["model"]
    model = moge_reference_model(MOGE_CONFIG)
    model.load_state_dict(state, strict=True)  # the tiny file has exactly MoGe's keys
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"platform": platform_key(), "verified_on": [kernels.cpu_kind()], "config": MOGE_CONFIG,
                            "fov": {}, "fingerprints": {}}
    for name, image in fixture_images().items():
        tensors[f"{name}.image"] = image
        for fp16 in (True, False):
            key = f"{name}.{'fp16' if fp16 else 'fp32'}"
            with torch.inference_mode():
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    low, high = model.num_tokens_range
                    raw = model.forward(image[None], num_tokens=int(low + (9 / 9) * (high - low)))
                points, mask = raw["points"].float(), raw["mask"].float()
                focal, shift = recover_focal_shift(points, mask > 0.5)
                out = model.infer(image, use_fp16=fp16)
            values = {"raw_points": points, "raw_mask": mask, "focal": focal, "shift": shift, "points": out["points"],
                      "depth": out["depth"], "mask": out["mask"], "intrinsics": out["intrinsics"]}
            if fp16:
                meta["fingerprints"][key] = {k: fingerprint_tensor(v) for k, v in values.items()}
            else:
                tensors.update({f"{key}.{k}": v for k, v in values.items()})
            meta["fov"][key] = horizontal_fov(out["intrinsics"], image.shape[-1])
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(FIXTURE.with_suffix(".safetensors")))
    FIXTURE.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {FIXTURE}.{{safetensors,json}}: fov {meta['fov']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("checkpoint", "fixture"))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)  # as the test suite (tests/conftest.py): the bits depend on it
    if args.only != "fixture":
        write_manifest()
    if args.only != "checkpoint":
        write_fixture()
    return 0


if __name__ == "__main__":
    sys.exit(main())
