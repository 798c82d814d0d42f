"""NAF: attention equals a literal NATTEN-rule loop, frugal == full, published key set loads strictly."""
import math

import pytest
import torch
import torch.nn.functional as F

from pixal3d.models import naf as naf_module
from pixal3d.models.loading import CheckpointError, build_model, load_model
from pixal3d.models.naf import (
    NAF,
    BandedEncoder,
    TiledEncoder,
    load_naf,
    naf_state_names,
    write_tiny_naf,
)


# The published naf_release.pth key set at the default config (dim 256, 4 heads, 2 layers, kernel 9),
# written from valeoai/NAF src/model/naf.py + src/layers/{convolutions,rope}.py.
def published_naf_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {}
    for stack, k in (("encoder", 1), ("sem_encoder", 3)):
        prefix = f"image_encoder.{stack}"
        shapes[f"{prefix}.0.weight"] = (128, 3, k, k)
        shapes[f"{prefix}.0.bias"] = (128,)
        for block in (1, 2):
            for norm in ("norm1", "norm2"):
                shapes[f"{prefix}.{block}.{norm}.weight"] = (128,)
                shapes[f"{prefix}.{block}.{norm}.bias"] = (128,)
            for conv in ("conv1", "conv2"):
                shapes[f"{prefix}.{block}.{conv}.weight"] = (128, 128, k, k)
                shapes[f"{prefix}.{block}.{conv}.bias"] = (128,)
    shapes["image_encoder.rope.periods"] = (16,)
    return shapes


def tiny_naf(seed: int = 0) -> NAF:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return NAF(dim=16, heads_attn=4, heads_rope=4, img_layers=2).eval()


def naive_naf(naf: NAF, image, features, size, pixels, *, clamped=True):
    """Literal reference semantics at ``pixels``: nearest-exact K/V to T×T, per-pixel NATTEN window (per
    dilation sub-lattice, centred and clamped to stay inside; ``clamped=False`` clips each index instead)."""
    enc = naf.image_encoder
    queries = enc.rotate_map(enc.encode(image, size))
    keys = F.adaptive_avg_pool2d(queries, features.shape[-2:])
    keys_t = F.interpolate(keys, size=size, mode="nearest-exact")[0]
    values_t = F.interpolate(features, size=size, mode="nearest-exact")[0]
    dil = (size[0] // features.shape[-2], size[1] // features.shape[-1])
    k, heads = naf.kernel_size, naf.heads

    def window(i, n, d):
        residue, group_len = i % d, len(range(i % d, n, d))
        if not clamped:
            return [residue + d * min(max(i // d + m - k // 2, 0), group_len - 1) for m in range(k)]
        start = min(max(i // d - k // 2, 0), group_len - k)
        return [residue + d * (start + m) for m in range(k)]

    out = []
    for i, j in pixels.tolist():
        ys, xs = window(i, size[0], dil[0]), window(j, size[1], dil[1])
        kk = keys_t[:, ys][:, :, xs].reshape(heads, -1, k * k)  # [n, dk, 81]
        vv = values_t[:, ys][:, :, xs].reshape(heads, -1, k * k)  # [n, dv, 81]
        q = queries[0, :, i, j].reshape(heads, -1)
        w = torch.softmax((q[:, :, None] * kk).sum(1) / math.sqrt(q.shape[1]), dim=-1)
        out.append((vv * w[:, None]).sum(-1).reshape(-1))
    return torch.stack(out)


def probe_pixels(side: int, dilation: int, gen) -> torch.Tensor:
    """Every border case (first/last windows, each side of a patch edge) crossed, plus random pixels."""
    marks = sorted({0, 1, dilation - 1, dilation, 3 * dilation + 5, 4 * dilation + 7, side // 2,
                    side - 2 * dilation, side - dilation - 1, side - dilation, side - 1})
    marks = torch.tensor(marks)
    grid = torch.cartesian_prod(marks, marks)
    return torch.cat([grid, torch.randint(0, side, (60, 2), generator=gen)])


@pytest.mark.parametrize("dilation", [8, 16])
def test_attention_equals_naive_natten_loop(dilation):
    naf = tiny_naf()
    gen = torch.Generator().manual_seed(dilation)
    side = 9 * dilation  # 9×9 patches: the window covers the whole grid and is clamped everywhere
    if dilation == 8:
        side = 12 * dilation  # 12×12 patches: the window slides in the middle
    image = torch.rand(1, 3, side, side, generator=gen)
    features = torch.randn(1, 8, side // dilation, side // dilation, generator=gen)
    pixels = probe_pixels(side, dilation, gen)
    with torch.no_grad():
        fast = naf(image, features, (side, side))
        slow = naive_naf(naf, image, features, (side, side), pixels)
        unclamped = naive_naf(naf, image, features, (side, side), pixels, clamped=False)
    assert fast.shape == (1, 8, side, side)
    picked = fast[0, :, pixels[:, 0], pixels[:, 1]].T
    torch.testing.assert_close(picked, slow, rtol=1e-5, atol=1e-5)
    # control: the zero-free but unclamped (index-clipped) window gives other values at the borders
    assert (picked - unclamped).abs().amax() > 1e-3


def test_frugal_pixels_equal_full_map():
    naf = tiny_naf(1)
    gen = torch.Generator().manual_seed(3)
    image = torch.rand(1, 3, 144, 144, generator=gen)
    features = torch.randn(1, 8, 9, 9, generator=gen)
    size = (72, 72)  # S = 2T: the encoder output is average-pooled, as in the shape_1024 extractor
    pixels = torch.stack([torch.randint(0, 72, (50,), generator=gen), torch.randint(0, 72, (50,), generator=gen)], -1)
    with torch.no_grad():
        full = naf(image, features, size)
        part = naf.features_at(image, features, size, pixels)
    torch.testing.assert_close(part, full[0, :, pixels[:, 0], pixels[:, 1]].T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factor", [1, 2])
def test_banded_encoder_equals_whole_map(monkeypatch, factor):
    """Many thin bands (3×3 halos crossing band edges, merged GroupNorm statistics) == one whole-map pass."""
    monkeypatch.setattr(naf_module, "_BAND_BYTES", 1)  # one patch row (8 output rows) per band
    naf = tiny_naf(2)
    gen = torch.Generator().manual_seed(4)
    size = (72, 80)
    image = torch.rand(1, 3, size[0] * factor, size[1] * factor, generator=gen) * 3 - 1
    features = torch.randn(1, 8, 9, 10, generator=gen)
    pixels = torch.cartesian_prod(torch.tensor([0, 7, 8, 9, 35, 63, 64, 71]), torch.tensor([0, 1, 40, 78, 79]))
    banded = BandedEncoder(naf.image_encoder, image, size, features.shape[-2:])
    assert banded.applies and banded._band_rows(8) == 8
    with torch.no_grad():
        queries, keys = banded.queries_and_keys(pixels[:, 0], pixels[:, 1])
        ref_q, ref_k = naf._queries_and_keys(image, size, features.shape[-2:], pixels[:, 0], pixels[:, 1])
        torch.testing.assert_close(queries, ref_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(keys, ref_k, rtol=1e-5, atol=1e-5)
    # control: band-local GroupNorm statistics (what a naive tiling would do) give other queries

    def first_band_only(self, ops, norm, band):
        var, mean = torch.var_mean(self._rows(ops, 0, band).reshape(norm.num_groups, -1), dim=1, unbiased=False)
        self.stats[id(norm)] = (mean, (var + norm.eps).rsqrt())

    monkeypatch.setattr(BandedEncoder, "_gather_stats", first_band_only)
    with torch.no_grad():
        naive_q, _ = BandedEncoder(naf.image_encoder, image, size, features.shape[-2:]).queries_and_keys(
            pixels[:, 0], pixels[:, 1])
    assert not torch.allclose(naive_q, ref_q, atol=1e-3)


def test_output_size_must_be_multiple_of_patch_grid():
    naf = tiny_naf()
    with pytest.raises(ValueError, match="multiple of the feature grid"):
        naf(torch.rand(1, 3, 100, 100), torch.randn(1, 8, 10, 10), (95, 95))


def test_published_key_set_matches_and_loads_strictly(tmp_path):
    with torch.device("meta"):
        model = NAF()
    assert naf_state_names(model) == published_naf_shapes()
    assert sum(math.prod(s) for s in published_naf_shapes().values()) == pytest.approx(0.66e6, rel=0.02)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=gen) for k, s in published_naf_shapes().items()}
    torch.save(state, tmp_path / "naf_release.pth")
    loaded = load_naf(tmp_path / "naf_release.pth")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())


def test_wrong_key_set_is_a_checkpoint_error(tmp_path):
    state = {k: torch.zeros(s) for k, s in published_naf_shapes().items()}
    state.pop("image_encoder.rope.periods")
    state["image_encoder.encoder.1.shortcut.weight"] = torch.zeros(128, 128, 1, 1)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match="rope.periods.*shortcut|shortcut.*periods|missing"):
        load_naf(tmp_path / "bad.pth")


def test_registry_builds_naf_from_its_spec():
    model = build_model({"name": "NAF", "args": {"dim": 256, "rope_rescale": 2}})
    assert naf_state_names(model) == published_naf_shapes()
    expected = 100.0 ** (2 * torch.arange(16) / 32)
    torch.testing.assert_close(NAF().image_encoder.rope.periods, expected)


def test_tiny_naf_round_trips_through_the_registry_loader(tmp_path):
    state = torch.get_rng_state()
    stem = write_tiny_naf(tmp_path / "naf", seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    loaded = load_model(stem)
    assert isinstance(loaded, NAF)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        reference = NAF(dim=16, heads_attn=4, heads_rope=4)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.state_dict().items())


# ---- `full` mode: the reference algorithm (whole map, then bilinear) bit for bit, without the map ----

def _probe_grid(side: int, gen) -> torch.Tensor:
    """Random points (some outside the view: border padding) plus points exactly on pixel-centre lines."""
    grid = torch.rand(1500, 2, generator=gen) * 2.4 - 1.2
    centres = (torch.arange(side) + 0.5) / side * 2 - 1
    grid[:side, 0] = centres
    grid[side:2 * side, 1] = centres
    grid[2 * side] = torch.tensor([1.0, -1.0])
    return grid


@pytest.mark.parametrize("image_side, side, patches, channels", [(144, 72, 9, 8), (160, 80, 10, 24)])
def test_sample_equals_the_full_map_then_bilinear_bitwise(monkeypatch, image_side, side, patches, channels):
    from pixal3d.models.projection import sample_map, sample_pointwise

    monkeypatch.setattr(naf_module, "_SAMPLE_MAP_BYTES", side * side * 4 * 5)  # 5 channels per chunk
    naf = tiny_naf(4)
    gen = torch.Generator().manual_seed(side)
    image = torch.rand(1, 3, image_side, image_side, generator=gen)
    features = torch.randn(1, channels, patches, patches, generator=gen)
    grid = _probe_grid(side, gen)
    with torch.no_grad():
        reference = sample_map(naf(image, features, (side, side)), grid)
        exact = naf.sample(image, features, (side, side), grid)
        frugal = sample_pointwise(lambda p: naf.features_at(image, features, (side, side), p), grid, side, side)
    assert torch.equal(exact, reference)
    # control: the banded encoder's merged GroupNorm statistics land ~1e-7 away
    assert not torch.equal(frugal, reference)
    torch.testing.assert_close(frugal, reference, rtol=0, atol=1e-5)


def test_read_pixels_include_every_pixel_grid_sample_reads():
    """A map that is NaN outside ``read_pixels`` samples without NaN: nothing else is read (0·NaN = NaN)."""
    from pixal3d.models.projection import read_pixels, sample_map

    side = 40
    grid = _probe_grid(side, torch.Generator().manual_seed(5))
    pixels = read_pixels(grid, side, side)
    poisoned = torch.full((1, 2, side, side), float("nan"))
    poisoned[0, :, pixels[:, 0], pixels[:, 1]] = 1.0
    assert not sample_map(poisoned, grid).isnan().any()
    poisoned[0, :, pixels[7, 0], pixels[7, 1]] = float("nan")  # control: one pixel fewer is seen
    assert sample_map(poisoned, grid).isnan().any()


def _tiled_and_whole(naf, image, size, patch_grid, pixels, encoder=None):
    """(queries, keys) of ``TiledEncoder`` (or the subclass ``encoder``) and of the whole guidance map."""
    tiles = (encoder or TiledEncoder)(naf.image_encoder, image, size, patch_grid)
    assert tiles.applies
    with torch.no_grad():
        tiled = tiles.queries_and_keys(pixels[:, 0], pixels[:, 1])
        whole = naf._queries_and_keys(image, size, patch_grid, pixels[:, 0], pixels[:, 1])
    return tiled, whole


class HaloOneShort(TiledEncoder):
    """A 3×3 convolution's band reads one row too few beyond its edges (the rest reflected): the control."""

    def halo(self, conv):
        return conv.kernel_size[0] // 2 - 1



@pytest.mark.parametrize("factor", [1, 2, 5])
def test_tiled_encoder_equals_the_whole_guidance_map_bitwise(factor):
    """The tiny NAF (8-channel branches, one band: the map is small): GroupNorm a group at a time over the whole
    map, the 1×1 branch beside the 3×3 one's last convolution, pooled per band to T = S, T = S/2 and (S = 5T,
    first reduced to 4T as published, its width pooled unevenly) T = S/4: the queries and keys are the whole
    guidance map's bits."""
    naf = tiny_naf(2)
    gen = torch.Generator().manual_seed(4)
    size = (72, 80)
    image = torch.rand(1, 3, size[0] * factor, size[1] * factor, generator=gen) * 3 - 1
    pixels = torch.cartesian_prod(torch.tensor([0, 7, 8, 9, 35, 63, 64, 71]), torch.tensor([0, 1, 40, 78, 79]))
    (queries, keys), (ref_q, ref_k) = _tiled_and_whole(naf, image, size, torch.Size((9, 10)), pixels)
    assert torch.equal(queries, ref_q) and torch.equal(keys, ref_k)


@pytest.mark.parametrize("factor", [1, 2])
def test_tiled_sample_equals_the_whole_map_bitwise_at_the_released_width(monkeypatch, factor):
    """NAF at the released width (dim 256: 128-channel branches, 1024-channel values), thin 3-row bands, full
    width of a small image: ``sample`` over the tiled encoder == over the whole guidance map, bit for bit; with
    a halo one row short of the 3×3 kernels' reach the queries and keys differ."""
    monkeypatch.setattr(naf_module, "_BAND_BYTES", 1)
    torch.manual_seed(0)
    naf = NAF().eval()
    with torch.no_grad():  # GroupNorm's affine away from its (1, 0) initialisation, as trained weights are
        for module in naf.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    gen = torch.Generator().manual_seed(1)
    side = 144
    image = torch.rand(1, 3, side * factor, side * factor, generator=gen)
    features = torch.randn(1, 1024, 9, 9, generator=gen)
    grid = torch.rand(300, 2, generator=gen) * 2 - 1
    assert naf_module.conv_band_rows(128, 128, side * factor, 1) == 3
    with torch.no_grad():
        tiled = naf.sample(image, features, (side, side), grid)
        whole = naf.sample(image, features, (side, side), grid, tiled=False)
    assert torch.equal(tiled, whole)
    pixels = torch.cartesian_prod(torch.arange(0, side, 5), torch.arange(0, side, 7))
    (short_q, short_k), (ref_q, ref_k) = _tiled_and_whole(naf, image, (side, side), torch.Size((9, 9)), pixels,
                                                          HaloOneShort)
    assert not torch.equal(short_q, ref_q) and not torch.equal(short_k, ref_k)  # the control: a halo one short

