"""Features stage: DINOv3 on the preprocessed image, once per input size the flow stages read (reference §1.3).

The reference's four extractors share one backbone; it runs at 512 px (the structure and shape-512
conditions) and at 1024 px (shape 1024 and texture). Here those forwards run in their own stage, while
DINOv3 alone is loaded, and the tokens are kept in ``state.features`` (megabytes) for the flow stages, which
then need only NAF and their flow model: DINOv3 never shares memory with a flow, and loads once per run.

In the multi-view cascade (``flow_stage.on_views``) the stage reads the posed views instead of the image and runs
DINOv3 once per size on all of them as one batch, as upstream's multi-view extractor does
(``multiview.view_features``): batched and one-by-one forwards differ in the last bits.

The features are stored between stages like any output (a work directory keeps them, so a resumed run never
needs DINOv3 again) but not fingerprinted: every use of them is, in each flow stage's ``cond``.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pixal3d.config import CascadeConfig
from pixal3d.models.conditioning import image_features
from pixal3d.models.multiview import view_features

from .stage import CascadeStage
from .state import RunState
from .working_set import features_bytes

CONDITIONED = ("structure", "shape_512", "shape_1024", "texture")
"""The config sections whose ``condition.image_size`` the features are computed at."""


class FeaturesStage(CascadeStage):
    """``state.features``: DINOv3's tokens of the image at every size in ``sizes``."""

    name = "features"
    needs = ("dinov3",)
    inputs = ("image",)
    outputs = ("features",)
    unfingerprinted = ("features",)

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = tuple(sorted(set(sizes)))

    @classmethod
    def from_config(cls, config: CascadeConfig) -> FeaturesStage:
        return cls(tuple(getattr(config, section).condition.image_size for section in CONDITIONED))

    def working_set(self) -> int:
        return features_bytes(self.sizes, views=self.view_count or 1)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        if self.view_count is not None:
            state.features = view_features(models["dinov3"], state.views, self.sizes)
        else:
            state.features = image_features(models["dinov3"], state.image, self.sizes)
