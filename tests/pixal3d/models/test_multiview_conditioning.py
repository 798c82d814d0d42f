"""Conditioning on posed views (pixal3d/models/multiview.py): the reference's degenerate case, the gather, the fusion.

- One view at the front pose whose pixels are the single-view run's is the single-view condition, bit for bit,
  for the four extractors and both NAF modes (the reference: "V=1 degenerates to the single-view path"); controls:
  the camera 1 % farther, and a view whose premultiplied pixels differ, both change it.
- The sparse stages' rows are the dense grid's rows, bit for bit (the reference projects the dense grid, fuses,
  then gathers; here only the rows are sampled).
- The fused condition is the views' average: two copies of one view give that view's condition; turning the whole
  rig about the vertical axis changes nothing but rounding (every view is placed relative to frame 0).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from pixal3d.models.camera import camera_from_fov
from pixal3d.models.conditioning import condition, image_features, scaled_extractors
from pixal3d.models.dinov3 import load_dinov3, prepare_image, tiny_dinov3_config
from pixal3d.models.multiview import (
    PosedViews,
    condition_views,
    relative_poses,
    view_features,
    view_pixels,
)
from pixal3d.models.naf import NAF
from pixal3d.models.views import front_pose, orbit_pose

TINY = scaled_extractors(4)  # patch 4: the real token and projection grids at 1/16 of the pixels
FOV = math.radians(40)


@pytest.fixture(scope="module")
def backbone():
    return load_dinov3(tiny_dinov3_config(patch_size=4))


@pytest.fixture(scope="module")
def naf():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return NAF(dim=32, heads_attn=2, heads_rope=2, kernel_size=3, img_layers=1).eval()


def disc_image(size: int = 300) -> Image.Image:
    """An RGB object (a textured disc) on black with wide black corners, and its RGBA view: alpha 255 but for a
    transparent corner pixel, so the view's premultiplied, resized pixels are the RGB image's, exactly (Pillow
    resizes RGBA premultiplied: only where the alpha's resize falls below 255 could the two part, and there the
    colours are black)."""
    yy, xx = np.mgrid[:size, :size]
    r = np.hypot(xx - size / 2, yy - size / 2)
    pattern = np.stack([(xx * 7) % 256, (yy * 5) % 256, ((xx + yy) * 3) % 256], -1)
    rgb = np.where((r < size * 0.45)[..., None], pattern, 0).astype(np.uint8)
    alpha = np.full((size, size), 255, np.uint8)
    alpha[0, 0] = 0
    return Image.fromarray(rgb), Image.fromarray(np.dstack([rgb, alpha]), mode="RGBA")


def one_view(image: Image.Image, pose, fov: float = FOV) -> PosedViews:
    return PosedViews((image,), torch.tensor([pose], dtype=torch.float32), torch.tensor([fov], dtype=torch.float32),
                      1.0, ("v0",))


def coords_for(grid: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    xyz = torch.randint(0, grid, (n, 3), generator=g, dtype=torch.int32)
    return torch.cat([torch.zeros(n, 1, dtype=torch.int32), xyz], 1).unique(dim=0)


def single(extractor, image, camera, coords, backbone, naf, naf_mode="full"):
    """The single-view condition (features, then the extractor)."""
    features = image_features(backbone, image, [extractor.image_size]).at(extractor.image_size)
    return condition(extractor, features, camera, coords, naf=naf, naf_mode=naf_mode)


def multi(extractor, views, coords, backbone, naf, naf_mode="full"):
    """The multi-view condition (the views' features as one batch, then the extractor)."""
    features = view_features(backbone, views, [extractor.image_size]).at(extractor.image_size)
    return condition_views(extractor, features, views, coords, naf=naf, naf_mode=naf_mode)


def proj(cond):
    return cond["proj"].feats if hasattr(cond["proj"], "feats") else cond["proj"]


@pytest.mark.parametrize("naf_mode", ["full", "frugal"])
def test_one_view_at_the_front_pose_is_the_single_view_condition_bitwise(backbone, naf, naf_mode):
    rgb, rgba = disc_image()
    for size in (64, 128, 256):  # the view's pixels are the single-view run's (the premise of the case)
        assert torch.equal(view_pixels(rgba, size), prepare_image(rgb, size)[1][0])
    camera = camera_from_fov(FOV)
    views = one_view(rgba, front_pose(camera.distance))
    farther = one_view(rgba, front_pose(camera.distance * 1.01))  # one view's pose is always snapped onto F
    for name, extractor in TINY.items():
        coords = None if name == "ss" else coords_for(extractor.grid_resolution, 400, len(name))
        one = single(extractor, rgb, camera, coords, backbone, naf, naf_mode)
        fused = multi(extractor, views, coords, backbone, naf, naf_mode)
        assert torch.equal(one["global"], fused["global"]), name
        assert torch.equal(proj(one), proj(fused)), name
        control = multi(extractor, farther, coords, backbone, naf, naf_mode)
        assert not torch.equal(proj(control), proj(one)), name  # frame 0 farther: other rows


def test_premultiplied_pixels_are_what_the_views_are_conditioned_on(backbone, naf):
    rgb, _ = disc_image()
    half = rgb.convert("RGBA")
    half.putalpha(128)  # the same colours, half covered: the reference multiplies them by 128/255
    camera = camera_from_fov(FOV)
    one = single(TINY["shape_512"], rgb, camera, coords_for(32, 300, 1), backbone, naf)
    halved = multi(TINY["shape_512"], one_view(half, front_pose(camera.distance)), coords_for(32, 300, 1),
                   backbone, naf)
    assert not torch.equal(one["global"], halved["global"])
    expected = torch.from_numpy(np.asarray(rgb.resize((64, 64), Image.LANCZOS), np.float32) / 255.0).permute(2, 0, 1)
    torch.testing.assert_close(view_pixels(half, 64), expected * (128 / 255.0), atol=6 / 255, rtol=0)  # 8-bit rounding


def test_sparse_rows_are_the_dense_rows_bitwise(backbone, naf):
    views = rig_views()
    extractor = TINY["shape_512"]
    g = extractor.grid_resolution
    coords = coords_for(g, 500, 3)
    dense = multi(extractor, views, None, backbone, naf)["proj"][0]  # [G³, C']
    sparse = multi(extractor, views, coords, backbone, naf)["proj"]
    c = coords.long()
    assert torch.equal(sparse.feats, dense[c[:, 1] * g * g + c[:, 2] * g + c[:, 3]])
    assert torch.equal(sparse.coords, coords)


def rig_views(turn: float = 0.0) -> PosedViews:
    """Four different views (the disc, recoloured) on upstream's rig, the whole rig turned by ``turn`` degrees."""
    _, rgba = disc_image()
    images = tuple(Image.fromarray(np.roll(np.asarray(rgba), shift, axis=2) if shift else np.asarray(rgba), "RGBA")
                   for shift in (0, 1, 2, 0))
    images = (*images[:3], images[3].transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    poses = [orbit_pose(a + turn, 3.1192049980163574) for a in (0, 90, 180, 270)]
    return PosedViews(images, torch.tensor(poses, dtype=torch.float32), torch.full((4,), 0.349, dtype=torch.float32),
                      1.0, ("a", "b", "c", "d"))


def test_two_copies_of_a_view_average_to_that_view(backbone, naf):
    _, rgba = disc_image()
    pose = front_pose(camera_from_fov(FOV).distance)
    twice = PosedViews((rgba, rgba), torch.tensor([pose, pose], dtype=torch.float32),
                       torch.tensor([FOV, FOV], dtype=torch.float32), 1.0, ("a", "b"))
    coords = coords_for(32, 300, 5)
    once = multi(TINY["shape_512"], one_view(rgba, pose), coords, backbone, naf)
    both = multi(TINY["shape_512"], twice, coords, backbone, naf)
    torch.testing.assert_close(both["global"], once["global"], rtol=1e-6, atol=1e-6)  # a batch of 2 through DINOv3
    torch.testing.assert_close(both["proj"].feats, once["proj"].feats, rtol=1e-6, atol=1e-6)


def test_turning_the_whole_rig_changes_only_rounding(backbone, naf):
    coords = coords_for(32, 400, 9)
    base = multi(TINY["shape_512"], rig_views(), coords, backbone, naf)
    turned = multi(TINY["shape_512"], rig_views(37.0), coords, backbone, naf)
    torch.testing.assert_close(turned["proj"].feats, base["proj"].feats, rtol=1e-4, atol=1e-4)
    assert torch.equal(turned["global"], base["global"])
    poses = relative_poses(rig_views(37.0).transforms)
    torch.testing.assert_close(poses, relative_poses(rig_views().transforms), rtol=0, atol=1e-5)
    first = one_view(rig_views().images[0], orbit_pose(0, 3.1192049980163574), 0.349)
    alone = multi(TINY["shape_512"], first, coords, backbone, naf)
    assert not torch.allclose(alone["proj"].feats, base["proj"].feats, atol=1e-3)  # control: the other views count


def test_the_views_go_through_the_backbone_as_one_batch_per_size(backbone, naf):
    views = rig_views()
    features = view_features(backbone, views, [128, 64, 128])
    assert features.sizes == (64, 128)
    assert features.at(64).tokens.shape == (4, 5 + 16 ** 2, 32) and features.at(128).image.shape == (4, 3, 128, 128)
    with pytest.raises(ValueError, match="reads 3 views' DINOv3 features at 128 px; these are 4 at 128 px"):
        three = PosedViews(views.images[:3], views.transforms[:3], views.fovs[:3], 1.0, ("a", "b", "c"))
        condition_views(TINY["shape_512"], features.at(128), three, coords_for(32, 10, 1), naf=naf)
