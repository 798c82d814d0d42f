"""The job: what one run of the cascade is asked to do, as one typed value, whichever front end asked.

    job = Job.from_args(args)                    # the command's flags (pipelines/cli_args.py)
    job = Job.from_request(settings, config)     # the job server's JSON settings (POST /jobs)
    job = Job.from_form(values, config)          # the web app's form

A job holds the cascade config with its export settings applied, the plan's settings (memory policy and budget,
device, the parallel layout), its images (each with its name, seed and field of view) and where its results go.

Every setting a client may give is one row of ``SETTINGS``: its names (the command's flag, the JSON key and its
aliases, the app's form field), its kind and range, where an unset value comes from (the seed and the export
settings: the config, so the three front ends share one default) and whether it changes the plan. The command's
options, the server's accepted keys and the app's form are built from these rows, and the adapters check every
value here, once, before anything is planned: a new setting is one row and one field of ``Job`` (plus, when it is
not an export setting, the code that uses it). The memory budget is parsed here, once (``Budget``).

Importing this module imports no torch: the command's ``--help`` builds its parser from ``SETTINGS``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pixal3d.config import (  # noqa: F401 -- FOV, check_fov, check_seed, UsageError: re-exported for the front ends
    FOV,
    CascadeConfig,
    Range,
    SettingError,
    UsageError,
    check_fov,
    check_seed,
    load_config,
)
from pixal3d.memory_budget import parse_budget
from pixal3d.mesh.settings import COMPRESSIONS, PRESETS, TEXTURE_FORMATS, preset_changes
from pixal3d.shipped import shipped_config

from . import inputs
from .inputs import InputKind

DEFAULT_CONFIG = shipped_config(inputs.IMAGE.default_config)
"""The command's config for images when it is given no ``--config`` (each kind of input names its own)."""
POLICIES = ("resident", "staged", "offload", "eager", "stream", "auto")
"""``pixal3d.staging.Policy``'s values, written out so that no torch is needed to check one (a test holds them
equal)."""
TEXTURE_SIZES = (256, 512, 1024, 2048, 4096)
"""The texture sizes the web app offers (any size the export takes is accepted)."""


class SettingsError(UsageError):
    """A request's or a form's settings cannot be used; the message names the setting and what is accepted."""


# -- the ranges of a run's own values -------------------------------------------------------------
def _fov(fov: Any) -> float:
    check_fov(fov)
    return float(fov)  # 40 and 40.0 are one setting (the server groups jobs by their settings)


def check_num_views(count: Any) -> int:
    """``count`` views (an int >= 1), else a ``SettingError``."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise SettingError("num_views", f"number of views {count!r} is not an integer >= 1; e.g. 4")
    return count


def _preset(name: Any) -> str:
    if name not in PRESETS:
        raise SettingError("preset", f"preset {name!r} is not one of {list(PRESETS)}")
    return name


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise SettingError("shape_only", f"{value!r} is not true or false")
    return value


def _mesh_pose(pose: Any) -> str:
    if pose not in inputs.mesh.MESH_POSES:
        raise SettingError("mesh_pose", f"mesh pose {pose!r} is not one of {list(inputs.mesh.MESH_POSES)}")
    return pose


def check_policy(policy: Any) -> str:
    """``policy`` if it names a memory policy (``POLICIES``), else a ``SettingError``."""
    if policy not in POLICIES:
        raise SettingError("memory_policy", f"memory policy {policy!r} is not one of {list(POLICIES)}")
    return policy


@dataclass(frozen=True)
class Budget:
    """A memory budget, parsed once: ``text`` as given (``8G``, ``auto``), ``bytes`` (None for ``auto``: the memory
    available when the plan is made, less its headroom)."""

    text: str
    bytes: int | None

    @classmethod
    def parse(cls, text: Any) -> Budget | None:
        """``None``, ``""`` → no budget; ``auto``; a size (``parse_budget``: a ``SettingError`` naming it)."""
        if text is None or (isinstance(text, str) and not text.strip()):
            return None
        if isinstance(text, str) and text.strip() == "auto":
            return cls("auto", None)
        return cls(str(text).strip(), parse_budget(text))

    @property
    def value(self) -> int | str:
        """What ``Pixal3D.plan(memory_budget=...)`` takes."""
        return "auto" if self.bytes is None else self.bytes


# -- the settings a client may give ---------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting of a job, as every front end names and checks it.

    name:     the ``Job`` field, the command's option's ``dest`` and the job server's JSON key
    kind:     ``int``, ``float``, ``choice`` (one of ``choices``), ``size`` (a memory size, or ``auto``) or ``flag``
              (a switch: true, or unset; the command's option takes no value, the form's field is a checkbox)
    flag:     the command's option; ``form``: the web app's field (its element id); ``label``: the app's words
    aliases:  other JSON keys taken for it (the hosted Pixal3D endpoint's)
    export:   the ``ExportSettings`` field it overrides (checked there); None: a run or plan setting
    default:  an unset value; ``config``: where an unset value comes from instead (the seed, the export
              settings: the app's form shows it; an unset export setting leaves the config's as it is)
    check:    the value checked (``SettingError`` naming it) and as the job holds it; ``automatic``: what unset
              means, added to a refusal
    plans:    it changes the memory plan (the app redraws the plan when it changes)
    per_kind: it applies only to the kinds of input that list it (``InputKind.options``); given for another kind,
              a job refuses it in that kind's words (``InputKind.refuse_setting``), the app's form leaves it out,
              run.json's settings too
    """

    name: str
    kind: str
    flag: str
    form: str
    label: str
    help: str
    metavar: str | None = None
    choices: Callable[[], tuple[Any, ...]] | None = None
    aliases: tuple[str, ...] = ()
    export: str | None = None
    default: Any = None
    config: Callable[[CascadeConfig], Any] | None = None
    check: Callable[[Any], Any] | None = None
    automatic: str = ""
    plans: bool = False
    suggested: tuple[Any, ...] = ()
    per_kind: bool = False

    def applies_to(self, kind: InputKind) -> bool:
        """Whether the setting means anything for ``kind`` of input."""
        return not self.per_kind or self.name in kind.options

    def types(self) -> tuple[type, ...]:
        """The JSON types a request may send for it."""
        return {"int": (int,), "float": (int, float), "choice": (str,), "size": (str,), "flag": (bool,)}[self.kind]


SETTINGS: tuple[Setting, ...] = (
    Setting("seed", "int", "--seed", "seed", "seed", "random seed (default: the config's, 42)",
            config=lambda config: config.seed, check=check_seed),
    Setting("fov", "float", "--fov", "fov", "field of view (degrees)",
            "horizontal field of view in degrees (default: the config's, else MoGe-2)", metavar="DEG",
            check=_fov, automatic=", or automatic", per_kind=True),
    Setting("num_views", "int", "--num-views", "num-views", "views used (empty: all)",
            "multi-view configs: use the first N frames of each views folder's transforms.json (default: all)",
            metavar="N", check=check_num_views, automatic=", or empty for all", per_kind=True),
    Setting("memory_policy", "choice", "--memory-policy", "policy", "memory policy",
            "where idle models live (default: auto, chosen from the memory plan)", choices=lambda: POLICIES,
            default="auto", check=check_policy, plans=True),
    Setting("preset", "choice", "--preset", "preset", "export preset",
            "export preset: game, mobile, high or print (face budget, atlas size, maps; print: a closed shell, also "
            "STL and 3MF); --face-budget, --texture-size or --texture-format beside it win",
            choices=lambda: tuple(PRESETS), check=_preset, plans=True),
    Setting("texture_size", "int", "--texture-size", "texture", "texture size",
            "texels per side of the baked textures (default: the config's export.texture_size)", metavar="N",
            export="texture_size", config=lambda config: config.export.texture_size, plans=True,
            suggested=TEXTURE_SIZES),
    Setting("face_budget", "int", "--face-budget", "faces", "face budget",
            "faces the mesh is simplified to (default: the config's export.decimation_target)", metavar="N",
            aliases=("decimation_target",), export="decimation_target",
            config=lambda config: config.export.decimation_target, plans=True),
    Setting("memory_budget", "size", "--memory-budget", "budget", "memory budget (e.g. 8G, or auto; empty: none)",
            "bound every stage's work to this much process memory (e.g. 8G; auto: the memory available now less "
            "15 %%): the decode runs in tiles, the flow stages in smaller chunks, and a config that cannot fit is "
            "refused before any weight is read", metavar="SIZE", check=Budget.parse, automatic=", or auto",
            plans=True),
    Setting("texture_format", "choice", "--texture-format", "texture-format", "texture format",
            "the GLB's texture images, png or webp (default: the config's export.texture_format)",
            choices=lambda: TEXTURE_FORMATS, export="texture_format",
            config=lambda config: config.export.texture_format),
    Setting("compression", "choice", "--compression", "compression", "GLB compression",
            "compress the GLB's geometry: meshopt (EXT_meshopt_compression, needs the [compress] extra; default: "
            "the config's export.compression, none)", choices=lambda: COMPRESSIONS, export="compression",
            config=lambda config: config.export.compression),
    Setting("mesh_pose", "choice", "--mesh-pose", "mesh-pose", "mesh pose",
            "--mesh: how the mesh sits in the image's frame: aligned (as it lies, as --shape-only writes it; the "
            "default), estimate (registered to MoGe-2's points of the image; not with --fov) or normalize (centred and "
            "scaled into the cube, as TRELLIS.2 does: for a mesh that is not in the image's frame)",
            choices=lambda: inputs.mesh.MESH_POSES, check=_mesh_pose, per_kind=True),
    Setting("shape_only", "flag", "--shape-only", "shape-only", "shape only (an untextured mesh)",
            "stop after the shape decode: an untextured GLB; with --work-dir, the same command without --shape-only "
            "resumes into the texture (docs/shape-first.md)", default=False, check=_flag, plans=True),
)
"""Every setting a client may give, in the order the app's form shows them."""
BY_NAME = {s.name: s for s in SETTINGS}
ALIASES = {alias: s.name for s in SETTINGS for alias in s.aliases}
"""The hosted endpoint's name for a setting → ours (fal-ai/pixal3d: ``decimation_target`` is the face budget)."""


# -- numeric options of the front ends ------------------------------------------------------------
COUNT = Range(1, integer=True)
OPTIONS: dict[str, Range] = {
    "--pp": COUNT, "--patches": COUNT, "--warmup": Range(0, integer=True), "--data-groups": COUNT,
    "--parallel-timeout": Range(0, low_open=True),
    "--port": Range(1, 65535, integer=True), "--queue-size": COUNT, "--threads": COUNT, "--group-size": COUNT,
    "--max-pixels": COUNT, "--job-timeout": Range(0), "--lease": Range(0, low_open=True),
}
"""The range of every numeric option of the three front ends (not a job setting), by flag; ``check_options``."""


def check_options(values: Mapping[str, Any], ranges: Mapping[str, Range] | None = None) -> None:
    """``UsageError`` (one line) for the first ``--flag value`` of ``values`` (flag → value; None: not given) outside
    its range (``OPTIONS``, or ``ranges`` for a front end's own, such as the server's ``--port`` that takes 0)."""
    for flag, value in values.items():
        allowed = (ranges or {}).get(flag) or OPTIONS[flag]
        if value is None:
            continue
        number = not isinstance(value, bool) and isinstance(value, int if allowed.integer else (int, float))
        if not number or not math.isfinite(value) or not allowed.contains(value):
            raise UsageError(f"{flag} {value} is not {allowed.describe()}")


# -- the job -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobImage:
    """One image of a job: its source (a path, a PIL image or an array), what outputs and records call it, its
    seed and its field of view (None: the config's, else estimated)."""

    source: Any
    name: str
    seed: int
    fov: float | None = None


@dataclass(frozen=True)
class ParallelAsk:
    """The parallel layout the command was asked for (``--parallel`` and its knobs), as given; ``pipelines.launch``
    checks it against torchrun's environment."""

    mode: str = "none"
    pp: int | None = None
    pp_split: str | tuple[int, ...] | None = None
    patches: int | None = None
    warmup: int | None = None
    data_groups: int | None = None
    timeout_s: float = 600.0

    def knobs(self) -> list[str]:
        """The PipeFusion options given, as flags."""
        return [f"--{k.replace('_', '-')}" for k in ("pp", "pp_split", "patches", "warmup")
                if getattr(self, k) is not None]


@dataclass(frozen=True)
class Job:
    """One job: the config (with the job's export settings), its settings (``SETTINGS``), the plan's device and
    parallel layout, its images, and where its results go (the command's outputs; the app and the server choose
    theirs). Build it with ``from_args``, ``from_request`` or ``from_form``; every value is checked then."""

    config: CascadeConfig
    seed: int
    fov: float | None = None
    num_views: int | None = None
    memory_policy: str = "auto"
    memory_budget: Budget | None = None
    preset: str | None = None
    texture_size: int | None = None
    face_budget: int | None = None
    texture_format: str | None = None
    compression: str | None = None
    shape_only: bool = False               # stop after the shape decode: an untextured GLB (docs/shape-first.md)
    mesh_pose: str | None = None           # --mesh: aligned (None: the default) or estimate
    mesh: Path | None = None               # --mesh: the mesh every image of the job textures
    device: str | None = None
    parallel: ParallelAsk = field(default_factory=ParallelAsk)
    images: tuple[JobImage, ...] = ()
    inputs: tuple[Path, ...] = ()          # the command's paths as given (files or folders, or views folders on a
                                           # multi-view config): their kind's ``expand``
    input_kind: str | None = None          # the kind of input (``pipelines.inputs``; None: the one the config takes)
    output: Path | None = None             # -o: one .glb, or a folder
    keep_latents: Path | None = None
    trace: Path | None = None
    work_dir: Path | None = None
    order: str | None = None               # --batch-order (None: the policy's)
    plan_only: bool = False                # --plan
    quiet: bool = False
    command: tuple[str, ...] = ()          # run.json's ``command``: the front end as typed

    # -- adapters ----------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Any, *, command: Sequence[str] = ()) -> Job:
        """The command's parsed options (``pipelines.cli_args``): the config read, every value checked
        (``SettingError`` naming the setting, ``UsageError`` for an option out of range, ``ConfigError``)."""
        given = {kind.name: tuple(getattr(args, kind.name) or ()) for kind in inputs.flagged()}
        given["image"] = tuple(args.inputs)
        config = load_config(args.config if args.config is not None else
                             shipped_config(inputs.given_kind(given).default_config))
        kind = inputs.command_kind(config, given)
        check_options({"--pp": args.pp, "--patches": args.patches, "--warmup": args.warmup,
                       "--data-groups": args.data_groups, "--parallel-timeout": args.parallel_timeout})
        parallel = ParallelAsk(args.parallel, args.pp, parse_pp_split(args.pp_split), args.patches, args.warmup,
                               args.data_groups, args.parallel_timeout)
        return cls.build(config, {s.name: getattr(args, s.name) for s in SETTINGS}, device=args.device,
                         parallel=parallel, inputs=tuple(kind.command_inputs(given)), input_kind=kind.name,
                         mesh=next(iter(given.get("mesh") or ()), None), output=args.output,
                         keep_latents=args.keep_latents, trace=args.trace, work_dir=args.work_dir,
                         order=args.batch_order, plan_only=args.plan, quiet=args.quiet, command=tuple(command))

    @classmethod
    def from_request(cls, settings: str | Mapping[str, Any] | None, config: CascadeConfig, **fields: Any) -> Job:
        """The job server's ``settings`` (JSON text or its object; None or empty: every default) against its
        ``config``. ``SettingsError`` names the key: unknown, of the wrong type, or out of range."""
        raw = _json_object(settings)
        for alias, name in ALIASES.items():
            if alias in raw:
                if name in raw:
                    raise SettingsError(f"settings give both {alias} and {name} (the same setting); send one")
                raw[name] = raw.pop(alias)
        unknown = sorted(set(raw) - set(BY_NAME))
        if unknown:
            raise SettingsError(f"unknown settings {unknown}; accepted: {sorted([*BY_NAME, *ALIASES])}")
        for name, value in raw.items():
            kinds = BY_NAME[name].types()
            flag = BY_NAME[name].kind == "flag"
            if value is not None and (isinstance(value, bool) != flag or not isinstance(value, kinds)):
                raise SettingsError(f"settings.{name} must be {' or '.join(t.__name__ for t in kinds)} (or null), "
                                    f"not {json.dumps(value)}")
        try:
            return cls.build(config, raw, **fields)
        except SettingError as err:
            raise SettingsError(f"settings{_refused(err, config, key=True)}") from None

    @classmethod
    def from_form(cls, values: Mapping[str, Any], config: CascadeConfig, **fields: Any) -> Job:
        """The web app's form (setting name → the field's value; an empty field or None: unset) against its
        ``config``. ``SettingsError`` in the form's words."""
        given = {}
        for name, value in values.items():
            setting = BY_NAME[name]
            if value is None or (isinstance(value, str) and not value.strip()):
                continue
            given[name] = _form_value(setting, value)
        try:
            return cls.build(config, given, **fields)
        except SettingError as err:
            raise SettingsError(_refused(err, config).removeprefix(": ")) from None

    @classmethod
    def build(cls, config: CascadeConfig, settings: Mapping[str, Any], **fields: Any) -> Job:
        """The job for ``settings`` (name → value; absent or None: the default) over ``config``: each value checked
        (``SettingError``), the export settings applied to the config (checked by ``ExportSettings``)."""
        kind = inputs.kind_named(config, fields.get("input_kind"))
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            value = settings.get(setting.name)
            if value is not None and not setting.applies_to(kind):
                raise SettingError(setting.name, kind.refuse_setting(setting.name))
            if value is None:
                value = setting.config(config) if setting.config and not setting.export else setting.default
            if value is not None and setting.check is not None:
                value = setting.check(value)
            values[setting.name] = value
        check_shape_only(values, settings)
        if values.get("mesh_pose") == "estimate" and (values.get("fov") is not None or config.camera.fov_deg):
            raise SettingError("mesh_pose", "mesh pose estimate registers MoGe-2's points of the image to the mesh, "
                                            "and a field of view given skips MoGe-2: drop the field of view, or use "
                                            "the pose aligned")
        return cls(config=with_export(config, values), **values, **fields)

    # -- what it says -----------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Every setting under its JSON key (the budget as given): what job.json, ``GET /jobs/{id}`` and run.json's
        front-end entry show, and what ``from_request`` takes back."""
        return {s.name: self.wire_value(s) for s in SETTINGS if s.applies_to(self.kind)}

    def wire_value(self, setting: Setting) -> Any:
        value = getattr(self, setting.name)
        return value.text if isinstance(value, Budget) else value

    def plan_key(self) -> str:
        """What jobs must share to run as one batch (``plan_key``)."""
        return plan_key(self.settings())

    @property
    def budget(self) -> int | str | None:
        """The memory budget as ``Pixal3D.plan`` takes it."""
        return None if self.memory_budget is None else self.memory_budget.value

    def image(self, source: Any, name: str, *, seed: int | None = None) -> JobImage:
        """An image of this job: its seed (default the job's) and the job's field of view."""
        return JobImage(source, name, self.seed if seed is None else check_seed(seed), self.fov)

    def with_images(self, images: Sequence[JobImage]) -> Job:
        return dataclasses.replace(self, images=tuple(images))

    @property
    def kind(self) -> InputKind:
        """The kind of input the job runs (``pipelines.inputs``)."""
        return inputs.kind_named(self.config, self.input_kind)

    @property
    def several(self) -> bool:
        """The command was given several inputs or a folder of images: a batch, with a summary."""
        return self.kind.several(self.inputs)


def _refused(err: SettingError, config: CascadeConfig, *, key: bool = False) -> str:
    """A refused setting's words after ``settings`` (a request, ``key``) or for a form: a value out of range with
    what unset means; one that does not apply to this kind of input (``InputKind.refuse_setting``) by its name."""
    setting = BY_NAME.get(err.setting)
    if setting is not None and not setting.applies_to(inputs.kind_for(config)):
        return f".{err.setting}: {err}" if key else f": {err.setting}: {err}"
    return f": {err}{setting.automatic if setting is not None else ''}"


TEXTURE_SETTINGS = ("texture_size", "texture_format")
"""The settings that shape only the texture: a shape-only job makes none, so it refuses them."""


def check_shape_only(values: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Refuse (``SettingError`` naming the texture setting) a shape-only job given a texture setting: it makes no
    texture, so the setting would be silently ignored. Every other setting holds for the shape alike."""
    if not values.get("shape_only"):
        return
    for name in TEXTURE_SETTINGS:
        if given.get(name) is not None:
            raise SettingError(name, f"{BY_NAME[name].label} sets the texture, and a shape-only job makes none: "
                                     f"drop one of them")


def plan_key(settings: Mapping[str, Any], batch: Mapping[str, str] | None = None) -> str:
    """What jobs must share to run as one batch, from their ``Job.settings()``: every setting but the seed (each
    image has its own generator), and ``batch`` when given: a job of a kind other than the config's own, its kind
    and what a batch of it shares (``{"input_kind": "mesh", "mesh": <its sha256>, "mesh_name": ...}``: ``batch_key``)."""
    key = {k: v for k, v in settings.items() if k != "seed"}
    if batch:
        key["input"] = dict(batch)
    return json.dumps(key, sort_keys=True)


def with_export(config: CascadeConfig, values: Mapping[str, Any]) -> CascadeConfig:
    """``config`` with the export settings among ``values`` (None: the config's), checked by ``ExportSettings``
    (a ``SettingError`` naming the setting)."""
    changes = {s.export: values[s.name] for s in SETTINGS if s.export is not None and values.get(s.name) is not None}
    preset = preset_changes(values.get("preset"))  # a preset's fields first: a setting given beside it wins
    if not changes and not preset:
        return config
    try:
        base = dataclasses.replace(config.export, **preset)
    except (TypeError, ValueError) as err:
        raise SettingError("preset", f"preset {values.get('preset')!r} does not apply to this config: {err}") from None
    for setting in SETTINGS:
        if setting.export in changes:
            try:
                dataclasses.replace(base, **{setting.export: changes[setting.export]})
            except (TypeError, ValueError) as err:
                said = str(err) if setting.export == setting.name else f"{setting.name}: {err}"  # names the key
                raise SettingError(setting.name, said) from None
    return config.with_overrides(export=dataclasses.replace(base, **changes))


def _json_object(settings: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if settings is None or (isinstance(settings, str) and not settings.strip()):
        return {}
    if isinstance(settings, str):
        try:
            settings = json.loads(settings)
        except ValueError as err:
            raise SettingsError(f"settings is not JSON ({err}); send an object such as {{\"seed\": 42}}") from None
    if not isinstance(settings, Mapping):
        raise SettingsError(f"settings must be a JSON object, not {type(settings).__name__}; e.g. {{\"seed\": 42}}")
    return dict(settings)


def _form_value(setting: Setting, value: Any) -> Any:
    """A form field's value as the setting's kind (a number field gives floats; a dropdown may give strings)."""
    try:
        if setting.kind == "int":
            number = float(value)
            if not number.is_integer():
                raise ValueError
            return int(number)
        if setting.kind == "float":
            return float(value)
    except (TypeError, ValueError, OverflowError):
        noun = "a whole number" if setting.kind == "int" else "a number"
        raise SettingsError(f"{setting.label} {value!r} is not {noun}") from None
    return value.strip() if isinstance(value, str) else value


# -- the command's parallel layout -----------------------------------------------------------------
def parse_pp_split(text: str | None) -> str | tuple[int, ...] | None:
    """``--pp-split``: ``auto`` or comma-separated block counts (``1,3``)."""
    if text is None or text == "auto":
        return text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--pp-split {text!r} is neither auto nor block counts such as 1,3") from None

