"""Image conditioning from several posed views: per view, then the average (reference
``DinoV3ProjMultiViewFeatureExtractor(multiview_fusion="average")``, ``ProjGridMV``).

What the reference does, in its order and dtypes (all float32), and what this module does the same way:

1. Each view ``[0, 1]`` RGB, LANCZOS-resized to the extractor's size S *as RGBA* (Pillow resizes RGBA
   premultiplied) and premultiplied by its alpha: ``rgb · alpha`` (``view_pixels``).
2. DINOv3 runs once on the V views as one batch ``[V, 3, S, S]`` (ImageNet-normalised); tokens ``[V, T, C]``
   (``view_features``, in the features stage; kept as ``BackboneFeatures`` with one row per view).
3. Poses relative to the main view: ``calc_i = F · inv(C_0) · C_i`` (``relative_poses``), with ``F`` the front
   camera at frame 0's distance: view 0 lands on ``F`` (exactly, for a frame 0 at the front pose).
4. Per view, in view order: the grid projected through ``calc_i`` (``project_posed``), the low-res patch features
   and (NAF extractors) the NAF features sampled there, concatenated; summed into the first view's, in place.
5. ``proj = sum / V``; ``global = mean over the views`` of the 5 global tokens.

So the fused condition has the single-view shapes and the denoisers are the single-view networks with their own
weights. The reference projects the dense ``G³`` grid and gathers the stage's coords after fusing; here the
dense grid is projected the same way (``[G³, 2]``, a few MB) and only the coords' rows are sampled, per view:
sampling is per point, so the gathered rows are the same bits, and a stage's peak grows by one view's
``[N, C']`` features (the sum and the view being added), not by V dense maps.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from ..nn.sparse_tensor import SparseTensor
from .conditioning import NAF_MODES, BackboneFeatures, ExtractorConfig, ImageFeatures, NafMode, project_features
from .dinov3 import IMAGENET_MEAN, IMAGENET_STD, extract_tokens, num_global_tokens
from .naf import NAF
from .projection import grid_points, project_posed

if TYPE_CHECKING:
    from transformers import DINOv3ViTModel

FRONT_VIEW = ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, -1.0, -2.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
"""The reference's ``front_view_transform_matrix`` (its translation set to the main view's distance)."""


@dataclass(frozen=True)
class PosedViews:
    """The views a multi-view run is conditioned on: matted images and their cameras.

    images:     the V views, ``RGBA`` (alpha: the object), each at its own size
    transforms: ``[V, 4, 4]`` float32 camera-to-world matrices (frame 0 the main view)
    fovs:       ``[V]`` float32 horizontal fields of view in radians
    mesh_scale: the grid's scale (``transforms.json``'s, 1 by default)
    names:      what each view is called
    """

    images: tuple[Image.Image, ...]
    transforms: torch.Tensor
    fovs: torch.Tensor
    mesh_scale: float
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.images)

    def fingerprint_parts(self) -> dict[str, Any]:
        """What a run's fingerprints cover (the names are labels, not numbers)."""
        return {"images": list(self.images), "transforms": self.transforms, "fovs": self.fovs,
                "mesh_scale": self.mesh_scale}


def view_pixels(image: Image.Image, size: int) -> torch.Tensor:
    """One view as the reference's ``to_cond_tensor``: RGBA LANCZOS-resized to ``size``², premultiplied by its
    alpha, ``[3, S, S]`` float32 in [0, 1]."""
    image = image.convert("RGBA").resize((size, size), Image.LANCZOS)
    alpha = torch.tensor(np.array(image.getchannel(3))).float() / 255.0
    rgb = torch.tensor(np.array(image.convert("RGB"))).permute(2, 0, 1).float() / 255.0
    return rgb * alpha.unsqueeze(0)


def view_features(backbone: DINOv3ViTModel, views: PosedViews, sizes: Iterable[int]) -> ImageFeatures:
    """DINOv3 on the V views at each size in ``sizes``, the views as one batch per size (the reference's one
    forward over ``B·V`` images): per size, tokens ``[V, T, C]`` and the premultiplied views ``[V, 3, S, S]``."""
    return ImageFeatures({size: _batch_features(backbone, views, size) for size in sorted(set(sizes))})


def _batch_features(backbone: DINOv3ViTModel, views: PosedViews, size: int) -> BackboneFeatures:
    patch = backbone.config.patch_size
    if size % patch:
        raise ValueError(f"image size {size} must be a multiple of the DINOv3 patch size {patch}")
    device = backbone.embeddings.patch_embeddings.weight.device
    raw = torch.stack([view_pixels(image, size) for image in views.images], dim=0).to(device)  # [V, 3, S, S]
    mean = torch.as_tensor(IMAGENET_MEAN, dtype=raw.dtype, device=device)[:, None, None]
    std = torch.as_tensor(IMAGENET_STD, dtype=raw.dtype, device=device)[:, None, None]
    normalised = raw.clone().sub_(mean).div_(std)  # torchvision's Normalize
    with torch.no_grad():
        tokens = extract_tokens(backbone, normalised)
    return BackboneFeatures(tokens=tokens, image=raw, num_global=num_global_tokens(backbone))


def fused_global(features: BackboneFeatures) -> torch.Tensor:
    """The views' CLS + register tokens averaged: ``[1, 5, C]`` (reference: cat, reshape, ``mean(dim=1)``)."""
    v, g = features.tokens.shape[0], features.num_global
    tokens = torch.cat([features.tokens[:, 0:1], features.tokens[:, 1:g]], dim=1)  # [V, 5, C]
    return tokens.reshape(1, v, g, tokens.shape[-1]).mean(dim=1)


def view_patch_map(features: BackboneFeatures, view: int) -> torch.Tensor:
    """View ``view``'s patch tokens as a ``[1, C, S/16, S/16]`` map (its rows taken out, as the reference's
    ``z_patchtokens_spatial[idx]``)."""
    patches = features.tokens[:, features.num_global:]
    side = round(patches.shape[1] ** 0.5)
    spatial = patches.reshape(patches.shape[0], side, side, -1)
    return spatial[torch.tensor([view], device=spatial.device)].permute(0, 3, 1, 2)


def view_image(features: BackboneFeatures, view: int) -> torch.Tensor:
    """View ``view``'s NAF guidance image ``[1, 3, S, S]``."""
    return features.image[torch.tensor([view], device=features.image.device)]


def relative_poses(transforms: torch.Tensor) -> torch.Tensor:
    """``calc_i = F · inv(C_0) · C_i`` ``[V, 4, 4]`` for camera-to-world ``transforms [V, 4, 4]``, ``F`` the front
    camera at frame 0's distance (``‖t_0‖``): the reference's ``compute_relative_calc_mat`` with a batch of one."""
    transforms = transforms[None].float()  # [1, V, 4, 4]
    b, v = transforms.shape[:2]
    distance = torch.norm(transforms[:, :, :3, 3], dim=-1)  # [1, V]
    front = torch.tensor(FRONT_VIEW, device=transforms.device).unsqueeze(0).expand(b, -1, -1).clone()
    front[:, 1, 3] = -distance[:, 0]
    front = front.unsqueeze(1)  # [1, 1, 4, 4]
    first = transforms[:, 0:1].expand(b, v, 4, 4).reshape(b * v, 4, 4)
    every = transforms.reshape(b * v, 4, 4)
    rel = torch.bmm(torch.linalg.inv(first), every)  # inv(C_0) @ C_i
    return torch.bmm(front.expand(b, v, 4, 4).reshape(b * v, 4, 4), rel)


def condition_views(extractor: ExtractorConfig, features: BackboneFeatures, views: PosedViews,
                    coords: torch.Tensor | None = None, *, naf: NAF | None = None,
                    naf_mode: NafMode = "full") -> dict[str, Any]:
    """The fused condition of one extractor from the ``views``' DINOv3 ``features`` at its input size (one row per
    view, ``view_features``): ``{'global': [1, 5, C], 'proj': dense [1, G³, C'] or SparseTensor [N, C'] on
    ``coords [N, 4]`` int32}``, as ``conditioning.condition`` gives for one image."""
    if extractor.naf_size is not None and naf is None:
        raise ValueError(f"extractor {extractor.name!r} upsamples with NAF (T={extractor.naf_size}); pass naf=")
    if naf_mode not in NAF_MODES:
        raise ValueError(f"naf_mode must be one of {NAF_MODES}; got {naf_mode!r} (resolve 'auto' with select_naf_mode)")
    if features.size != extractor.image_size or features.tokens.shape[0] != views.count:
        raise ValueError(f"extractor {extractor.name!r} reads {views.count} views' DINOv3 features at "
                         f"{extractor.image_size} px; these are {features.tokens.shape[0]} at {features.size} px")
    device = features.tokens.device
    g = extractor.grid_resolution
    rows = None
    if coords is not None:
        if coords.dtype != torch.int32 or (coords.numel() and int(coords[:, 0].max()) != 0):
            raise ValueError("coords must be int32 [N, 4] (batch, x, y, z) of a single image (batch index 0)")
        xyz = coords[:, 1:].to(device).long()
        if xyz.numel() and (int(xyz.min()) < 0 or int(xyz.max()) >= g):
            raise ValueError(f"coords lie outside the {g}³ grid (min {int(xyz.min())}, max {int(xyz.max())})")
        rows = xyz[:, 0] * g * g + xyz[:, 1] * g + xyz[:, 2]  # the dense rows the reference gathers
    points = grid_points(g, device=device)
    poses = relative_poses(views.transforms.to(device))
    fovs = views.fovs.to(device)
    scale = torch.as_tensor(views.mesh_scale, dtype=torch.float32, device=device)
    fused = None
    with torch.no_grad():
        for view in range(views.count):  # one view at a time: the peak grows by one view's features
            grid = project_posed(points, poses[view], fovs[view], extractor.image_size, scale)  # [G³, 2]
            if rows is not None:
                grid = grid[rows]
            projected = project_features(extractor, view_patch_map(features, view), view_image(features, view),
                                         grid, naf, naf_mode)  # [K, C']
            if fused is None:
                fused = projected.contiguous()
            else:
                fused.add_(projected)
                del projected
        fused.div_(views.count)
    if coords is None:
        return {"global": fused_global(features), "proj": fused[None]}
    return {"global": fused_global(features), "proj": SparseTensor(fused, coords.to(device))}
