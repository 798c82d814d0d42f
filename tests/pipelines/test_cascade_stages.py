"""Stage-level rules of the cascade, without networks: coords pooling, the cascade quantizer and token
budget, camera/preprocess needs, fingerprints, noise normalization directions."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from torch import nn

from pipelines.camera import CameraStage
from pipelines.preprocess import PreprocessStage
from pipelines.state import RunState
from pipelines.structure import EmptyStructureError, occupied_coords
from pipelines.upsample import UpsampleStage, quantize_coords
from pixal3d.config import UpsampleConfig
from pixal3d.models.preprocess import load_image
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.pipeline_json import Normalization
from pixal3d.staging.fingerprint import fingerprint_tensor, fingerprints

EXAMPLE = Path(__file__).resolve().parents[2] / "assets" / "example.png"


def _state(image: Path = EXAMPLE, **fields) -> RunState:
    unit = Normalization(mean=(0.0,), std=(1.0,))
    state = RunState(input_image=load_image(image), generator=torch.Generator().manual_seed(0),
                     device=torch.device("cpu"), shape_normalization=unit, tex_normalization=unit)
    for key, value in fields.items():
        setattr(state, key, value)
    return state


def test_occupied_coords_max_pools_then_lists_positive_voxels_in_lexicographic_order():
    logits = torch.full((1, 1, 4, 4, 4), -1.0)
    logits[0, 0, 3, 0, 1] = 0.5   # pooled voxel (1, 0, 0)
    logits[0, 0, 0, 2, 2] = 2.0   # pooled voxel (0, 1, 1)
    coords = occupied_coords(logits, 2)
    assert coords.dtype == torch.int32
    assert coords.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    with pytest.raises(EmptyStructureError):
        occupied_coords(torch.full((1, 1, 4, 4, 4), -1.0), 2)


def test_quantizer_is_pixal3ds_rounding_rule_with_unique_sorted_rows():
    fine = torch.tensor([[0, 511, 0, 256], [0, 510, 1, 255], [0, 0, 0, 0]], dtype=torch.int32)
    coords = quantize_coords(fine, 512, 64)
    expected = sorted({(0, *[round((c + 0.5) / 512 * 63) for c in row[1:]]) for row in fine.tolist()})
    assert coords.tolist() == [list(r) for r in expected] and coords.dtype == torch.int32
    assert coords.tolist()[-1] == [0, 63, 0, 32]
    # round((7 + 0.5) / 512 * 63) = 1, where TRELLIS.2's int((c + 0.5) / 512 * 64) would give 0
    assert quantize_coords(torch.tensor([[0, 7, 0, 0]], dtype=torch.int32), 512, 64).tolist() == [[0, 1, 0, 0]]


class _Upsampler(nn.Module):
    """Stands in for the shape decoder: ``upsample`` returns a dense block of fine coords."""

    def __init__(self, side: int):
        super().__init__()
        self.side = side

    def upsample(self, latent, times):
        g = torch.arange(self.side)
        xyz = torch.cartesian_prod(g, g, g)
        return torch.cat([torch.zeros(len(xyz), 1, dtype=torch.long), xyz], 1).int()


def test_token_budget_steps_the_resolution_down_by_128_until_under_budget_or_1024():
    """The 1536 cascade's loop with a 125-token budget: a block of 24³ fine coords has 125, 125, 125, 64 HR
    tokens at 1536, 1408, 1280, 1152; the loop stops at the first count under (not equal to) the budget."""
    config = UpsampleConfig(times=4, hr_resolution=1536, max_tokens=125, resolution_step=128, min_resolution=1024)
    results = {}
    for side in (16, 24, 40):
        state = _state(lr_latent=None)
        UpsampleStage(config, 32).run(state, {"shape_slat_decoder": _Upsampler(side)})
        results[side] = (state.hr_resolution, len(state.coords_hr))
    assert results[16] == (1536, 64)      # under budget at once: no step down
    assert results[24] == (1152, 64)      # 125 is not under 125: keep stepping
    assert results[40] == (1024, 216)     # never under budget: stops at min_resolution


def test_an_upsampling_that_keeps_no_voxel_is_a_clear_empty_structure_error():
    """All subdivision logits <= 0: stop at the upsample stage, not with an obscure failure on 0 HR tokens."""
    config = UpsampleConfig(times=4, hr_resolution=1024)
    coords = torch.tensor([[0, 1, 2, 3], [0, 2, 2, 3], [0, 3, 2, 3]], dtype=torch.int32)
    latent = SparseTensor(torch.zeros(3, 32), coords)
    state = _state(lr_latent=latent)
    with pytest.raises(EmptyStructureError, match="kept no voxel when upsampling the 3 LR tokens"):
        UpsampleStage(config, 32).run(state, {"shape_slat_decoder": _Upsampler(0)})
    assert state.coords_hr is None


def test_camera_stage_needs_moge_only_without_a_field_of_view():
    assert CameraStage(49.0, use_moge=True).needs == ()
    assert CameraStage(None, use_moge=True).needs == ("moge",)
    assert CameraStage(None, use_moge=False).needs == ()
    state = _state()
    CameraStage(60.0, use_moge=False).run(state, {})
    assert state.camera.fov == pytest.approx(math.radians(60.0))
    assert state.camera.distance == pytest.approx(0.5 / math.tan(math.radians(30.0)), rel=1e-6)


class _Forbidden(dict):
    def __getitem__(self, name):
        raise AssertionError(f"{name} must not be loaded")


def test_an_rgba_input_never_loads_the_background_remover():
    stage = PreprocessStage(remover="birefnet-general")
    assert stage.needs == ("rembg",)
    state = _state()
    stage.run(state, _Forbidden())
    assert state.image.mode == "RGB" and state.image.size[0] == state.image.size[1]


class _RandomEstimator(nn.Module):
    """A camera estimator / background remover that consumes the global generator, as a model might."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def infer(self, pixels, *, use_fp16=True, band_rows=None):
        torch.randn(16)
        return SimpleNamespace(intrinsics=torch.tensor([[0.8, 0.0, 0.5], [0.0, 0.8, 0.5], [0.0, 0.0, 1.0]]))

    def forward(self, image):
        torch.randn(16)
        rgba = image.convert("RGBA")
        rgba.putalpha(255)
        inner = rgba.crop((8, 8, rgba.width - 8, rgba.height - 8))
        rgba.paste((0, 0, 0, 0), (0, 0, rgba.width, rgba.height))
        rgba.paste(inner, (8, 8))
        return rgba


def test_camera_and_background_models_do_not_move_the_global_generator(tmp_path):
    """The reference runs them before seeding; here the run draws from its own generator, and the global one
    (which a user's code may rely on) is left where it was."""
    rgb = tmp_path / "rgb.png"
    Image.new("RGB", (64, 64), (200, 120, 40)).save(rgb)
    state = _state(rgb)
    models = {"rembg": _RandomEstimator(), "moge": _RandomEstimator()}
    torch.manual_seed(0)
    PreprocessStage(remover="birefnet-general").run(state, models)
    CameraStage(None, use_moge=True).run(state, models)
    after = torch.randn(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.randn(4))
    torch.manual_seed(0)
    models["moge"].infer(None)  # control: the same model outside the stage does move the generator
    assert not torch.equal(torch.randn(4), after)


def test_fingerprints_cover_dtype_shape_and_bytes():
    a = torch.arange(6, dtype=torch.float32)
    assert fingerprint_tensor(a) == fingerprint_tensor(a.clone())
    assert fingerprint_tensor(a) != fingerprint_tensor(a.reshape(2, 3))
    assert fingerprint_tensor(a) != fingerprint_tensor(a.view(torch.int32))
    b = a.clone()
    b[3] = torch.nextafter(b[3], torch.tensor(10.0))
    assert fingerprint_tensor(a) != fingerprint_tensor(b)
    sparse = SparseTensor(torch.ones(2, 3), torch.zeros(2, 4, dtype=torch.int32))
    keys = fingerprints({"x": sparse, "m": torch.tensor([True, False]), "n": 1.5}, "out")
    assert sorted(keys) == ["out.m", "out.n", "out.x.coords", "out.x.feats"]


class _ZeroFlow(nn.Module):
    """A flow predicting zero velocity (the sampler returns its noise); records the concat_cond it is given."""

    def __init__(self):
        super().__init__()
        self.concat = []

    def forward(self, x, t, cond, concat_cond=None):
        self.concat.append(concat_cond)
        return x.replace(torch.zeros_like(x.feats))


def test_shape_and_texture_latents_are_normalized_in_the_reference_directions(monkeypatch):
    """Shape: ``latent·std + mean``; texture: the flow gets ``(shape − mean_s)/std_s`` as concat_cond and its
    output becomes ``latent·std_t + mean_t`` (reference §1.5, §1.8)."""
    from pipelines import shape_1024, texture
    from pixal3d.config import ConditionConfig, SamplerConfig, ShapeConfig

    for module in (shape_1024, texture):
        monkeypatch.setattr(module, "stage_condition", lambda *a, **k: {})
    sampler = SamplerConfig(steps=2, guidance_strength=1.0, guidance_rescale=0.0, guidance_interval=(0.6, 0.9),
                            rescale_t=3.0)
    cfg = ShapeConfig(latent_channels=2, sampler=sampler, condition=ConditionConfig(image_size=64))
    shape_norm, tex_norm = Normalization(mean=(1.0, -2.0), std=(3.0, 0.5)), Normalization(mean=(5.0, 6.0),
                                                                                         std=(2.0, 4.0))
    coords = torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]], dtype=torch.int32)
    state = _state(coords_hr=coords, hr_resolution=48, shape_normalization=shape_norm, tex_normalization=tex_norm)
    shape_flow, tex_flow = _ZeroFlow(), _ZeroFlow()
    shape_1024.Shape1024Stage(cfg, 2, 48).run(state, {"shape_slat_flow_model_1024": shape_flow})
    texture.TextureStage(cfg, 2, 48).run(state, {"tex_slat_flow_model_1024": tex_flow})
    s_mean, s_std = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 0.5]])
    assert torch.allclose(state.shape_latent.feats, state.hr_noise * s_std + s_mean)
    assert torch.allclose(tex_flow.concat[0].feats, state.hr_noise, atol=1e-6)  # the round trip of the shape
    t_mean, t_std = torch.tensor([[5.0, 6.0]]), torch.tensor([[2.0, 4.0]])
    assert torch.allclose(state.tex_latent.feats, state.tex_noise * t_std + t_mean)
    assert not torch.equal(state.hr_noise, state.tex_noise)
