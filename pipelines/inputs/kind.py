"""``InputKind``: what one kind of input (an image, posed views, ...) means to every layer that takes it.

A kind owns, for its inputs, everything that used to be an ``if views:`` at each site:

    which cascade   the configs it runs on (``takes``), its stages and how the shared ones read it (``stages``)
    the library     the argument's type (``check``), the options that go with it (``check_options``), names
                    and labels, the check before its first stage (``open``), its digest and the provided fields
                    that key its stages (``provided``), the fields it gives a fresh ``RunState`` (``state``)
    the command     the paths it is given (``expand``) and their check from headers (``probe``)
    the uploads     the fields a web form or a request carries for it (``upload``), how a request's fields that
                    do not go together are refused (``refuse_request``, ``refuse_upload``), and how an upload
                    becomes the run's input, written in the job's folder (``upload_stem``, ``receive``), and the
                    job's other fields found there again (``received``, ``batch_key``)

Importing a kind imports no torch (the command's ``--help`` and ``pipelines.job`` use the table): what a kind
needs of the models is imported where it is used.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_FILE = "image"
"""An upload field that takes an image file, checked from its header (Gradio's word for image files too)."""
ANY_FILE = "file"
JSON_FILE = "json"
"""A JSON document: a file, or its text."""
TEXT = "text"
NUMBER = "number"
ACCEPTS = (IMAGE_FILE, ANY_FILE, JSON_FILE, TEXT, NUMBER)
"""What an upload field can take (``UploadField.accepts``): the front ends build each field's element and check
from this word alone."""


@dataclass(frozen=True)
class UploadField:
    """One field of a kind's upload (a multipart request's part, a web form's element); the front ends build their
    form and their parser from these, so a new kind's upload is its ``upload`` and the methods below, nothing else.

    name:      the request's part; the form's element id is the name with ``-`` for ``_``
    label:     what the web app's form calls it
    accepts:   one of ``ACCEPTS``: ``image`` (a file, checked from its header), ``file`` (any file, e.g. a mesh),
               ``json`` (a file, or its text), ``text``, ``number``
    most:      how many files it takes (1: one; more: several, ``item`` naming one of them in messages)
    required:  the upload needs it; ``ask`` (the server's: how to send it) and ``missing`` (the app's error) say so
    unit:      a text field's unit, in words; ``default``: the form's starting value
    example:   an example under the repository's ``assets/`` (a file, or a glob for several files)
    """

    name: str
    label: str
    accepts: str = IMAGE_FILE
    most: int = 1
    required: bool = True
    ask: str = ""
    missing: str = ""
    item: str = ""
    unit: str = ""
    default: Any = None
    example: str | None = None

    @property
    def file(self) -> bool:
        """A file field (a ``json`` one takes the document's text too)."""
        return self.accepts in (IMAGE_FILE, ANY_FILE, JSON_FILE)

    def __post_init__(self) -> None:
        if self.accepts not in ACCEPTS:
            raise ValueError(f"upload field {self.name!r} accepts {self.accepts!r}, not one of {ACCEPTS}")

    @property
    def form(self) -> str:
        return self.name.replace("_", "-")


@dataclass(frozen=True)
class Uploaded:
    """One uploaded file: the name it was sent under, and its bytes (the server's) or where it lies (the web app's
    cached upload); ``suffix``: an image's, from its header."""

    filename: str
    data: bytes = b""
    path: Path | None = None
    suffix: str = ""

    def read(self) -> bytes:
        return self.data if self.path is None else self.path.read_bytes()


class InputKind:
    """The base of every kind of input; each kind is one instance in ``pipelines.inputs.KINDS``."""

    name: str = ""             # "image", "views": run.json's, the table's and the messages' word for the kind
    argument: str = ""         # the library's keyword (``Pixal3D.run(image=...)``, ``run(views=...)``)
    noun: str = ""             # one input in words ("image", "views folder")
    readable: str = ""         # what one input may be, in words (for the argument's type error)
    batch_argument: str = ""   # ``Pixal3D.run_batch``'s keyword (``images``, ``views``)
    flag: str | None = None    # the command's option (None: the positional inputs)
    provides: tuple[str, ...] = ()  # the ``RunState`` fields a run of this kind provides its first stage
    options: tuple[str, ...] = ()   # the job settings that go with this kind (``pipelines.job.SETTINGS`` rows)
    upload: tuple[UploadField, ...] = ()  # the fields of its upload, in the form's and the request's order
    upload_title: str = ""     # the web page's heading (Markdown) for a config of this kind
    upload_prompt: str = ""    # the page's status line before the first job
    request_help: str = ""     # the server's answer to a request that is not multipart
    upload_noun: str = ""      # what one upload of this kind is, in a refusal ("one image", "posed views")
    default_config: str = ""   # the shipped config the command runs when it is given this kind and no --config

    # -- which cascade -----------------------------------------------------------------------------
    def takes(self, config: Any, given: Collection[str] = ()) -> bool:
        """Whether ``config``'s cascade takes this kind of input, given inputs of the kinds named in ``given``."""
        raise NotImplementedError

    @property
    def arguments(self) -> tuple[str, ...]:
        """The library arguments a run of this kind takes (its own; a kind that goes with an image, the image's too)."""
        return (self.argument,)

    def missing(self, config: Any) -> str | None:
        """Why a run of this kind given no input of it cannot start (None: the argument's check says it)."""
        return None

    def stage_classes(self, config: Any) -> tuple[type, ...]:
        """The cascade's stages, in run order, for this kind."""
        raise NotImplementedError

    def adapt(self, stage: Any, config: Any) -> Any:
        """A shared stage as it reads this kind (the default: as it is)."""
        return stage

    # -- the library -------------------------------------------------------------------------------
    def check(self, value: Any, argument: str) -> None:
        """``TypeError``/``ValueError`` naming ``argument`` unless ``value`` is one input of this kind."""
        raise NotImplementedError

    def check_batch(self, values: Any, argument: str) -> None:
        """``values`` is a list of inputs of this kind (not one path or image, whose characters or rows would
        become inputs), each checked."""
        from PIL import Image

        one = isinstance(values, (str, Path, Image.Image)) or type(values).__name__ == "ndarray"
        if one or not isinstance(values, Sequence):
            raise TypeError(f"{argument} must be a list of {self.noun}s ({self.readable} each), not "
                            f"{type(values).__name__}; for one {self.noun} call run({self.argument}=...)")
        for index, value in enumerate(values):
            self.check(value, f"{argument}[{index}]")

    def check_options(self, config: Any, options: Mapping[str, Any]) -> None:
        """``ValueError`` for a run option given that does not go with this kind (``options``: name → value, None:
        not given)."""
        for name, value in options.items():
            if name not in self.options and _given(value):
                raise ValueError(self.refuse_option(config, name))

    def refuse_setting(self, name: str) -> str:
        """Why the job setting ``name`` (a front end's) does not apply to this kind of input."""
        return f"{name} does not apply to {self.noun} inputs; drop it"

    def refuse_option(self, config: Any, name: str) -> str:
        """Why option ``name`` does not go with this kind, in the library's words."""
        return f"{name} does not apply to {self.noun} inputs; drop it"

    def default_name(self, source: Any, index: int) -> str:
        """What outputs and records call ``source`` when the caller names it not."""
        return Path(source).stem if isinstance(source, (str, Path)) else f"image{index}"

    def label(self, source: Any) -> str:
        """What run.json calls ``source``."""
        return str(source) if isinstance(source, (str, Path)) else "<image>"

    def open(self, source: Any, options: Mapping[str, Any]) -> Any:
        """``source`` checked before its first stage, as the stages take it (``ImageError`` for an unusable one)."""
        return source

    def checked(self, source: Any) -> Any:
        """What the stages' ``check_input`` takes of an opened ``source`` (the image of an image with a mesh)."""
        return source

    def digest(self, source: Any) -> str:
        """sha256 of ``source`` (what keys its stages' records)."""
        raise NotImplementedError

    def provided(self, digest: str | None) -> dict[str, Any]:
        """The provided input fields as the stages' keys see them."""
        raise NotImplementedError

    def state(self, source: Any, *, reads_input: bool) -> dict[str, Any]:
        """The input fields of a fresh ``RunState`` (``reads_input``: a stage still to run reads them)."""
        raise NotImplementedError

    # -- the uploads -------------------------------------------------------------------------------
    def upload_stem(self, parts: Mapping[str, Any]) -> str:
        """What the outputs of an upload (``parts``: field name → its ``Uploaded`` files, or its text) are called."""
        return self.name

    def refuse_request(self, parts: Mapping[str, Any]) -> str | None:
        """Why a request's fields (present: not None or empty) do not go together (a malformed request), or None."""
        return None

    def refuse_upload(self, config: Any, other: InputKind | None) -> str:
        """Why a request carrying ``other``'s upload (None: more files than this kind's upload takes) cannot run on
        ``config`` (of this kind)."""
        instead = "" if other is None else f", not {other.upload_noun}"
        return f"this server's config ({config.name}) takes {self.upload_noun}{instead}: {self.request_help}"

    def receive(self, parts: Mapping[str, Any], folder: Path, options: Mapping[str, Any]) -> Any:
        """The run's input from an upload's ``parts`` (file fields: tuples of ``Uploaded``; text fields: the text,
        or None), written under ``folder`` where it must be written and checked as a run would check it
        (``options``: the job's settings of this kind); ``ImageError`` (one line) for an upload that cannot be one."""
        raise NotImplementedError

    def received(self, folder: Path) -> dict[str, Any]:
        """The job's fields besides its input that ``receive`` wrote in ``folder`` (a mesh to texture: ``Job.mesh``),
        found there again by whoever runs the job (the server's worker); {} for a kind whose upload is its input."""
        return {}

    def batch_key(self, folder: Path) -> dict[str, str]:
        """What jobs received in ``folder`` must share besides their settings to run as one batch (a batch runs
        with one of each field ``received`` gives: the mesh's sha256); {} for a kind whose upload is its input."""
        return {}

    # -- the command -------------------------------------------------------------------------------
    def refuse_command(self, config: Any, given: Mapping[str, Sequence[Path]]) -> str | None:
        """Why the command's inputs (kind name → paths) cannot run on ``config`` (of this kind), or None."""
        return None

    def refuse_other(self, config: Any, argument: str) -> str:
        """Why another kind's library argument cannot run on ``config`` (of this kind)."""
        return f"{config.source or config.name} takes {self.noun} inputs ({self.argument}=), not {argument}="

    def command_inputs(self, given: Mapping[str, Sequence[Path]]) -> Sequence[Path]:
        """The command's paths that are this kind's inputs (kind name → paths: its own, by default)."""
        return given.get(self.name) or ()

    def expand(self, paths: Sequence[Path]) -> list[Path]:
        """The command's paths as inputs of this kind (``UsageError`` for one that cannot be)."""
        raise NotImplementedError

    def probe(self, path: Path, options: Mapping[str, Any]) -> Any:
        """One of the command's inputs checked from its headers, before any weight is read (``ImageError``);
        returns it as the plan's ``check_input`` takes it."""
        raise NotImplementedError

    def several(self, paths: Sequence[Path]) -> bool:
        """The command was given a batch (several inputs, or a folder of them)."""
        return len(paths) > 1


def _given(value: Any) -> bool:
    """An option counts as given unless it is None (or, per input, all None)."""
    if isinstance(value, (list, tuple)):
        return any(v is not None for v in value)
    return value is not None
