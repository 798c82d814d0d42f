"""Tiled decode: the untiled decode's voxels, order and bits (half-precision torsos, as released), with a
halo exactly as large as the receptive field (controls: one voxel less at any stage differs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pixal3d.models.decoder_tiling import Box, TilePlan, decode_tiled, receptive_radii, split_boxes
from pixal3d.models.loading import build_model, load_model
from pixal3d.nn.sparse_conv import SparseConv3d
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.tiny_weights import TINY_VERSION
from tests.support.cascade_fixtures import tiny_cache  # noqa: F401  (session fixture: the tiny weights)

MANIFEST = Path(__file__).resolve().parents[3] / "assets" / "checkpoints.json"


def _to_half_torso(decoder, dtype=torch.bfloat16):
    """The released placement: torso convs/linears in half precision (bf16 here: CPU fp16 GEMMs are slow)."""
    for module in decoder.blocks.modules():
        if isinstance(module, (SparseConv3d, torch.nn.Linear)):
            module.to(dtype)
    decoder.dtype = dtype
    return decoder


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiles make many small kernel calls; one thread spares their thread start-ups (and any result here is
    thread-count independent in bf16)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_decoders(tiny_cache):  # noqa: F811
    ckpts = tiny_cache / "tiny" / TINY_VERSION / "pixal3d" / "ckpts"
    shape = _to_half_torso(load_model(ckpts / "shape_dec_tiny"))
    tex = _to_half_torso(load_model(ckpts / "tex_dec_tiny"))
    shape.set_resolution(48)
    return shape, tex


def _latents(coords: torch.Tensor, channels: int = 8, seed: int = 0) -> tuple[SparseTensor, SparseTensor]:
    gen = torch.Generator().manual_seed(seed)
    return (SparseTensor(torch.randn(len(coords), channels, generator=gen), coords),
            SparseTensor(torch.randn(len(coords), channels, generator=gen), coords))


def _tiny_hr_coords(seed: int = 1, side: int = 10) -> torch.Tensor:
    """~45% of a ``side``³ corner of the tiny cascade's 12³ HR token grid (its runs hold ~740 tokens there)."""
    gen = torch.Generator().manual_seed(seed)
    axis = torch.arange(side)
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).reshape(-1, 3)
    keep = torch.rand(len(grid), generator=gen) < 0.45
    return torch.cat([torch.zeros(int(keep.sum()), 1, dtype=torch.int32), grid[keep].int()], dim=1)


def _decode(shape, tex, latent, tex_latent):
    with torch.no_grad():
        fields, subs = shape.decode_fields(latent)
        return fields, tex.decode_pbr(tex_latent, subs, 48)


def _same(a, b) -> bool:
    fields_a, pbr_a = a
    fields_b, pbr_b = b
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in (
        (fields_a.coords, fields_b.coords), (fields_a.dual_vertices, fields_b.dual_vertices),
        (fields_a.intersected, fields_b.intersected), (fields_a.split_weight, fields_b.split_weight),
        (pbr_a.coords, pbr_b.coords), (pbr_a.attrs, pbr_b.attrs)))


def _tiled(shape, tex, latent, tex_latent, plan):
    fields, pbr, report = decode_tiled(shape, latent, plan, tex_decoder=tex, tex_latent=tex_latent, resolution=48)
    return (fields, pbr), report


def test_receptive_radii_of_the_released_and_tiny_decoders():
    spec = json.loads(MANIFEST.read_text())["models"]["shape_slat_decoder"]
    released = build_model({"name": spec["class"], "args": spec["args"]})  # on meta
    assert receptive_radii(released) == [18, 24, 13, 6, 0]  # blocks [4, 16, 8, 4, 0], see the module doc


@pytest.fixture(scope="module")
def tiny_case(tiny_decoders):
    """Latents on ~150 tokens and their untiled decode (~3.5k voxels at 28³)."""
    shape, tex = tiny_decoders
    latent, tex_latent = _latents(_tiny_hr_coords(side=7))
    return latent, tex_latent, _decode(shape, tex, latent, tex_latent)


@pytest.mark.parametrize("start_level, tile_voxels", [(0, 1200), (1, 1000), (2, 800)])
def test_tiled_decode_is_bitwise_the_untiled_decode_on_the_tiny_decoders(tiny_decoders, tiny_case, start_level,
                                                                          tile_voxels):
    shape, tex = tiny_decoders
    latent, tex_latent, untiled = tiny_case
    assert receptive_radii(shape) == [4, 3, 1]
    plan = TilePlan(start_level=start_level, tile_voxels=tile_voxels, growth=5.0)
    tiled, report = _tiled(shape, tex, latent, tex_latent, plan)
    assert report.tiles >= 3 and report.halo_overhead > 1.0  # really tiled, with halos
    assert report.decoded_voxels == len(untiled[0].coords)
    assert _same(tiled, untiled)


def test_a_tile_that_would_exceed_its_voxels_is_split_and_stays_exact(tiny_decoders, tiny_case):
    shape, tex = tiny_decoders
    latent, tex_latent, untiled = tiny_case
    plan = TilePlan(start_level=1, tile_voxels=1500, growth=1.0)  # growth 1: the first boxes are too large
    tiled, report = _tiled(shape, tex, latent, tex_latent, plan)
    assert report.splits > 0 and report.largest_tile <= plan.tile_voxels
    assert _same(tiled, untiled)


def test_voxels_on_tile_borders_need_the_full_halo_at_every_stage(tiny_decoders):
    """A full 12×4×4 block cut into two 6-voxel-deep tiles: every border voxel has neighbours across it up to
    6 voxels deep (more than the 4-voxel halo). With any stage's radius one voxel short the result differs
    (control); with the computed radii it is exact."""
    shape, tex = tiny_decoders
    grid = torch.stack(torch.meshgrid(torch.arange(12), torch.arange(4), torch.arange(4), indexing="ij"),
                       dim=-1).reshape(-1, 3).int()
    coords = torch.cat([torch.zeros(len(grid), 1, dtype=torch.int32), grid], dim=1)
    latent, tex_latent = _latents(coords, seed=3)
    untiled = _decode(shape, tex, latent, tex_latent)
    growth = (10**6 / 96) ** 0.5  # boxes of <= 96 of the 192 voxels, no split afterwards
    assert [(b.lo, b.hi) for b in split_boxes(grid, 96)] == [((0, 0, 0), (6, 4, 4)), ((6, 0, 0), (12, 4, 4))]
    exact = receptive_radii(shape)
    tiled, report = _tiled(shape, tex, latent, tex_latent, TilePlan(tile_voxels=10**6, growth=growth))
    assert report.tiles == 2 and report.splits == 0
    assert _same(tiled, untiled)
    for stage in range(len(exact)):
        short = list(exact)
        short[stage] -= 1
        plan = TilePlan(tile_voxels=10**6, growth=growth, radii=tuple(short))
        tiled, _ = _tiled(shape, tex, latent, tex_latent, plan)
        assert not _same(tiled, untiled), f"a halo one voxel short at stage {stage} should change the decode"


def test_fp32_torsos_agree_to_rounding(tiny_cache):  # noqa: F811
    """fp32 (the tiny config's own precision): PyTorch's fp32 SiLU gives a value that depends on where it
    falls in the thread's range (module doc), so tiles agree to rounding, not bit for bit."""
    ckpts = tiny_cache / "tiny" / TINY_VERSION / "pixal3d" / "ckpts"
    shape, tex = load_model(ckpts / "shape_dec_tiny"), load_model(ckpts / "tex_dec_tiny")
    shape.set_resolution(48)
    latent, tex_latent = _latents(_tiny_hr_coords(side=7))
    (fields, pbr), ((fields2, pbr2), report) = (
        _decode(shape, tex, latent, tex_latent),
        _tiled(shape, tex, latent, tex_latent, TilePlan(start_level=1, tile_voxels=3000, growth=5.0)))
    assert report.tiles >= 2
    assert torch.equal(fields.coords, fields2.coords)
    torch.testing.assert_close(fields2.dual_vertices, fields.dual_vertices, rtol=0, atol=1e-5)
    torch.testing.assert_close(pbr2.attrs, pbr.attrs, rtol=0, atol=1e-5)


def test_split_boxes_partition_the_voxels_within_the_limit():
    gen = torch.Generator().manual_seed(0)
    xyz = torch.unique(torch.randint(0, 40, (3000, 3), generator=gen, dtype=torch.int32), dim=0)
    boxes = split_boxes(xyz, 200)
    owners = torch.stack([b.contains(xyz) for b in boxes]).int().sum(dim=0)
    assert bool((owners == 1).all())  # each voxel in exactly one box
    assert max(int(b.contains(xyz).sum()) for b in boxes) <= 200
    assert len(boxes) <= 2 * len(xyz) / 200 * 2  # median splits: no flood of tiny boxes


def test_box_distance_is_chebyshev_to_the_scaled_box():
    box = Box((2, 2, 2), (4, 4, 4))
    xyz = torch.tensor([[2, 2, 2], [3, 3, 3], [1, 3, 3], [5, 3, 3], [0, 0, 6], [8, 8, 8]], dtype=torch.int32)
    assert box.distance(xyz).tolist() == [0, 0, 1, 2, 3, 5]
    assert box.distance(xyz, scale=2).tolist() == [2, 1, 3, 1, 4, 1]  # box becomes [4, 8)³


def test_the_texture_latent_must_share_the_shape_coords(tiny_decoders):
    shape, tex = tiny_decoders
    latent, _ = _latents(_tiny_hr_coords())
    other, _ = _latents(_tiny_hr_coords(seed=2))
    with pytest.raises(ValueError, match="tex_latent"):
        decode_tiled(shape, latent, TilePlan(), tex_decoder=tex, tex_latent=other)


def test_decode_shape_and_texture_is_the_stage_work_with_or_without_a_plan(tiny_decoders, tiny_case):
    from pixal3d.models.decoder_tiling import decode_shape_and_texture

    shape, tex = tiny_decoders
    latent, tex_latent, untiled = tiny_case
    assert _same(decode_shape_and_texture(shape, tex, latent, tex_latent, 48), untiled)
    assert _same(decode_shape_and_texture(shape, tex, latent, tex_latent, 48, plan=TilePlan(tile_voxels=1200)),
                 untiled)


@pytest.mark.parametrize("start_level, tile_voxels", [(0, 400), (1, 1500)])
def test_the_texture_decode_to_a_meshs_voxels_is_the_same_over_tiles(tiny_decoders, start_level, tile_voxels,
                                                                      monkeypatch):
    """``--mesh``'s decode (``decode_texture_to_voxels``): guided to a given voxel set (here: a random half of a
    shell's voxels under the latent), the tiled decode gives the whole one's voxels, order and attributes bit for
    bit, and several tiles ran; control: a halo one voxel short differs."""
    import pixal3d.models.decoder_tiling as tiling
    from pixal3d.models.decoder_tiling import decode_texture_to_voxels

    _, tex = tiny_decoders
    coords = _tiny_hr_coords(seed=5)
    _, tex_latent = _latents(coords, seed=6)
    gen = torch.Generator().manual_seed(7)
    fine = (coords[:, 1:].repeat_interleave(16, dim=0) * 4 + torch.randint(0, 4, (len(coords) * 16, 3),
                                                                              generator=gen, dtype=torch.int32))
    voxels = torch.unique(fine, dim=0)
    whole = decode_texture_to_voxels(tex, tex_latent, voxels, 48)
    assert sorted(map(tuple, whole.coords.tolist())) == sorted(map(tuple, voxels.tolist()))
    plan = TilePlan(start_level=start_level, tile_voxels=tile_voxels, growth=4.0)
    calls = []
    run_tile = tiling._run_tile
    monkeypatch.setattr(tiling, "_run_tile", lambda *a: calls.append(1) or run_tile(*a))
    tiled = decode_texture_to_voxels(tex, tex_latent, voxels, 48, plan=plan)
    assert torch.equal(tiled.coords, whole.coords) and torch.equal(tiled.attrs, whole.attrs)
    assert len(calls) > 1  # it did run over several tiles
    short = list(receptive_radii(tex))
    short[start_level] -= 1
    if short[start_level] >= 0:
        off = decode_texture_to_voxels(tex, tex_latent, voxels, 48, plan=TilePlan(
            start_level=start_level, tile_voxels=tile_voxels, growth=4.0, radii=tuple(short)))
        assert not torch.equal(off.attrs, whole.attrs)
