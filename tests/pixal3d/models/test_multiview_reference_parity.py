"""Parity with upstream Pixal3D's own multi-view code, where it is present (skipped otherwise).

Upstream's ``inference_mv.py`` (its ``load_views``), ``DinoV3ProjMultiViewFeatureExtractor`` and
``Pixal3DMVImageTo3DPipeline.run_mv`` (with the inherited ``run``, its samplers and ``SparseTensor``) run on the
example views folder against the views cascade here, on the same deterministic random weights: tiny widths at
the real cascade's geometry (grids 16/32/64, four subdivision levels, 512 → 1024), which upstream's ``run``
hard-codes, and the extractors' image and NAF sizes divided by 4 (128/256 px, NAF to 128/256: they are the
extractors' own arguments; at the real 512/1024 px the extractor comparison passed too, in about 7 minutes).
Compared bit for bit: the view tensors (at 64, 512 and 1024 px), the four fused conditions, and every stage's
output (coords, LR latent, HR coords, HR shape latent, texture latent: 248 LR and 2,293 HR tokens).

What is not upstream's code on its side: the networks. Both sides run this project's networks on the same
checkpoints (Pixal3D's dense structure-flow source is not public; the sparse ones need flex_gemm/flash-attn; NAF
needs natten: CUDA extensions), so this compares everything multi-view adds and everything the cascade does around
the networks. ``decode_latent`` (o_voxel's mesh extraction, CuMesh's hole filling: CUDA) is not run, so the mesh
is not compared.

To run it, assemble upstream's files in a folder (never in this repository), renaming the package ``pixal3d`` to
``pixal3d_ref`` so it imports beside ours (inference_mv.py's three absolute ``pixal3d.`` imports with it):

    inference_mv.py                                         biop99999111/Pixal3D-vast-bumper@370baf80 (a fork of
    pixal3d_ref/trainers/flow_matching/mixins/               upstream; kevpug/test-pixal3d carries the same
        image_conditioned_proj.py                            multi-view code)
    pixal3d_ref/pipelines/pixal3d_mv_image_to_3d.py, pixal3d_image_to_3d.py     the same fork @370baf80
    pixal3d_ref/pipelines/base.py                           TencentARC/Pixal3D@0660b18a
    pixal3d_ref/pipelines/samplers/flow_euler.py            TencentARC/Pixal3D@d62ec299
    pixal3d_ref/pipelines/samplers/classifier_free_guidance_mixin.py, guidance_interval_mixin.py, base.py
                                                            TRELLIS.2's (as Pixal3D carries them)
    pixal3d_ref/modules/sparse/basic.py                     TencentARC/Pixal3D@0de32299

with empty ``__init__.py`` files and small stand-ins for what the inference path imports but does not use here:
``modules/sparse/config.py`` (``CONV = 'none'``, ``DEBUG = False``), ``modules/sparse/__init__.py`` (basic's
names), ``pipelines/__init__.py`` (the two pipelines and ``samplers``), ``samplers/__init__.py``, ``utils/
dist_utils.py``, ``modules/image_feature_extractor.py``, ``representations/__init__.py`` (``Mesh``,
``MeshWithVoxel``), ``pipelines/rembg/__init__.py``, top-level ``easydict`` (``EasyDict``) and ``o_voxel``, and
``_shims/torchvision`` (``transforms.Compose``/``Normalize`` with torchvision's semantics: the test puts it in
``sys.modules`` only after transformers is imported). This machine's copy: /work/refs/pixal3d-mv (its README.md
lists the same). Then:

    PIXAL3D_MV_REFERENCE=/path/to/that/folder python -m pytest -q tests/pixal3d/models/test_multiview_reference_parity.py
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from pipelines import Pixal3D
from pipelines.loaders import load_naf_weights
from pixal3d.config import load_config
from pixal3d.models.loading import load_model
from pixal3d.models.multiview import (
    PosedViews,
    condition_views,
    view_features,
    view_pixels,
)
from pixal3d.models.views import load_view, read_views
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.pipeline_json import published_samplers
from pixal3d.staging.fingerprint import fingerprint_tensor
from pixal3d.tiny_weights import CHECKPOINTS, checkpoint_state
from tests.support.cascade_fixtures import REPO, tiny_cache  # noqa: F401

EXAMPLE_VIEWS = REPO / "assets" / "views_example"
SEED = 11
LATENT = 8
STEPS = 2
SIZES = {"ss": (128, None), "shape_512": (128, 128), "shape_1024": (256, 128), "tex_1024": (256, 256)}
"""Each extractor's image size and NAF size: upstream's 512/512, 1024/512, 1024/1024, divided by 4."""
SECTIONS = {"ss": "structure", "shape_512": "shape_512", "shape_1024": "shape_1024", "tex_1024": "texture"}


def _reference_folder() -> Path:
    folder = os.environ.get("PIXAL3D_MV_REFERENCE")
    if not folder or not (Path(folder) / "inference_mv.py").is_file():
        pytest.skip("upstream's multi-view code is not here: assemble it as the module docstring says and set "
                    "PIXAL3D_MV_REFERENCE=FOLDER (e.g. /work/refs/pixal3d-mv) to run the parity test")
    return Path(folder)


@pytest.fixture(scope="module")
def reference():
    """Upstream's modules: inference_mv, the extractor module, the pipelines and samplers, its SparseTensor."""
    folder = _reference_folder()
    from transformers import DINOv3ViTModel  # noqa: F401  (before the torchvision shim: transformers probes it)

    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("torchvision", folder / "_shims" / "torchvision" / "__init__.py",
                                                  submodule_search_locations=[str(folder / "_shims" / "torchvision")])
    shim = importlib.util.module_from_spec(spec)
    sys.modules["torchvision"] = shim
    saved_env = dict(os.environ)
    try:
        spec.loader.exec_module(shim)
        import inference_mv
        import pixal3d_ref.trainers.flow_matching.mixins.image_conditioned_proj  # noqa: F401  (imported lazily)
        from pixal3d_ref.modules.sparse import SparseTensor as RefSparseTensor
        from pixal3d_ref.pipelines import samplers
    finally:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        os.environ.clear()
        os.environ.update(saved_env)  # inference_mv sets ATTN_BACKEND and friends at import
        sys.path.remove(str(folder))
    return {"inference_mv": inference_mv, "SparseTensor": RefSparseTensor, "samplers": samplers}


# -- the weights: tiny widths, the real cascade's geometry ---------------------------------------------------
def _decoder_spec(cls: str, **extra) -> dict:
    return {"name": cls, "args": dict(
        model_channels=[32, 16, 8, 8, 8], latent_channels=LATENT, num_blocks=[1, 1, 1, 1, 1],
        block_type=["SparseConvNeXtBlock3d"] * 5, up_block_type=["SparseResBlockC2S3d"] * 4, use_fp16=False, **extra)}


def _specs() -> dict[str, tuple[str, dict]]:
    specs = {name: (stem.replace("tiny", "parity_mv"), json.loads(json.dumps(spec)))
             for name, (stem, spec, _) in CHECKPOINTS.items()}
    for name, resolution in (("sparse_structure_flow_model", 16), ("shape_slat_flow_model_512", 32),
                             ("shape_slat_flow_model_1024", 64), ("tex_slat_flow_model_1024", 64)):
        specs[name][1]["args"]["resolution"] = resolution
    specs["shape_slat_decoder"] = (specs["shape_slat_decoder"][0], _decoder_spec("FlexiDualGridVaeDecoder",
                                                                                 resolution=1024))
    specs["tex_slat_decoder"] = (specs["tex_slat_decoder"][0], _decoder_spec("SparseUnetVaeDecoder", out_channels=6,
                                                                             pred_subdiv=False))
    return specs


SCALES = {("sparse_structure_decoder", "out_layer.2.weight"): 150.0}
BIASES = {("sparse_structure_decoder", "out_layer.2.bias"): -2.2,  # a few hundred of the 32³ coords occupied
          **{("shape_slat_decoder", f"blocks.{i}.1.to_subdiv.bias"): -0.5 for i in range(4)}}


@pytest.fixture(scope="module")
def parity_config(tiny_cache, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mv-parity")
    pipe = root / "pixal3d"
    (pipe / "ckpts").mkdir(parents=True)
    models = {}
    for name, (stem, spec) in _specs().items():
        state = checkpoint_state(f"parity/{name}", spec)
        for (model, key), value in SCALES.items():
            if model == name:
                state[key] = state[key] * value
        for (model, key), value in BIASES.items():
            if model == name:
                state[key] = torch.full_like(state[key], value)
        save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(pipe / f"{stem}.safetensors"))
        (pipe / f"{stem}.json").write_text(json.dumps(spec))
        models[name] = stem
    norm = {"mean": [0.1 + 0.05 * i for i in range(LATENT)], "std": [1.0 + 0.1 * i for i in range(LATENT)]}
    (pipe / "pipeline_mv.json").write_text(json.dumps({"name": "Pixal3DMVImageTo3DPipeline", "args": {
        "models": models, "shape_slat_normalization": norm, "tex_slat_normalization": norm,
        **published_samplers()}}))
    tiny = tiny_cache / "tiny" / "tiny-v6"
    sections = {SECTIONS[name]: {"latent_channels": LATENT, "sampler": {"steps": STEPS},
                                 "condition": {"image_size": size, **({"naf_size": naf} if naf else {})}}
                for name, (size, naf) in SIZES.items()}
    config = root / "parity_mv.yaml"
    config.write_text(yaml.safe_dump({
        "base": str(REPO / "configs" / "1024_cascade_mv.yaml"), "name": "parity_mv",
        "weights": {"pixal3d": {"local": str(pipe)}, "pipeline_json": "pipeline_mv.json", "rembg": None,
                    "dinov3": {"local": str(tiny / "dinov3"), "files": ["config.json", "model.safetensors"]},
                    "naf": {"local": str(tiny / "naf"), "files": ["naf.safetensors"]}},
        **sections}))
    return config


# -- upstream's side ------------------------------------------------------------------------------------------
class _Dense(torch.nn.Module):
    """A network of this project under upstream's pipeline: dense inputs pass as they are."""

    def __init__(self, ours):
        super().__init__()
        self.ours = ours
        self.resolution, self.in_channels = getattr(ours, "resolution", None), getattr(ours, "in_channels", None)

    def forward(self, *args):
        return self.ours(*args)


class _Sparse(_Dense):
    """A sparse network of this project under upstream's pipeline: upstream's SparseTensor in and out."""

    def forward(self, x, t, cond, concat_cond=None):
        def ours(s):
            return SparseTensor(s.feats, s.coords)
        out = self.ours(ours(x), t, {"global": cond["global"], "proj": ours(cond["proj"])},
                        concat_cond=None if concat_cond is None else ours(concat_cond))
        return x.replace(out.feats)

    def upsample(self, slat, upsample_times):
        return self.ours.upsample(SparseTensor(slat.feats, slat.coords), upsample_times)


def _reference_extractors(reference, config, dinov3, naf):
    extractors = {}
    for name, cfg in reference["inference_mv"].IMAGE_COND_CONFIGS.items():
        size, naf_size = SIZES[name]
        cfg = {**cfg, "model_name": str(dinov3), "image_size": size,
               **({"naf_target_size": naf_size} if naf_size else {})}
        extractor = reference["inference_mv"].build_image_cond_model(cfg)
        extractor.model.layer = extractor.model.model.layer  # transformers 5 moved the layers under .model
        extractor.naf_model = naf  # natten (CUDA) replaced by this project's NAF, the same weights
        extractors[name] = extractor
    return extractors


def _reference_run(reference, config, views, weights_dir, dinov3, naf):
    """upstream's run_mv with this project's networks; returns its captured conditions and outputs."""
    pipes = sys.modules["pixal3d_ref.pipelines"]
    samplers = reference["samplers"]
    args = json.loads((weights_dir / "pipeline_mv.json").read_text())["args"]
    models = {name: (_Dense if name.startswith("sparse_structure") else _Sparse)(
        load_model(weights_dir / stem, device="cpu")) for name, stem in args["models"].items()}
    extractors = _reference_extractors(reference, config, dinov3, naf)
    pipeline = pipes.Pixal3DMVImageTo3DPipeline(
        models,
        **{f"{kind}_sampler": samplers.FlowEulerGuidanceIntervalSampler(**args[f"{kind}_sampler"]["args"])
           for kind in ("sparse_structure", "shape_slat", "tex_slat")},
        **{f"{kind}_sampler_params": args[f"{kind}_sampler"]["params"]
           for kind in ("sparse_structure", "shape_slat", "tex_slat")},
        shape_slat_normalization=args["shape_slat_normalization"],
        tex_slat_normalization=args["tex_slat_normalization"],
        image_cond_model_ss=extractors["ss"], image_cond_model_shape_512=extractors["shape_512"],
        image_cond_model_shape_1024=extractors["shape_1024"], image_cond_model_tex_1024=extractors["tex_1024"],
        low_vram=False)
    captured = {"conds": []}
    for method in ("get_proj_cond_ss", "get_proj_cond_shape"):
        original = getattr(pipeline, method)

        def capture(*a, _original=original, **k):
            out = _original(*a, **k)
            captured["conds"].append(out["cond"])
            return out
        setattr(pipeline, method, capture)
    for method in ("sample_sparse_structure", "sample_shape_slat", "sample_tex_slat"):
        original = getattr(pipeline, method)

        def capture(*a, _original=original, _name=method, **k):
            out = _original(*a, **k)
            captured[_name] = out
            return out
        setattr(pipeline, method, capture)
    pipeline.decode_latent = lambda shape_slat, tex_slat, res: []  # o_voxel and CuMesh (CUDA): not run
    params = {f"{kind}_sampler_params": dataclasses.asdict(getattr(config, stage).sampler)
              for kind, stage in (("sparse_structure", "structure"), ("shape_slat", "shape_512"),
                                  ("tex_slat", "texture"))}
    for p in params.values():
        for key in ("guidance_interval", "sigma_min"):
            p.pop(key)
    _, (shape_slat, tex_slat, res) = pipeline.run_mv(views, seed=SEED, return_latent=True,
                                                     pipeline_type="1024_cascade", **params)
    captured.update(shape_slat=shape_slat, tex_slat=tex_slat, res=res)
    return captured


def test_view_tensors_are_upstreams_load_views(reference):
    views = reference["inference_mv"].load_views(str(EXAMPLE_VIEWS), image_sizes=(64, 512, 1024))
    ours = read_views(EXAMPLE_VIEWS)
    for size, batch in views["images"].items():
        mine = torch.stack([view_pixels(load_view(frame), size) for frame in ours.frames])[None]
        assert torch.equal(batch, mine), size
    assert torch.equal(views["transform_matrix"][0], torch.tensor([f.transform for f in ours.frames],
                                                                  dtype=torch.float32))
    assert views["camera_distance"][0, 0].item() == torch.tensor(ours.distance, dtype=torch.float32).item()


def test_fused_conditions_and_every_stage_are_upstreams_bitwise(reference, parity_config):
    config = load_config(parity_config)
    weights_dir = Path(config.weights.pixal3d.local)
    dinov3, naf_file = Path(config.weights.dinov3.local), Path(config.weights.naf.local) / "naf.safetensors"
    naf = load_naf_weights(naf_file, torch.device("cpu"))
    views = reference["inference_mv"].load_views(str(EXAMPLE_VIEWS), image_sizes=(128, 256))
    theirs = _reference_run(reference, config, views, weights_dir, dinov3, naf)

    with Pixal3D.from_config(config, policy="eager", device="cpu", until="texture") as pipe:
        mine = pipe.run(views=EXAMPLE_VIEWS, seed=SEED)
    prints = mine.fingerprints()
    # 1. the four fused conditions
    stages = ["structure", "shape_512", "shape_1024", "texture"]
    assert len(theirs["conds"]) == 4
    for stage, cond in zip(stages, theirs["conds"]):
        proj = cond["proj"] if isinstance(cond["proj"], torch.Tensor) else cond["proj"].feats
        assert fingerprint_tensor(cond["global"]) == prints[stage]["cond.global"], stage
        key = "cond.proj" if isinstance(cond["proj"], torch.Tensor) else "cond.proj.feats"
        assert fingerprint_tensor(proj) == prints[stage][key], stage
    # 2. every stage's outputs (noise included: the same draws from the same seed, in the same order)
    state = mine.state
    assert 0 < state.coords_lr.shape[0] < state.coords_hr.shape[0]  # a real structure and an upsampled one
    assert torch.equal(theirs["sample_sparse_structure"], state.coords_lr)
    assert torch.equal(theirs["sample_shape_slat"].feats, state.lr_latent.feats)
    assert torch.equal(theirs["shape_slat"].coords, state.coords_hr)
    assert torch.equal(theirs["shape_slat"].feats, state.shape_latent.feats)
    assert torch.equal(theirs["sample_tex_slat"].feats, state.tex_latent.feats)
    assert theirs["res"] == state.hr_resolution
    # control: three of the four views give other conditions, so the comparison sees the views
    with Pixal3D.from_config(config, policy="eager", device="cpu", until="structure") as pipe:
        three = pipe.run(views=EXAMPLE_VIEWS, num_views=3, seed=SEED).fingerprints()
    assert three["structure"]["cond.proj"] != fingerprint_tensor(theirs["conds"][0]["proj"])


def test_upstreams_extractor_on_our_conditions_is_our_condition_bitwise(reference, parity_config):
    """The extractor alone, on the dense grids: each of the four, upstream's forward against condition_views."""
    config = load_config(parity_config)
    dinov3 = Path(config.weights.dinov3.local)
    naf = load_naf_weights(Path(config.weights.naf.local) / "naf.safetensors", torch.device("cpu"))
    views = reference["inference_mv"].load_views(str(EXAMPLE_VIEWS), image_sizes=(128, 256))
    ours = read_views(EXAMPLE_VIEWS)
    posed = PosedViews(tuple(load_view(f) for f in ours.frames), views["transform_matrix"][0],
                       views["camera_angle_x"][0], ours.mesh_scale, tuple(f.name for f in ours.frames))
    from pipelines.flow_stage import extractor as stage_extractor
    from pixal3d.models.dinov3 import load_dinov3

    backbone = load_dinov3(dinov3)
    for name, extractor in _reference_extractors(reference, config, dinov3, naf).items():
        ext = stage_extractor(name, getattr(config, SECTIONS[name]).condition, extractor.grid_resolution)
        with torch.no_grad():
            z_global, z_proj = extractor(views["images"][extractor.image_size],
                                         camera_angle_x=views["camera_angle_x"], distance=views["camera_distance"],
                                         mesh_scale=torch.tensor([views["mesh_scale"]], dtype=torch.float32),
                                         transform_matrix=views["transform_matrix"])
        features = view_features(backbone, posed, [ext.image_size]).at(ext.image_size)
        cond = condition_views(ext, features, posed, None, naf=naf, naf_mode="full")
        assert torch.equal(z_global, cond["global"]), name
        assert torch.equal(z_proj, cond["proj"]), name
