"""The cascade's stages, in run order, built once from a config; any of them can be replaced by name.

The kind of input (``pipelines.inputs``) chooses the cascade and how its shared stages read that input: a config
with a ``views`` section takes posed views, whose ``views`` stage takes the place of preprocess and camera, the
features and flow stages reading the views instead of the image and its camera (``flow_stage.on_views``).

A stage on existing models is added by writing its file (a ``CascadeStage``), adding its class to its kind's
``stage_classes`` (``pipelines/inputs/``) and, if it writes new fields, declaring them on ``RunState``. A benchmark
replaces a stage without editing anything::

    Pixal3D.from_config(config, replace={"structure": SyntheticStructure(config.structure)})

A shape-only run (``until=SHAPE_ONLY``, the command's ``--shape-only``) is the cascade up to ``shape_1024``, then
``shape_decode`` (the shape decoder alone) and ``shape_export`` (an untextured GLB): its shared stages are the full
cascade's own objects, so their work-dir records are the full run's and the same run without it resumes at
``texture``.
"""
from __future__ import annotations

from collections.abc import Mapping

from pixal3d.config import CascadeConfig

from .inputs import IMAGE, VIEWS, InputKind, kind_for
from .shape_decode import ShapeDecodeStage
from .shape_export import ShapeExportStage
from .stage import CascadeStage

CASCADE_STAGES: tuple[type[CascadeStage], ...] = IMAGE.stage_classes(None)
"""The single-view cascade (each kind of input names its stages: ``pipelines.inputs``)."""
VIEWS_CASCADE_STAGES: tuple[type[CascadeStage], ...] = VIEWS.stage_classes(None)
"""The multi-view cascade (a config with ``views``)."""
SHAPE_ONLY = ShapeExportStage.name
"""``until`` of a shape-only run: its last stage, after ``shape_decode``."""
SHAPE_ENDING: tuple[type[CascadeStage], ...] = (ShapeDecodeStage, ShapeExportStage)
SHAPE_ENDS_AFTER = "shape_1024"  # the last stage a shape-only run shares with the full cascade


def cascade_classes(kind: InputKind, config: CascadeConfig, until: str | None = None) -> tuple[type[CascadeStage], ...]:
    """``kind``'s stage classes for ``config``; when ``until`` names a stage of the shape-only ending, those up to
    ``shape_1024`` and then that ending."""
    classes = kind.stage_classes(config)
    if until not in {cls.name for cls in SHAPE_ENDING}:
        return classes
    names = [cls.name for cls in classes]
    if SHAPE_ENDS_AFTER not in names:
        raise KeyError(f"no stage named {SHAPE_ENDS_AFTER!r} to end a shape-only run after; stages: {names}")
    return (*classes[:names.index(SHAPE_ENDS_AFTER) + 1], *SHAPE_ENDING)


def build_stages(config: CascadeConfig, *, kind: InputKind | None = None,
                 replace: Mapping[str, CascadeStage] | None = None, until: str | None = None) -> list[CascadeStage]:
    """The stages of ``config``'s cascade for ``kind`` of input (default: the one the config takes) in run order;
    ``replace`` swaps stages by name, ``until`` stops after the named stage (a run that ends at, say, ``decode``; ``SHAPE_ONLY``: a shape-only run)."""
    kind = kind or kind_for(config)
    replace = dict(replace or {})
    stages = []
    for cls in cascade_classes(kind, config, until):
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
