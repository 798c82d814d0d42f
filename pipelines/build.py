"""The cascade's stages, in run order, built once from a config; any of them can be replaced by name.

A config with a ``views`` section builds the multi-view cascade: the ``views`` stage in place of preprocess and
camera, the features and flow stages reading the views instead of the image and its camera
(``flow_stage.on_views``), the rest unchanged.

A stage on existing models is added by writing its file (a ``CascadeStage``), adding its class to
``CASCADE_STAGES`` and, if it writes new fields, declaring them on ``RunState``. A benchmark replaces a
stage without editing anything::

    Pixal3D.from_config(config, replace={"structure": SyntheticStructure(config.structure)})
"""
from __future__ import annotations

from collections.abc import Mapping

from pixal3d.config import CascadeConfig

from .camera import CameraStage
from .decode import DecodeStage
from .export import ExportStage
from .features import FeaturesStage
from .flow_stage import IMAGE_SOURCE, on_views
from .preprocess import PreprocessStage
from .shape_512 import Shape512Stage
from .shape_1024 import Shape1024Stage
from .stage import CascadeStage
from .structure import StructureStage
from .texture import TextureStage
from .upsample import UpsampleStage
from .views import ViewsStage

CASCADE_STAGES: tuple[type[CascadeStage], ...] = (
    PreprocessStage, CameraStage, FeaturesStage, StructureStage, Shape512Stage, UpsampleStage, Shape1024Stage, TextureStage,
    DecodeStage, ExportStage,
)
VIEWS_CASCADE_STAGES: tuple[type[CascadeStage], ...] = (
    ViewsStage, FeaturesStage, StructureStage, Shape512Stage, UpsampleStage, Shape1024Stage, TextureStage,
    DecodeStage, ExportStage,
)
"""The multi-view cascade (a config with ``views``)."""


def build_stages(config: CascadeConfig, *, replace: Mapping[str, CascadeStage] | None = None,
                 until: str | None = None) -> list[CascadeStage]:
    """The stages of ``config``'s cascade in run order; ``replace`` swaps stages by name, ``until`` stops
    after the named stage (a run that ends at, say, ``decode``)."""
    replace = dict(replace or {})
    stages = []
    for cls in VIEWS_CASCADE_STAGES if config.views is not None else CASCADE_STAGES:
        if cls.name in replace:
            stages.append(replace.pop(cls.name))
        else:
            stage = cls.from_config(config)
            if config.views is not None and any(f in stage.inputs for f in IMAGE_SOURCE):
                stage = on_views(stage, config.views.plan_views)
            stages.append(stage)
        if stages[-1].name == until:
            break
    names = [s.name for s in stages]
    if replace:
        raise KeyError(f"no stage named {sorted(replace)} to replace; stages: {names}")
    if until is not None and names[-1] != until:
        raise KeyError(f"no stage named {until!r} to stop at; stages: {names}")
    return stages
