"""The cascade's stages, in run order, built once from a config; any of them can be replaced by name.

The kind of input (``pipelines.inputs``) chooses the cascade and how its shared stages read that input: a config
with a ``views`` section takes posed views, whose ``views`` stage takes the place of preprocess and camera, the
features and flow stages reading the views instead of the image and its camera (``flow_stage.on_views``).

A stage on existing models is added by writing its file (a ``CascadeStage``), adding its class to its kind's
``stage_classes`` (``pipelines/inputs/``) and, if it writes new fields, declaring them on ``RunState``. A benchmark
replaces a stage without editing anything::

    Pixal3D.from_config(config, replace={"structure": SyntheticStructure(config.structure)})
"""
from __future__ import annotations

from collections.abc import Mapping

from pixal3d.config import CascadeConfig

from .inputs import IMAGE, VIEWS, InputKind, kind_for
from .stage import CascadeStage

CASCADE_STAGES: tuple[type[CascadeStage], ...] = IMAGE.stage_classes(None)
"""The single-view cascade (each kind of input names its stages: ``pipelines.inputs``)."""
VIEWS_CASCADE_STAGES: tuple[type[CascadeStage], ...] = VIEWS.stage_classes(None)
"""The multi-view cascade (a config with ``views``)."""


def build_stages(config: CascadeConfig, *, kind: InputKind | None = None,
                 replace: Mapping[str, CascadeStage] | None = None, until: str | None = None) -> list[CascadeStage]:
    """The stages of ``config``'s cascade for ``kind`` of input (default: the one the config takes) in run order;
    ``replace`` swaps stages by name, ``until`` stops after the named stage (a run that ends at, say, ``decode``)."""
    kind = kind or kind_for(config)
    replace = dict(replace or {})
    stages = []
    for cls in kind.stage_classes(config):
        if cls.name in replace:
            stages.append(replace.pop(cls.name))
        else:
            stages.append(kind.adapt(cls.from_config(config), config))
        if stages[-1].name == until:
            break
    names = [s.name for s in stages]
    if replace:
        raise KeyError(f"no stage named {sorted(replace)} to replace; stages: {names}")
    if until is not None and names[-1] != until:
        raise KeyError(f"no stage named {until!r} to stop at; stages: {names}")
    return stages
