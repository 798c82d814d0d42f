"""DINOv3 tiny end to end: token layout, the four extractors' shapes, one backbone forward per size, kept features."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pixal3d.models.camera import FALLBACK_FOV, camera_from_fov
from pixal3d.models.conditioning import (
    EXTRACTORS,
    ExtractorConfig,
    ImageFeatures,
    backbone_features,
    condition,
    image_features,
    naf_peak_bytes,
    negative_condition,
    scaled_extractors,
    select_naf_mode,
)
from pixal3d.models.dinov3 import (
    extract_tokens,
    load_dinov3,
    prepare_image,
    tiny_dinov3_config,
    write_tiny_dinov3,
)
from pixal3d.models.naf import NAF
from pixal3d.nn.sparse_tensor import SparseTensor

# Patch size 4 and every image/NAF size divided by 4: the same 32² / 64² token grids and 16/32/64 projection
# grids as the real extractors, at 1/16 of the pixels.
TINY = scaled_extractors(4)


def test_extractor_table_is_the_reference():
    assert EXTRACTORS == {"ss": ExtractorConfig("ss", 512, 16, None),
                          "shape_512": ExtractorConfig("shape_512", 512, 32, 512),
                          "shape_1024": ExtractorConfig("shape_1024", 1024, 64, 512),
                          "tex_1024": ExtractorConfig("tex_1024", 1024, 64, 1024)}
    assert TINY["tex_1024"] == ExtractorConfig("tex_1024", 256, 64, 256)


def test_real_size_ss_extractor_with_a_patch16_backbone(image):
    model = load_dinov3(tiny_dinov3_config())
    cond = condition(EXTRACTORS["ss"], backbone_features(model, image, 512), camera_from_fov(FALLBACK_FOV))
    assert cond["global"].shape == (1, 5, 32) and cond["proj"].shape == (1, 4096, 32)


@pytest.fixture(scope="module")
def backbone():
    model = load_dinov3(tiny_dinov3_config(patch_size=4))
    with torch.no_grad():  # a non-trivial affine final norm, so "not the model's own norm" is observable
        model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        model.norm.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(2))
    return model


@pytest.fixture(scope="module")
def naf():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return NAF(dim=16, heads_attn=4, heads_rope=4).eval()


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (200, 200, 3), dtype=np.uint8))


def random_coords(resolution: int, count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    xyz = torch.randint(0, resolution, (count, 3), generator=gen)
    xyz = xyz[torch.randperm(count, generator=gen)]  # not sorted: rows must follow the given order
    return torch.cat([torch.zeros(count, 1, dtype=torch.long), xyz], 1).int()


@pytest.fixture(scope="module")
def run(backbone, naf, image):
    """All four extractors from one ``image_features`` call, counting backbone forwards with a hook."""
    calls = []
    hook = backbone.embeddings.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape[-2:])))
    features = image_features(backbone, image, [ex.image_size for ex in TINY.values()])
    hook.remove()
    camera = camera_from_fov(FALLBACK_FOV)
    conds = {}
    for name, extractor in TINY.items():
        coords = None if name == "ss" else random_coords(extractor.grid_resolution, 300, len(name))
        conds[name] = condition(extractor, features.at(extractor.image_size), camera, coords, naf=naf)
    return conds, features, calls


def test_token_layout_and_non_affine_final_norm(backbone, image):
    pixels, raw = prepare_image(image, 128)
    assert raw.min() >= 0 and raw.max() <= 1 and pixels.shape == (1, 3, 128, 128)
    with torch.no_grad():
        tokens = extract_tokens(backbone, pixels)
        output = backbone(pixels, output_hidden_states=True)
    assert tokens.shape == (1, 5 + 32 * 32, 32) and tokens.dtype == torch.float32
    last = output.hidden_states[-1]
    torch.testing.assert_close(tokens, F.layer_norm(last, (32,), eps=1e-5))
    assert not torch.allclose(tokens, output.last_hidden_state, atol=1e-3)  # control: the affine norm differs
    features = backbone_features(backbone, image, 128)
    patch_map = features.patch_map()
    assert patch_map.shape == (1, 32, 32, 32)
    assert torch.equal(patch_map[0, :, 3, 17], features.tokens[0, 5 + 3 * 32 + 17])  # row-major [y][x]


def test_four_extractors_shapes(run):
    conds, _, _ = run
    for name, cond in conds.items():
        assert cond["global"].shape == (1, 5, 32) and cond["global"].dtype == torch.float32
    assert conds["ss"]["proj"].shape == (1, 16 ** 3, 32)
    for name in ("shape_512", "shape_1024", "tex_1024"):
        proj = conds[name]["proj"]
        assert isinstance(proj, SparseTensor) and proj.feats.shape == (300, 64)
        assert torch.equal(proj.coords, random_coords(TINY[name].grid_resolution, 300, len(name)))


def test_backbone_runs_once_per_distinct_size(run):
    conds, features, calls = run
    assert calls == [(128, 128), (256, 256)]
    assert features.sizes == (128, 256)
    assert torch.equal(conds["ss"]["global"], conds["shape_512"]["global"])
    assert not torch.equal(conds["ss"]["global"], conds["shape_1024"]["global"])


def test_kept_features_equal_recomputed(run, backbone, naf, image):
    conds, _, _ = run
    extractor = TINY["shape_1024"]
    coords = random_coords(extractor.grid_resolution, 300, len("shape_1024"))
    fresh = condition(extractor, backbone_features(backbone, image, extractor.image_size),
                      camera_from_fov(FALLBACK_FOV), coords, naf=naf)
    assert torch.equal(fresh["global"], conds["shape_1024"]["global"])
    assert torch.equal(fresh["proj"].feats, conds["shape_1024"]["proj"].feats)


def test_features_at_a_size_not_computed_or_of_another_size_are_clear_errors(run):
    _, features, _ = run
    with pytest.raises(ValueError, match=r"no DINOv3 features at 512 px.*\[128, 256\]"):
        features.at(512)
    with pytest.raises(ValueError, match="reads DINOv3 features at 128 px; these are at 256 px"):
        condition(TINY["ss"], features.at(256), camera_from_fov(FALLBACK_FOV))
    assert isinstance(features, ImageFeatures)


def test_sparse_rows_equal_the_dense_gather_and_frugal_equals_full(backbone, naf, image, run):
    conds, features, _ = run
    extractor = TINY["shape_512"]
    camera = camera_from_fov(FALLBACK_FOV)
    coords = random_coords(32, 300, len("shape_512"))
    at = features.at(extractor.image_size)
    dense = condition(extractor, at, camera, naf=naf, naf_mode="full")["proj"]
    assert dense.shape == (1, 32 ** 3, 64)
    c = coords.long()
    gathered = dense.reshape(1, 32, 32, 32, 64)[c[:, 0], c[:, 1], c[:, 2], c[:, 3]]
    frugal = conds["shape_512"]["proj"].feats
    torch.testing.assert_close(frugal, gathered, rtol=1e-5, atol=1e-5)
    full = condition(extractor, at, camera, coords, naf=naf, naf_mode="full")
    torch.testing.assert_close(frugal, full["proj"].feats, rtol=1e-5, atol=1e-5)
    assert frugal[:, 32:].abs().sum() > 0 and not torch.allclose(frugal[:, :32], frugal[:, 32:])  # lr, then NAF


def test_negative_condition_is_zeros_of_the_same_shapes(run):
    conds, _, _ = run
    for cond in conds.values():
        neg = negative_condition(cond)
        assert torch.equal(neg["global"], torch.zeros_like(cond["global"]))
        if isinstance(cond["proj"], SparseTensor):
            assert neg["proj"].coords is cond["proj"].coords and not neg["proj"].feats.any()
            assert neg["proj"].feats.shape == cond["proj"].feats.shape
        else:
            assert neg["proj"].shape == cond["proj"].shape and not neg["proj"].any()


def test_naf_extractor_without_naf_and_bad_coords_are_clear_errors(run):
    _, features, _ = run
    camera = camera_from_fov(FALLBACK_FOV)
    with pytest.raises(ValueError, match="pass naf="):
        condition(TINY["tex_1024"], features.at(256), camera)
    with pytest.raises(ValueError, match="int32"):
        condition(TINY["ss"], features.at(128), camera, random_coords(16, 4, 0).long())


def test_tiny_folder_round_trip_is_deterministic_and_keeps_the_rng(tmp_path, image):
    state = torch.get_rng_state()
    folder = write_tiny_dinov3(tmp_path / "dinov3", seed=3, config=tiny_dinov3_config(patch_size=4))
    assert torch.equal(torch.get_rng_state(), state)
    from_folder = load_dinov3(folder)
    from_config = load_dinov3(tiny_dinov3_config(patch_size=4), seed=3)
    other_seed = load_dinov3(tiny_dinov3_config(patch_size=4), seed=4)
    pixels, _ = prepare_image(image, 64)
    with torch.no_grad():
        assert torch.equal(extract_tokens(from_folder, pixels), extract_tokens(from_config, pixels))
        assert not torch.equal(extract_tokens(other_seed, pixels), extract_tokens(from_config, pixels))
    assert torch.equal(torch.get_rng_state(), state)


def test_full_mode_is_the_reference_algorithm_bitwise(backbone, naf, image, run):
    """``naf_mode='full'`` == the reference: low-res bilinear, then the whole T×T NAF map, bilinear."""
    from pixal3d.models.projection import coords_points, project, sample_map

    _, kept, _ = run
    extractor = TINY["shape_512"]  # NAF at T = 128
    camera = camera_from_fov(FALLBACK_FOV)
    coords = random_coords(extractor.grid_resolution, 500, 7)
    features = kept.at(extractor.image_size)
    full = condition(extractor, features, camera, coords, naf=naf, naf_mode="full")
    grid = project(coords_points(coords, extractor.grid_resolution), camera, extractor.image_size)
    size = (extractor.naf_size, extractor.naf_size)
    with torch.no_grad():
        whole_map = naf(features.image, features.patch_map(), size)  # [1, C, T, T]
        reference = torch.cat([sample_map(features.patch_map(), grid), sample_map(whole_map, grid)], dim=-1)
    assert torch.equal(full["proj"].feats, reference)
    frugal = condition(extractor, features, camera, coords, naf=naf, naf_mode="frugal")
    assert not torch.equal(frugal["proj"].feats, reference)  # control: the banded encoder is not bit-exact


def test_auto_naf_mode_picks_frugal_only_when_full_does_not_fit():
    full = naf_peak_bytes("full", 1024, 1024, points=20_000)
    frugal = naf_peak_bytes("frugal", 1024, 1024, points=20_000)
    assert frugal < full
    assert select_naf_mode("auto", budget_bytes=full, full_bytes=full) == "full"
    assert select_naf_mode("auto", budget_bytes=full - 1, full_bytes=full) == "frugal"
    assert select_naf_mode("full", budget_bytes=0, full_bytes=full) == "full"  # an explicit mode is kept
    assert select_naf_mode("frugal", budget_bytes=1 << 60, full_bytes=full) == "frugal"
    with pytest.raises(ValueError, match="auto"):
        select_naf_mode("fast", budget_bytes=0, full_bytes=0)
    with pytest.raises(ValueError, match="naf_mode"):
        condition(TINY["ss"], None, camera_from_fov(FALLBACK_FOV), naf_mode="auto")
