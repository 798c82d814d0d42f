"""The kinds of input, in one table: which one a run takes, and everything it means (``kind.InputKind``).

    kind = kind_for(config)                 # the kind the config's cascade takes
    kind = library_kind(config, arguments={"image": image, "views": None}, options={"fov": fov, ...})
    kind = command_kind(config, {"image": paths, "views": []})
    kind = request_kind(config, {"image", "mesh", "settings"})   # an upload's: the fields a request carries

A new kind is one file here (its ``InputKind``) and a row of ``KINDS``; its stages declare what else they need.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pixal3d.config import UsageError

from .image import IMAGE, IMAGE_SUFFIXES, READABLE_IMAGES, ImageInput
from .kind import InputKind, Uploaded, UploadField
from .mesh import MESH, MeshInput
from .views import VIEWS, ViewsInput

__all__ = ["IMAGE", "IMAGE_SUFFIXES", "KINDS", "MESH", "READABLE_IMAGES", "VIEWS", "ImageInput", "InputKind",
           "MeshInput", "UploadField", "Uploaded", "ViewsInput", "command_kind", "kind_for", "library_kind", "request_kind",
           "request_kinds", "upload_fields", "upload_kind"]

KINDS: tuple[InputKind, ...] = (VIEWS, MESH, IMAGE)
"""Every kind of input; the first whose ``takes`` holds for a config is the one its cascade runs on."""
BY_NAME = {kind.name: kind for kind in KINDS}
INPUT_FIELDS = tuple(dict.fromkeys(field for kind in KINDS for field in kind.provides))
"""The ``RunState`` fields the kinds' inputs arrive in (``RunState.input_image``, ...)."""


def kind_for(config: Any, given: Collection[str] = ()) -> InputKind:
    """The kind of input ``config``'s cascade takes, given inputs of the kinds named in ``given`` (a kind that goes
    with another's input, such as a mesh with an image, is taken only when given)."""
    for kind in KINDS:
        if kind.takes(config, given):
            return kind
    raise ValueError(f"no kind of input runs on {config.source or config.name}")


def kind_named(config: Any, name: str | None) -> InputKind:
    """The kind called ``name`` (None: the one ``config`` takes), refused (``ValueError``) when ``config``'s cascade
    cannot take it."""
    if name is None:
        return kind_for(config)
    named = {kind.name: kind for kind in KINDS}  # the table as it is now (a test may put a kind in it)
    if name not in named:
        raise ValueError(f"input_kind {name!r} is not one of {sorted(named)}")
    kind = named[name]
    if not kind.takes(config, kind.arguments):
        raise ValueError(f"{config.source or config.name} does not take {kind.noun} inputs; its cascade takes "
                         f"{kind_for(config).noun} inputs")
    return kind


def library_kind(config: Any, *, arguments: Mapping[str, Any], options: Mapping[str, Any],
                 planned: InputKind | None = None) -> InputKind:
    """The kind ``config`` takes, checked against the library's arguments (kind's argument → value, None: not given)
    and options (``fov``, ``num_views``: None when not given): its own argument given, no other kind's, only its
    own options, and the kind the pipeline was ``planned`` for (``ValueError`` naming what to pass instead)."""
    kind = kind_for(config, [name for name, value in arguments.items() if value is not None])
    for name, value in arguments.items():
        if name not in kind.arguments and value is not None:
            raise ValueError(kind.refuse_other(config, name))
    missing = kind.missing(config) if arguments.get(kind.argument) is None else None
    if missing is not None:
        raise ValueError(missing)
    kind.check_options(config, options)
    if planned is not None and kind is not planned:
        raise ValueError(f"this pipeline was planned for {planned.noun} inputs ({planned.argument}=), not {kind.noun} "
                         f"inputs; plan with input_kind={kind.name!r}")
    return kind


def open_options(kind: InputKind, given: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """What ``kind.open`` takes for every input of a run (the library's ``given`` arguments and ``options``): the
    views to use, and a mesh to texture read and checked once (``MeshError``, one line, before any weight)."""
    opens = {"num_views": options.get("num_views")}
    if "mesh" in kind.arguments:
        from .mesh import read_run_mesh

        mesh = given.get("mesh")
        opens["mesh"] = mesh if hasattr(mesh, "digest") else read_run_mesh(mesh, options.get("mesh_pose"))
    return opens


def command_kind(config: Any, given: Mapping[str, Sequence[Path]]) -> InputKind:
    """The kind ``config`` takes, checked against the command's inputs (kind name → the paths given for it):
    ``UsageError`` naming the flag when they are of another kind, or missing."""
    kind = kind_for(config, [name for name, paths in given.items() if paths])
    refusal = kind.refuse_command(config, given)
    if refusal is not None:
        raise UsageError(refusal)
    return kind


def request_kinds(config: Any) -> tuple[InputKind, ...]:
    """The kinds an upload on ``config`` may be of: the config's own (``kind_for(config)``), then each kind that goes
    with another's input and that the config takes when given it (on a single-view config: a mesh with an image)."""
    own = kind_for(config)
    return (own, *(kind for kind in KINDS if kind is not own and kind_for(config, [kind.name]) is kind))


def request_kind(config: Any, names: Collection[str]) -> InputKind:
    """The kind a request (or a form) carrying the fields ``names`` runs as: among ``request_kinds(config)``, the
    first besides the config's own whose required upload fields the config's kind's upload has not are all carried
    (an image with a mesh: a mesh job), else the config's own kind."""
    own, *others = request_kinds(config)
    ours = {field.name for field in own.upload}
    for kind in others:
        needed = {field.name for field in kind.upload if field.required} - ours
        if needed and needed <= set(names):
            return kind
    return own


def upload_fields(config: Any) -> tuple[UploadField, ...]:
    """The fields of every upload ``config`` takes (``request_kinds``), each once, in the config's kind's order then
    the others'; a field the config's own upload has not is optional (given, it makes the upload of its kind)."""
    own, *others = request_kinds(config)
    fields = {field.name: field for field in own.upload}
    for kind in others:
        for field in kind.upload:
            fields.setdefault(field.name, dataclasses.replace(field, required=False))
    return tuple(fields.values())


def upload_kind(names: Collection[str], kind: InputKind) -> InputKind | None:
    """The other kind whose upload a request with the fields ``names`` carries (one of its required fields that
    ``kind``'s upload has not; first a kind whose required fields it carries all: an image alone is an image's
    upload, not a mesh's), or None."""
    ours = {field.name for field in kind.upload}
    carried = [other for other in KINDS if any(field.required and field.name in names and field.name not in ours
                                               for field in other.upload)]
    whole = [other for other in carried if all(field.name in names for field in other.upload if field.required)]
    return next(iter(whole or carried), None)


def given_kind(given: Mapping[str, Sequence[Path]]) -> InputKind:
    """The kind the command's inputs are of (for its default config): a flagged kind given, else images."""
    for kind in KINDS:
        if kind.flag is not None and given.get(kind.name):
            return kind
    return IMAGE


def flagged() -> tuple[InputKind, ...]:
    """The kinds the command takes by an option of their own (``--views``)."""
    return tuple(kind for kind in KINDS if kind.flag is not None)


def paths_of(value: Any) -> list[Path]:
    return [Path(v) for v in value or ()]
