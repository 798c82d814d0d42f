"""Parity with TRELLIS.2's own texturing code (``Trellis2TexturingPipeline``), where it is present (skipped otherwise).

TRELLIS.2's pipeline steps run against this project's ``--mesh`` path on the same deterministic tiny weights (the
tiny demo's: ``pixal3d.tiny_weights``, ``configs/tiny.yaml``: the 48 grid, two ×2 levels to the 12 grid's latent),
on one dual grid: the voxels of a sphere shell at 48³ (5,192 voxels) with seeded random dual vertices and edge flags.
Compared bit for bit:

1. the shape latent: TRELLIS.2's ``encode_shape_slat`` (its SparseTensor, ``feats = dual_vertices * resolution -
   voxel_indices``, its ``FlexiDualGridVaeEncoder``/``SparseUnetVaeEncoder`` forward with its S2C blocks and
   ``SparseSpatial2Channel``) against ``FlexiDualGridVaeEncoder.encode`` here on ``DualGridFields`` whose
   ``dual_vertices`` are those offsets (computed by the same expression). Coords and features, in their own
   orders: both sort the parents lexicographically, so no sorting is needed (320 latent tokens);
2. the texture latent: TRELLIS.2's ``sample_tex_slat`` (its normalisation of the shape latent, its noise draw from
   the global generator seeded as its ``run`` seeds it, its ``FlowEulerGuidanceIntervalSampler`` with
   ``concat_cond``, its de-normalisation) against ``TextureStage.run`` here (its normalisation, ``draw_noise`` from
   the run's generator, ``flow_stage.sample`` → ``pixal3d.samplers.sample_flow_euler``), on the shape latent of 1.
   TRELLIS.2's texturing conditions on DINOv3's global tokens, Pixal3D's texture flow on projected pixel-aligned
   features: both sides get the same condition dict (seeded random ``global`` and ``proj`` of the texture flow's
   shapes, the negative its zeros), the texture stage's conditioning step replaced by one returning it. Twice: the
   tiny config's texture sampler (guidance 1: no CFG) and one with CFG, rescale and an interval;
3. the decode to the mesh's voxels: TRELLIS.2's ``decode_tex_slat`` (its ``SparseUnetVaeDecoder`` whose
   ``SparseChannel2Spatial`` blocks, given no subdivision, read the children the encoder's ``SparseSpatial2Channel``
   left in the spatial cache the latent carries through sampling) against ``MeshDecodeStage.run`` here
   (``guide_to_voxels`` + ``SparseUnetVaeDecoder.decode_pbr``). TRELLIS.2 decodes in the dual grid's own row order,
   this project parent by parent: the voxels and their six attributes are compared after sorting both by (x, y, z).

What is not TRELLIS.2's code on its side: the submanifold convolution kernel (FlexGEMM, a CUDA extension), which
its stand-in computes with this project's ``pixal3d.nn.sparse_conv`` (TRELLIS.2's ``SparseConv3d`` module, its
``conv_flex_gemm`` backend, weight layout and neighbour-cache reuse are its own); the texture flow network (this
project's ``ElasticSLatFlowModel`` on both sides, as the multi-view parity test does: TRELLIS.2's needs
flash-attn, and Pixal3D's texture flow is pixel-aligned); and the voxeliser (o_voxel's C++: the test hands both
sides the same dual grid; the voxeliser's own parity is another test's). Everything else on its side -- its
SparseTensor and spatial caches, S2C/C2S, encoder/decoder blocks, layer norms, linears, fp16/fp32 placement, the
pipeline's normalisation and noise draw, the sampler and its CFG mixins -- is TRELLIS.2's code as committed.

To run it, assemble TRELLIS.2's files in a folder outside this repository (no network: it reads a local clone or
checkout) with ``python scripts/assemble_trellis2_reference.py --out /work/refs/trellis2-tex [--source CLONE]``.
It copies these files of microsoft/TRELLIS.2 @ 5565d24 unchanged (the package keeps its name, ``trellis2``: nothing
here is called that):

    trellis2/pipelines/__init__.py, base.py, trellis2_texturing.py
    trellis2/pipelines/samplers/__init__.py, base.py, flow_euler.py, classifier_free_guidance_mixin.py,
        guidance_interval_mixin.py
    trellis2/models/__init__.py, models/sc_vaes/sparse_unet_vae.py, models/sc_vaes/fdg_vae.py
    trellis2/modules/norm.py, modules/utils.py
    trellis2/modules/sparse/__init__.py, basic.py, config.py, linear.py
    trellis2/modules/sparse/spatial/__init__.py, basic.py, spatial2channel.py
    trellis2/modules/sparse/conv/__init__.py, config.py, conv.py, conv_flex_gemm.py

and writes these stand-ins: ``trellis2/__init__.py`` (empty: TRELLIS.2's imports every subpackage),
``trellis2/modules/image_feature_extractor.py`` and ``trellis2/pipelines/rembg/__init__.py`` (empty: DINOv3 and
BiRefNet are not run), ``trellis2/representations/__init__.py`` (a ``Mesh`` that raises: only the shape decoder
builds one), ``flex_gemm`` (``ops.spconv.sparse_submanifold_conv3d`` by this project's kernel, no-op
``set_algorithm``/``set_hashmap_ratio``, a raising ``ops.grid_sample.grid_sample_3d``), ``o_voxel``
(``convert.mesh_to_flexible_dual_grid`` and ``flexible_dual_grid_to_mesh`` raising: the test replaces the first with
one returning its dual grid), empty ``cumesh``, ``nvdiffrast.torch`` and ``cv2`` (the bake is not run), and
``easydict`` (``EasyDict``). The folder's README.md lists the same. Then:

    PIXAL3D_TRELLIS2_REFERENCE=/work/refs/trellis2-tex python -m pytest -q tests/pixal3d/models/test_texturing_reference_parity.py

Each comparison has a control that makes it fail: one changed encoder or decoder weight on TRELLIS.2's side,
another seed, one voxel fewer.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import trimesh

import pipelines.texture as texture_module
from pipelines.mesh_decode import MeshDecodeStage
from pipelines.state import RunState
from pipelines.texture import TextureStage
from pixal3d.config import SamplerConfig, load_config
from pixal3d.mesh.fields import DualGridFields
from pixal3d.models.conditioning import negative_condition
from pixal3d.models.loading import build_model
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.pipeline_json import Normalization
from pixal3d.tiny_weights import (
    CHECKPOINTS,
    SHAPE_ENCODER,
    checkpoint_state,
    pipeline_json,
)

TINY_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
SEED = 42
GRID_SEED = 7
SHELL_RADIUS = 15.0  # voxels of the 48 grid; a shell 1.8 voxels thick
STAND_INS = ("flex_gemm", "o_voxel", "cumesh", "nvdiffrast", "cv2", "easydict")
"""The top-level stand-ins the assembled folder provides; taken out of ``sys.modules`` once TRELLIS.2's modules hold
them, so nothing else in the session imports them."""
CFG_SAMPLER = {"steps": 3, "guidance_strength": 3.0, "guidance_rescale": 0.7, "guidance_interval": (0.7, 1.0),
               "rescale_t": 3.0}
"""A texture sampler with every branch of the guidance: its steps' times 1, 0.857, 0.6 are two CFG steps with
rescale inside the interval and one positive-only step outside it."""


def _reference_folder() -> Path:
    folder = os.environ.get("PIXAL3D_TRELLIS2_REFERENCE")
    if not folder or not (Path(folder) / "trellis2" / "pipelines" / "trellis2_texturing.py").is_file():
        pytest.skip("TRELLIS.2's texturing code is not here: assemble it with scripts/assemble_trellis2_reference.py "
                    "(see this module's docstring) and set PIXAL3D_TRELLIS2_REFERENCE=FOLDER to run the parity test")
    return Path(folder)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """TRELLIS.2's modules: the texturing pipeline, its encoder and decoder classes, its samplers."""
    folder = _reference_folder()
    sys.path.insert(0, str(folder))
    try:
        sparse_config = importlib.import_module("trellis2.modules.sparse.config")
        sparse_config.set_conv_backend("flex_gemm")  # its default; SPARSE_CONV_BACKEND could have changed it
        importlib.import_module("trellis2.modules.sparse.conv.conv_flex_gemm")  # imported lazily by SparseConv3d
        texturing = importlib.import_module("trellis2.pipelines.trellis2_texturing")
        vaes = importlib.import_module("trellis2.models.sc_vaes.fdg_vae")
        samplers = importlib.import_module("trellis2.pipelines.samplers")
    finally:
        sys.path.remove(str(folder))
        for name in [n for n in sys.modules if n.split(".")[0] in STAND_INS and _inside(sys.modules[n], folder)]:
            del sys.modules[name]
    for module in (texturing, vaes, samplers, texturing.o_voxel, sys.modules[vaes.SparseUnetVaeDecoder.__module__]):
        if not _inside(module, folder):
            pytest.fail(f"{module.__name__} was imported from {module.__file__}, not from {folder}: another "
                        f"TRELLIS.2 (or o_voxel) is installed or already imported; run the test without it")
    return {"texturing": texturing, "encoder": vaes.FlexiDualGridVaeEncoder, "decoder": vaes.SparseUnetVaeDecoder,
            "samplers": samplers}


def _inside(module, folder: Path) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(folder.resolve())


@dataclass(frozen=True)
class DualGrid:
    """One dual grid in o_voxel's terms (``voxel_indices [M, 3]`` int32, ``dual_vertices [M, 3]`` in the unit cube's
    frame, ``intersected [M, 3]`` bool) and this project's (``fields``: the vertices as offsets in their voxel)."""

    voxel_indices: torch.Tensor
    dual_vertices: torch.Tensor
    intersected: torch.Tensor
    fields: DualGridFields


@pytest.fixture(scope="module")
def config():
    return load_config(TINY_CONFIG)


@pytest.fixture(scope="module")
def dual_grid(config) -> DualGrid:
    resolution = config.upsample.hr_resolution
    axis = torch.arange(resolution)
    cells = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).reshape(-1, 3)  # [R³, 3]
    radius = ((cells.float() + 0.5 - resolution / 2) ** 2).sum(dim=-1).sqrt()
    voxels = cells[(radius - SHELL_RADIUS).abs() < 0.9].to(torch.int32)  # [M, 3], lexicographic
    generator = torch.Generator().manual_seed(GRID_SEED)
    dual_vertices = (voxels.float() + torch.rand(len(voxels), 3, generator=generator)) / resolution
    intersected = torch.rand(len(voxels), 3, generator=generator) < 0.3
    offsets = dual_vertices * resolution - voxels  # encode_shape_slat's expression
    fields = DualGridFields(coords=voxels, dual_vertices=offsets, intersected=intersected,
                            split_weight=torch.ones(len(voxels)), resolution=resolution)
    return DualGrid(voxels, dual_vertices, intersected, fields)


def _ours(spec: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec, device="cpu")
    model.load_state_dict(state, strict=True)
    return model.eval()


def _theirs(cls: type, spec: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """TRELLIS.2's class on the same arguments (its ``block_args`` given: it has no default), the same tensors."""
    with torch.random.fork_rng(devices=[]):  # its initialize_weights draws from the global generator
        model = cls(**spec["args"], block_args=[{}] * len(spec["args"]["num_blocks"]))
    model.load_state_dict(state, strict=True)
    return model.eval()


def _changed(state: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """``state`` with one element of ``key`` moved by 1e-3 (the controls)."""
    tensor = state[key].clone()
    tensor.view(-1)[0] += 1e-3
    return {**state, key: tensor}


class _TheirSparse(torch.nn.Module):
    """This project's texture flow under TRELLIS.2's sampler: its SparseTensor in and out, the cond dict as given."""

    def __init__(self, ours: torch.nn.Module):
        super().__init__()
        self.ours = ours
        self.in_channels = ours.in_channels  # sample_tex_slat reads it for the noise's channels

    def forward(self, x, t, cond, concat_cond=None):
        out = self.ours(SparseTensor(x.feats, x.coords), t, cond,
                        concat_cond=SparseTensor(concat_cond.feats, concat_cond.coords))
        return x.replace(out.feats)


def _trellis2_pipeline(reference, models: dict[str, torch.nn.Module], sampler: SamplerConfig):
    norm = pipeline_json()["args"]
    samplers = reference["samplers"]
    return reference["texturing"].Trellis2TexturingPipeline(
        models, tex_slat_sampler=samplers.FlowEulerGuidanceIntervalSampler(sigma_min=sampler.sigma_min),
        tex_slat_sampler_params={"steps": sampler.steps, "rescale_t": sampler.rescale_t,
                                 "guidance_strength": sampler.guidance_strength,
                                 "guidance_rescale": sampler.guidance_rescale,
                                 "guidance_interval": list(sampler.guidance_interval)},
        shape_slat_normalization=norm["shape_slat_normalization"],
        tex_slat_normalization=norm["tex_slat_normalization"], low_vram=False)


def _trellis2_encode(reference, monkeypatch, pipeline, grid: DualGrid, resolution: int):
    """TRELLIS.2's ``encode_shape_slat`` with its voxeliser handing back ``grid``."""
    def voxelise(vertices, faces, grid_size, **kwargs):
        assert grid_size == resolution
        return grid.voxel_indices, grid.dual_vertices, grid.intersected

    monkeypatch.setattr(reference["texturing"].o_voxel.convert, "mesh_to_flexible_dual_grid", voxelise)
    with torch.no_grad():
        return pipeline.encode_shape_slat(trimesh.creation.box(extents=(0.5, 0.5, 0.5)), resolution)


def _trellis2_sample(pipeline, cond: dict[str, Any], flow: torch.nn.Module, shape_slat, seed: int):
    """TRELLIS.2's ``sample_tex_slat`` with the global generator seeded as its ``run`` seeds it (restored after)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return pipeline.sample_tex_slat({"cond": cond, "neg_cond": negative_condition(cond)}, _TheirSparse(flow),
                                        shape_slat, {})


def _our_texture(monkeypatch, config, sampler: SamplerConfig, cond, flow, shape_latent, seed: int) -> SparseTensor:
    """``TextureStage.run`` on ``shape_latent`` with its conditioning step returning ``cond``."""
    def condition(state, models, ext, coords, **kwargs):
        assert torch.equal(coords, shape_latent.coords)
        return cond
    monkeypatch.setattr(texture_module, "stage_condition", condition)
    norm = pipeline_json()["args"]
    state = RunState(input_image=None, generator=torch.Generator().manual_seed(seed), device=torch.device("cpu"),
                     shape_normalization=Normalization(**norm["shape_slat_normalization"]),
                     tex_normalization=Normalization(**norm["tex_slat_normalization"]))
    state.shape_latent, state.hr_resolution = shape_latent, config.upsample.hr_resolution
    stage = TextureStage.from_config(replace(config, texture=replace(config.texture, sampler=sampler)))
    with torch.no_grad():
        stage.run(state, {"tex_slat_flow_model_1024": flow, "naf": None})
    return state.tex_latent


def _our_decode(config, decoder, tex_latent: SparseTensor, voxels: torch.Tensor):
    state = RunState(input_image=None, generator=torch.Generator(), device=torch.device("cpu"),
                     shape_normalization=None, tex_normalization=None)
    state.tex_latent, state.mesh_voxels, state.hr_resolution = tex_latent, voxels, config.upsample.hr_resolution
    MeshDecodeStage.from_config(config).run(state, {"tex_slat_decoder": decoder})
    return state.pbr


def _sorted(coords: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ordered by (x, y, z) of ``coords [M, 3]``."""
    c = coords.to(torch.int64)
    order = torch.argsort((c[:, 0] * 4096 + c[:, 1]) * 4096 + c[:, 2])
    return coords[order], feats[order]


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """The tiny demo's encoder, texture flow and texture decoder: (spec, state dict) under the demo's labels."""
    specs = {"shape_encoder": SHAPE_ENCODER[1], "tex_slat_flow_model_1024": CHECKPOINTS["tex_slat_flow_model_1024"][1],
             "tex_slat_decoder": CHECKPOINTS["tex_slat_decoder"][1]}
    return {name: (spec, checkpoint_state(name, spec)) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def flow(weights) -> torch.nn.Module:
    return _ours(*weights["tex_slat_flow_model_1024"])


@pytest.fixture(scope="module")
def our_latent(weights, dual_grid) -> SparseTensor:
    return _ours(*weights["shape_encoder"]).encode(dual_grid.fields).latent


def _condition(coords: torch.Tensor) -> dict[str, Any]:
    """A seeded random condition of the texture flow's shapes: ``global [1, 5, C]``, ``proj`` on ``coords``."""
    generator = torch.Generator().manual_seed(SEED + 1)
    spec = CHECKPOINTS["tex_slat_flow_model_1024"][1]["args"]
    return {"global": torch.randn(1, 5, spec["cond_channels"], generator=generator),
            "proj": SparseTensor(torch.randn(coords.shape[0], spec["proj_in_channels"], generator=generator), coords)}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_shape_latent_is_trellis2s_encode_shape_slat_bitwise(reference, monkeypatch, config, weights, dual_grid,
                                                             our_latent, precision):
    """fp32: the tiny demo's encoder; fp16: the same weights with the published encoder's fp16 torso."""
    spec, state = weights["shape_encoder"]
    spec = {**spec, "args": {**spec["args"], "use_fp16": precision == "fp16"}}
    resolution = config.upsample.hr_resolution
    their_encoder = _theirs(reference["encoder"], spec, state)
    mine = _ours(spec, state)
    placement = {key: t.dtype for key, t in mine.state_dict().items()}
    assert placement == {key: t.dtype for key, t in their_encoder.state_dict().items()}
    assert (torch.float16 in placement.values()) == (precision == "fp16")
    latent = mine.encode(dual_grid.fields).latent
    if precision == "fp32":
        assert torch.equal(latent.feats, our_latent.feats)  # the latent the other tests sample on
    pipeline = _trellis2_pipeline(reference, {"shape_slat_encoder": their_encoder}, config.texture.sampler)
    theirs = _trellis2_encode(reference, monkeypatch, pipeline, dual_grid, resolution)
    assert latent.coords.shape[0] > 100  # a real latent: 320 tokens of the 12 grid
    assert torch.equal(theirs.coords, latent.coords)  # both lexicographic: no sorting
    assert torch.equal(theirs.feats, latent.feats)
    # control: one changed weight of TRELLIS.2's encoder gives another latent
    changed = _changed(state, "blocks.1.0.conv.weight")
    pipeline.models["shape_slat_encoder"] = _theirs(reference["encoder"], spec, changed)
    other = _trellis2_encode(reference, monkeypatch, pipeline, dual_grid, resolution)
    assert torch.equal(other.coords, latent.coords) and not torch.equal(other.feats, latent.feats)


@pytest.mark.parametrize("sampler_kind", ["tiny", "cfg"])
def test_texture_latent_is_trellis2s_sample_tex_slat_bitwise(reference, monkeypatch, config, weights, dual_grid,
                                                             flow, our_latent, sampler_kind):
    spec, state = weights["shape_encoder"]
    sampler = config.texture.sampler if sampler_kind == "tiny" else replace(config.texture.sampler, **CFG_SAMPLER)
    pipeline = _trellis2_pipeline(reference, {"shape_slat_encoder": _theirs(reference["encoder"], spec, state)},
                                  sampler)
    shape_slat = _trellis2_encode(reference, monkeypatch, pipeline, dual_grid, config.upsample.hr_resolution)
    cond = _condition(our_latent.coords)
    theirs = _trellis2_sample(pipeline, cond, flow, shape_slat, SEED)
    mine = _our_texture(monkeypatch, config, sampler, cond, flow, our_latent, SEED)
    assert torch.equal(theirs.coords, mine.coords)
    assert torch.equal(theirs.feats, mine.feats)
    # control: another seed draws other noise
    other = _our_texture(monkeypatch, config, sampler, cond, flow, our_latent, SEED + 1)
    assert not torch.equal(theirs.feats, other.feats)


def test_decoded_voxels_are_trellis2s_decode_tex_slat_bitwise(reference, monkeypatch, config, weights, dual_grid,
                                                              flow, our_latent):
    spec, state = weights["shape_encoder"]
    dec_spec, dec_state = weights["tex_slat_decoder"]
    models = {"shape_slat_encoder": _theirs(reference["encoder"], spec, state),
              "tex_slat_decoder": _theirs(reference["decoder"], dec_spec, dec_state)}
    pipeline = _trellis2_pipeline(reference, models, config.texture.sampler)
    shape_slat = _trellis2_encode(reference, monkeypatch, pipeline, dual_grid, config.upsample.hr_resolution)
    cond = _condition(our_latent.coords)
    tex_slat = _trellis2_sample(pipeline, cond, flow, shape_slat, SEED)
    with torch.no_grad():
        theirs = pipeline.decode_tex_slat(tex_slat)  # its C2S blocks read the encoder's children from the cache
    tex_latent = _our_texture(monkeypatch, config, config.texture.sampler, cond, flow, our_latent, SEED)
    decoder = _ours(dec_spec, dec_state)
    mine = _our_decode(config, decoder, tex_latent, dual_grid.voxel_indices)
    # TRELLIS.2 decodes exactly the dual grid's voxels, in its rows' order; this project parent by parent
    assert torch.equal(theirs.coords[:, 1:], dual_grid.voxel_indices)
    assert not torch.equal(mine.coords, dual_grid.voxel_indices)
    their_coords, their_attrs = _sorted(theirs.coords[:, 1:], theirs.feats)
    my_coords, my_attrs = _sorted(mine.coords, mine.attrs)
    assert torch.equal(their_coords, my_coords)
    assert torch.equal(their_attrs, my_attrs)
    # controls: one changed weight of TRELLIS.2's decoder gives other attributes; one voxel fewer, another set
    pipeline.models["tex_slat_decoder"] = _theirs(reference["decoder"], dec_spec,
                                                  _changed(dec_state, "blocks.1.0.conv.weight"))
    with torch.no_grad():
        other = pipeline.decode_tex_slat(tex_slat)
    assert not torch.equal(_sorted(other.coords[:, 1:], other.feats)[1], my_attrs)
    fewer = _our_decode(config, decoder, tex_latent, dual_grid.voxel_indices[1:])
    assert fewer.coords.shape[0] == my_coords.shape[0] - 1
