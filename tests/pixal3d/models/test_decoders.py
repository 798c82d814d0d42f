"""The three decoders: key contract with the published checkpoints (meta), dtype placement through
``load_model``, and tiny CPU decoders (cascade upsample, shape fields, guided texture voxels)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pixal3d.mesh.fields import DualGridFields, PbrVoxels
from pixal3d.models.loading import build_model, load_model, save_model
from pixal3d.models.sparse_structure_decoder import SparseStructureDecoder, pixel_shuffle_3d
from pixal3d.models.sparse_unet_vae import FlexiDualGridVaeDecoder, SparseResBlockC2S3d, SparseUnetVaeDecoder
from pixal3d.nn.sparse_ops import subdivide
from pixal3d.nn.sparse_tensor import SparseTensor

MANIFEST = Path(__file__).resolve().parents[3] / "assets" / "checkpoints.json"  # copy of shared/reference/
DECODERS = ("sparse_structure_decoder", "shape_slat_decoder", "tex_slat_decoder")


def _manifest() -> dict:
    return json.loads(MANIFEST.read_text())["models"]


def _is_fp32_param(name: str) -> bool:
    """Reference placement: the ends and every norm parameter fp32, the torso's convs/linears fp16."""
    ends = ("input_layer.", "out_layer.", "from_latent.", "output_layer.")
    return name.startswith(ends) or ".norm" in name


@pytest.mark.parametrize("name", DECODERS)
def test_meta_build_matches_the_published_checkpoint(name):
    entry = _manifest()[name]
    model = build_model({"name": entry["class"], "args": entry["args"]}, device="meta")
    state = model.state_dict()
    assert {k: list(v.shape) for k, v in state.items()} == entry["tensors"]
    assert sum(v.numel() for v in state.values()) == entry["params"]
    wrong = [k for k, v in state.items() if v.dtype != (torch.float32 if _is_fp32_param(k) else torch.float16)]
    assert not wrong, f"dtype placement differs from the reference for {wrong[:5]}"


def test_structure_changing_args_are_honoured():
    entry = _manifest()["tex_slat_decoder"]
    args = dict(entry["args"], pred_subdiv=True)
    model = build_model({"name": entry["class"], "args": args}, device="meta")
    assert "blocks.0.4.to_subdiv.weight" in model.state_dict()
    args["block_args"] = [dict(a, mlp_ratio=2.0) for a in entry["args"]["block_args"]]
    model = build_model({"name": entry["class"], "args": args}, device="meta")
    assert model.state_dict()["blocks.0.0.mlp.0.weight"].shape == (2048, 1024)
    args["block_args"] = [dict(a, heads=4) for a in entry["args"]["block_args"]]
    with pytest.raises(ValueError, match="heads"):
        build_model({"name": entry["class"], "args": args}, device="meta")


# ---------------------------------------------------------------------------------------------- tiny models
TINY_UNET = {"model_channels": [32, 16, 8], "latent_channels": 4, "num_blocks": [1, 1, 0],
             "block_type": ["SparseConvNeXtBlock3d"] * 3, "up_block_type": ["SparseResBlockC2S3d"] * 2,
             "block_args": [{"use_checkpoint": False}] * 3}


def _latent(seed: int = 0, n: int = 40, grid: int = 6) -> SparseTensor:
    gen = torch.Generator().manual_seed(seed)
    cells = torch.randperm(grid**3, generator=gen)[:n].sort().values
    coords = torch.stack([torch.zeros_like(cells), cells // grid**2, cells // grid % grid, cells % grid], 1)
    return SparseTensor(torch.randn(n, 4, generator=gen), coords.to(torch.int32))


def _tiny_pair(use_fp16: bool = False) -> tuple[FlexiDualGridVaeDecoder, SparseUnetVaeDecoder]:
    torch.manual_seed(0)
    shape = FlexiDualGridVaeDecoder(resolution=24, use_fp16=use_fp16, **TINY_UNET).eval()
    tex = SparseUnetVaeDecoder(out_channels=6, pred_subdiv=False, use_fp16=use_fp16, **TINY_UNET).eval()
    return shape, tex


@pytest.mark.parametrize("use_fp16", [False, True])
def test_upsample_coordinates_follow_the_subdivision_logits(use_fp16):
    shape, _ = _tiny_pair(use_fp16)
    latent = _latent()
    with torch.no_grad():
        h, subs = shape(latent, return_subs=True)
    assert [s.feats.shape[1] for s in subs] == [8, 8]
    assert subs[0].feats.dtype == (torch.float16 if use_fp16 else torch.float32)
    assert 0 < int((subs[0].feats > 0).sum()) < 8 * len(latent)  # a real choice, not all or nothing
    once = shape.upsample(latent, 1)
    assert once.shape[0] == int((subs[0].feats > 0).sum())
    assert torch.equal(once, subdivide(latent.coords, subs[0].feats > 0)[0])
    assert torch.equal(subs[1].coords, once)
    twice = shape.upsample(latent, 2)
    assert twice.shape[0] == int((subs[1].feats > 0).sum())
    assert torch.equal(twice, h.coords)
    assert int(twice[:, 1:].max()) < 6 * 4
    assert torch.equal(shape.upsample(latent, 0), latent.coords)
    with pytest.raises(ValueError, match="times=3"):
        shape.upsample(latent, 3)


def test_shape_fields_follow_the_reference_formulas():
    shape, _ = _tiny_pair()
    latent = _latent(1)
    fields, subs = shape.decode_fields(latent)
    with torch.no_grad():
        h = shape(latent)
    assert isinstance(fields, DualGridFields) and fields.resolution == 24
    assert len(subs) == 2
    assert torch.equal(fields.coords, h.coords[:, 1:]) and fields.coords.dtype == torch.int32
    torch.testing.assert_close(fields.dual_vertices, 2 * torch.sigmoid(h.feats[:, 0:3]) - 0.5)
    assert torch.equal(fields.intersected, h.feats[:, 3:6] > 0)
    torch.testing.assert_close(fields.split_weight, F.softplus(h.feats[:, 6]))
    assert fields.dual_vertices.dtype == torch.float32 and fields.split_weight.shape == (len(h),)
    assert 0 < int(fields.intersected.sum()) < fields.intersected.numel()
    shape.set_resolution(48)
    assert shape.decode_fields(latent)[0].resolution == 48


@pytest.mark.parametrize("use_fp16", [False, True])
def test_guided_texture_decoder_yields_the_shape_voxels(use_fp16):
    shape, tex = _tiny_pair(use_fp16)
    latent = _latent(2)
    fields, subs = shape.decode_fields(latent)
    tex_latent = latent.replace(torch.randn(len(latent), 4, generator=torch.Generator().manual_seed(3)))
    voxels = tex.decode_pbr(tex_latent, subs, resolution=fields.resolution)
    assert isinstance(voxels, PbrVoxels)
    assert torch.equal(voxels.coords, fields.coords)  # same voxels, same row order
    with torch.no_grad():
        raw = tex(tex_latent, guide_subs=subs)
    assert voxels.attrs.shape == (len(fields.coords), 6) and voxels.attrs.dtype == torch.float32
    torch.testing.assert_close(voxels.attrs, raw.feats * 0.5 + 0.5)


def test_texture_decoder_needs_matching_guide_subs():
    shape, tex = _tiny_pair()
    latent = _latent(4)
    _, subs = shape.decode_fields(latent)
    with pytest.raises(ValueError, match="needs guide_subs"):
        tex(latent)
    with pytest.raises(ValueError, match="2 upsampling stages"):
        tex(latent, guide_subs=subs[:1])
    with pytest.raises(ValueError, match="subdivision logits must be"):
        tex(_latent(5, n=30), guide_subs=subs)
    with pytest.raises(ValueError, match="pred_subdiv=False"):
        shape(latent, guide_subs=subs)


def _dense_channel_to_space(x: torch.Tensor) -> torch.Tensor:
    """``[1, 8·C, X, Y, Z]`` -> ``[1, C, 2X, 2Y, 2Z]``, child ``k = bx + 2·by + 4·bz`` (independent dense form)."""
    _, c8, *size = x.shape
    x = x.reshape(1, 2, 2, 2, c8 // 8, *size)  # [1, bz, by, bx, C, X, Y, Z]
    x = x.permute(0, 4, 5, 3, 6, 2, 7, 1)  # [1, C, X, bx, Y, by, Z, bz]
    return x.reshape(1, c8 // 8, *(2 * s for s in size))


def test_c2s_block_equals_a_dense_computation_on_a_full_grid():
    torch.manual_seed(0)
    block = SparseResBlockC2S3d(16, 8, pred_subdiv=False).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    size = (3, 2, 4)
    coords = torch.cartesian_prod(torch.zeros(1, dtype=torch.long), *(torch.arange(s) for s in size)).to(torch.int32)
    x = SparseTensor(torch.randn(len(coords), 16, dtype=torch.float64), coords)
    keep_all = x.replace(torch.ones(len(x), 8, dtype=torch.float64))
    out, _ = block(x, keep_all)

    dense = x.feats.reshape(1, *size, 16).permute(0, 4, 1, 2, 3)  # [1, 16, X, Y, Z]
    conv = lambda t, m: F.conv3d(t, m.weight.permute(0, 4, 1, 2, 3), m.bias, padding=1)
    def norm(t, m):  # LayerNorm32: fp32 statistics whatever the activation dtype
        w, b = (None, None) if m.weight is None else (m.weight.float(), m.bias.float())
        out = F.layer_norm(t.permute(0, 2, 3, 4, 1).float(), t.shape[1:2], w, b, 1e-6)
        return out.double().permute(0, 4, 1, 2, 3)
    h = _dense_channel_to_space(conv(F.silu(norm(dense, block.norm1)), block.conv1))
    h = conv(F.silu(norm(h, block.norm2)), block.conv2)
    ref = h + _dense_channel_to_space(dense).repeat_interleave(4, dim=1)
    c = out.coords.long()
    assert len(out) == 8 * len(x)
    torch.testing.assert_close(out.feats, ref[0, :, c[:, 1], c[:, 2], c[:, 3]].t())
    bad = _dense_channel_to_space(dense.flip(1)).flip(1)  # control: another child-channel layout differs
    assert not torch.allclose(bad, _dense_channel_to_space(dense))


def test_tiny_decoder_round_trips_through_load_model_with_reference_dtypes(tmp_path):
    spec = {"name": "FlexiDualGridVaeDecoder", "args": dict(TINY_UNET, resolution=24, use_fp16=True)}
    torch.manual_seed(0)
    model = build_model(spec, device="cpu").eval()
    save_model(model, spec, tmp_path / "shape_dec", dtype=torch.float16)  # stored like the published fp16 file
    loaded = load_model(tmp_path / "shape_dec", device="cpu")
    for key, tensor in loaded.state_dict().items():
        assert tensor.dtype == (torch.float32 if _is_fp32_param(key) else torch.float16), key
    # the fp32 parameters went through fp16 storage: compare against the same rounding
    model.load_state_dict({k: v.half().to(v.dtype) for k, v in model.state_dict().items()})
    latent = _latent(6)
    with torch.no_grad():
        assert torch.equal(loaded(latent).feats, model(latent).feats)


# ------------------------------------------------------------------------------------ sparse-structure decoder
def test_pixel_shuffle_3d_places_channel_bits_as_first_second_third_axis():
    x = torch.arange(2 * 8 * 2 * 3 * 1, dtype=torch.float32).reshape(1, 16, 2, 3, 1)
    y = pixel_shuffle_3d(x, 2)
    assert y.shape == (1, 2, 4, 6, 2)
    for c in range(2):
        for i in range(2):
            for j in range(2):
                for k in range(2):
                    assert torch.equal(y[0, c, i::2, j::2, k::2], x[0, c * 8 + i * 4 + j * 2 + k])
    assert not torch.equal(y, pixel_shuffle_3d(x.flip(1), 2).flip(1))  # control: the order is observable


@pytest.mark.parametrize("use_fp16", [False, True])
def test_tiny_sparse_structure_decoder_maps_the_latent_to_4x_logits(use_fp16):
    torch.manual_seed(0)
    model = SparseStructureDecoder(out_channels=1, latent_channels=8, num_res_blocks=1, channels=[16, 8, 8],
                                   num_res_blocks_middle=1, use_fp16=use_fp16).eval()
    assert model.blocks[0].conv1.weight.dtype == (torch.float16 if use_fp16 else torch.float32)
    assert model.blocks[0].norm1.weight.dtype == torch.float32
    z = torch.randn(2, 8, 4, 4, 4)
    with torch.no_grad():
        logits = model(z)
    assert logits.shape == (2, 1, 16, 16, 16) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    with torch.no_grad():  # samples are decoded independently
        assert torch.allclose(model(z[1:]), logits[1:], atol=5e-3 if use_fp16 else 1e-5)


def test_real_sparse_structure_decoder_maps_16_cubed_latent_to_64_cubed_logits_on_meta():
    entry = _manifest()["sparse_structure_decoder"]
    model = build_model({"name": entry["class"], "args": entry["args"]}, device="meta")
    logits = model(torch.empty(1, 8, 16, 16, 16, device="meta"))
    assert logits.shape == (1, 1, 64, 64, 64) and logits.dtype == torch.float32


def test_sparse_structure_decoder_rejects_group_norm():
    with pytest.raises(ValueError, match="norm_type"):
        SparseStructureDecoder(1, 8, 1, [8], norm_type="group")
