"""Typed cascade configuration read from YAML: frozen dataclasses, strict keys, strict types.

A config file describes one cascade: where every model's weights come from (``weights``), the
parameters of each stage, and the export settings. ``load_config(path)`` reads it; a key the
dataclasses do not declare, a missing required key, or a value of the wrong type is a
``ConfigError`` that names the key (dotted path) and the file. A number outside the
``Range`` its field declares (``field(metadata=...)`` beside the field, below) is a ``ConfigError`` too,
from a file or from ``with_overrides``. A file may start from another one with ``base: other.yaml``
(path relative to the file) and override only some keys; mappings are merged key by key (a weight
source under ``weights`` is replaced whole), everything else is replaced.

The shipped configs live in the package (``pixal3d/configs`` when installed, ``configs/`` in a checkout):
a bare name that is not a file here — ``load_config("tiny")``, ``base: 1024_cascade.yaml`` — means one of
them, so an installed package finds its default config and a user's config can start from a shipped one.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pixal3d.mesh.settings import ExportSettings
from pixal3d.shipped import CHECKOUT, SHIPPED, shipped_config  # noqa: F401 -- re-exported


class ConfigError(ValueError):
    """A configuration file is invalid (unknown key, wrong type, value out of range, bad combination)."""


class UsageError(ValueError):
    """Bad inputs, outputs or options of a front end (the command line, a batch, a web request). Defined here, below
    every front end, so that the library's error classification (``pipelines.errors``) names it without importing
    one."""


class SettingError(ValueError):
    """A value given for one setting of a run cannot be used. ``setting`` is its library name (the keyword:
    ``seed``, ``fov``, ``memory_budget``, ...), so a front end can name it its own way (the command: a flag)."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


# -- declared ranges -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """The values a number field accepts, declared on the field with ``ranged(...)``.

    low/high: bounds (``None``: unbounded); ``*_open``: the bound itself is excluded; ``integer``: the
    field is an int (for the wording); ``high_text``: how to write ``high`` in messages.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    high_text: str | None = None

    def contains(self, value: float) -> bool:
        """Whether ``value`` is inside the range."""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """``an integer in [0, 2**64 - 1]``, ``an integer >= 1``, ``a number in (0, 180)``, ..."""
        noun = "an integer" if self.integer else "a number"
        low = _number(self.low)
        high = self.high_text or _number(self.high)
        if self.high is None:
            return f"{noun} {'>' if self.low_open else '>='} {low}"
        if self.low is None:
            return f"{noun} {'<' if self.high_open else '<='} {high}"
        return f"{noun} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


SEED = Range(0, 2**64 - 1, integer=True, high_text="2**64 - 1")
"""The seeds a ``torch.Generator`` accepts."""
FOV = Range(0.0, 180.0, low_open=True, high_open=True)
"""A field of view in degrees: the one rule of the config's ``camera.fov_deg``, the camera stage, the library, the
command, the web app and the job server (``check_fov``)."""
COUNT = Range(1, integer=True)
"""Sizes, channels, steps, token budgets: at least 1."""


def check_seed(seed: Any) -> int:
    """``seed`` as an int a ``torch.Generator`` accepts, or a ``SettingError`` saying the range (``SEED``)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED.contains(seed):
        raise SettingError("seed", f"seed {seed!r} is not {SEED.describe()}; use e.g. 42")
    return seed


def check_fov(fov: Any) -> None:
    """A ``SettingError`` unless ``fov`` is None or a field of view in degrees (``FOV``)."""
    if fov is not None and not (isinstance(fov, (int, float)) and not isinstance(fov, bool) and math.isfinite(fov)
                                and FOV.contains(fov)):
        raise SettingError("fov", f"field of view {fov} is not in (0, 180) degrees; use e.g. fov=49")


def ranged(allowed: Range, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose values must lie in ``allowed`` (checked by ``from_dict`` and ``with_overrides``)."""
    return field(default=default, metadata={"range": allowed})


def check_ranges(value: Any, *, where: str, key: str, allowed: Range | None = None) -> None:
    """``ConfigError`` when ``value`` is outside ``allowed`` or, for a dataclass, any field under it is outside
    the range that field declares; the message names the dotted ``key`` and starts with ``where``."""
    _check_range(value, allowed, where=where, key=key)
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            check_ranges(getattr(value, f.name), where=where, key=_join(key, f.name), allowed=f.metadata.get("range"))


def _check_range(value: Any, allowed: Range | None, *, where: str, key: str) -> None:
    if allowed is None or value is None:
        return
    number = not isinstance(value, bool) and isinstance(value, int if allowed.integer else (int, float))
    if not number or not math.isfinite(value) or not allowed.contains(value):
        raise ConfigError(f"{where}: key '{key}' must be {allowed.describe()}, got {value!r}")


def declared_ranges(cls: type, prefix: str = "") -> dict[str, Range]:
    """Every ``Range`` declared under dataclass ``cls``, by dotted key."""
    ranges: dict[str, Range] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        if "range" in f.metadata:
            ranges[key] = f.metadata["range"]
        for option in (typing.get_args(hints[f.name]) or (hints[f.name],)):
            if dataclasses.is_dataclass(option):
                ranges.update(declared_ranges(option, key))
    return ranges


# -- weights -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightSource:
    """Where one group of files comes from. Exactly one of ``repo``, ``local``, ``url``, ``generate``.

    repo:     Hugging Face repo id, downloaded with ``snapshot_download`` at the pinned ``revision``
    local:    a folder on disk (relative paths are relative to the config file)
    url:      one file over HTTPS (``filename`` in the cache, checked against ``sha256``)
    generate: ``tiny`` (or ``tiny-mv``, the multi-view demo's denoisers): deterministic demo weights written by
              ``scripts/make_tiny_weights.py``
    files:    the files (glob patterns) this source must provide, beyond those derived from
              ``pipeline.json``
    """

    repo: str | None = None
    revision: str | None = None
    local: str | None = None
    url: str | None = None
    filename: str | None = None
    sha256: str | None = None
    generate: str | None = None
    files: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """``repo``, ``local``, ``url`` or ``generate``."""
        return next(k for k in ("repo", "local", "url", "generate") if getattr(self, k) is not None)

    def describe(self) -> str:
        """A short human-readable origin, e.g. ``TencentARC/Pixal3D@b0cb2e1``."""
        if self.repo is not None:
            return f"{self.repo}@{self.revision}" if self.revision else self.repo
        if self.local is not None:
            return f"folder {self.local}"
        if self.url is not None:
            return self.url
        return f"generated ({self.generate})"


@dataclass(frozen=True)
class WeightsConfig:
    """The weight sources of a cascade.

    pixal3d: ``pipeline.json`` + ``ckpts/*`` (the seven flow/decoder checkpoints, normalization)
    dinov3:  the DINOv3 backbone folder (``config.json`` + ``model.safetensors``)
    naf:     the NAF upsampler weights (one file)
    rembg:   the ``rembg`` model name for opaque inputs (``None``: inputs must carry an alpha channel)
    moge:    MoGe-2 (only used when no field of view is given); ``None`` = not configured
    shape_encoder: TRELLIS.2's shape encoder (only used to texture a given mesh); ``None`` = not configured
    pipeline_json: the file in ``pixal3d`` that names the checkpoints and the normalization
             (``pipeline_mv.json``: upstream's multi-view denoisers, ``ckpts/*_mv``)
    """

    pixal3d: WeightSource
    dinov3: WeightSource
    naf: WeightSource
    rembg: str | None = "birefnet-general"
    moge: WeightSource | None = None
    shape_encoder: WeightSource | None = None
    pipeline_json: str = "pipeline.json"


# -- stages --------------------------------------------------------------------------------------

DEFAULT_SIGMA_MIN = 1e-5  # FlowEulerGuidanceIntervalSampler(sigma_min=1e-5): every published pipeline.json's


@dataclass(frozen=True)
class SamplerConfig:
    """Flow-matching Euler sampler parameters (reference §4).

    ``steps``, ``guidance_strength``, ``guidance_rescale`` and ``rescale_t`` are the reference's explicit
    arguments (they override ``pipeline.json``). ``guidance_interval`` comes from the checkpoint folder's
    ``pipeline.json`` as in the reference unless the config sets it; so does ``sigma_min`` unless the config
    changes it from the sampler's default (``pixal3d.pipeline_json.resolve_samplers``; a difference between
    the two is logged once).
    """

    steps: int = ranged(COUNT)
    guidance_strength: float = ranged(Range(0.0))
    guidance_rescale: float = ranged(Range(0.0, 1.0))
    rescale_t: float = ranged(Range(0.0, low_open=True))
    guidance_interval: tuple[float, float] | None = None  # [lo, hi] with 0 <= lo <= hi <= 1 (_check_config)
    sigma_min: float = ranged(Range(0.0, 1.0, high_open=True), DEFAULT_SIGMA_MIN)


@dataclass(frozen=True)
class ConditionConfig:
    """One DINOv3 projection extractor: backbone input size, projection grid, NAF target size."""

    image_size: int = ranged(Range(16, integer=True))  # at least one DINOv3 patch
    grid_resolution: int | None = ranged(COUNT, None)  # None: the stage's token grid
    naf_size: int | None = ranged(COUNT, None)         # None: no NAF branch (sparse structure)
    naf_mode: str = "auto"  # full (the reference's values), frugal (less memory, ~1e-7 off) or auto (the plan picks)


MOGE_PRECISIONS = ("auto", "float16", "float32")


@dataclass(frozen=True)
class CameraConfig:
    """Field of view in degrees (``None``: estimate with MoGe-2, or fall back to the reference default).

    ``moge_precision``: ``float16`` runs MoGe-2's forward under float16 autocast (its ``infer`` default and the
    reference's, on its GPUs), ``float32`` without; ``auto`` (default) is float16 on CUDA and MPS and float32 on
    the CPU, whose float16 convolutions and matrix products are emulated (28 times slower at real width,
    benchmarks/camera.md). Only the last digits of the field of view differ (about 1e-4 rad).
    """

    fov_deg: float | None = ranged(FOV, None)
    moge_precision: str = "auto"


@dataclass(frozen=True)
class StructureConfig:
    """Sparse structure: dense noise ``[1, latent_channels, R, R, R]`` → decoder → max-pool to coords."""

    noise_resolution: int = ranged(COUNT)
    latent_channels: int = ranged(COUNT)
    coords_resolution: int = ranged(COUNT)
    sampler: SamplerConfig
    condition: ConditionConfig


@dataclass(frozen=True)
class ShapeConfig:
    """A sparse shape or texture flow stage: noise ``[N, latent_channels]`` on the stage's coords."""

    latent_channels: int = ranged(COUNT)
    sampler: SamplerConfig
    condition: ConditionConfig


@dataclass(frozen=True)
class UpsampleConfig:
    """Cascade LR→HR coords: decoder upsample ×2^times, quantize to the HR token grid, token budget.

    The HR token grid is ``hr_resolution // 2**times``; while the HR token count is at least
    ``max_tokens`` and the resolution is above ``min_resolution``, the resolution drops by
    ``resolution_step`` (reference §1.6, §1.12).
    """

    times: int = ranged(Range(0, integer=True))
    hr_resolution: int = ranged(COUNT)
    max_tokens: int = ranged(COUNT, 49152)
    resolution_step: int = ranged(COUNT, 128)
    min_resolution: int = ranged(COUNT, 1024)


@dataclass(frozen=True)
class ViewsConfig:
    """A cascade that takes posed views (a folder with a ``transforms.json``, as upstream's ``inference_mv.py``)
    instead of one image: no crop, no camera estimate, the views' features averaged in the projection grid.

    ``plan_views``: the number of views the memory plan counts before any input is read (the reference rig has
    4); a run with more views than this is told so in its plan reasons.
    """

    plan_views: int = ranged(COUNT, 4)


GENERATED = ("tiny", "tiny-mv")
"""The generated weight kinds (``WeightSource.generate``)."""

ATTENTION_ROUTES = ("auto", "sdpa", "fp32_chunked")  # pixal3d.nn.attention.ROUTES (a test keeps them equal)
CPU_WEIGHTS = ("mapped", "copied")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the kernels run, not what they compute (reference-equal up to rounding).

    ``attention``: ``auto`` (fp32 softmax in bounded query chunks on Apple Silicon, fused SDPA elsewhere),
    ``sdpa`` or ``fp32_chunked`` (``pixal3d.nn.attention``).
    ``cpu_weights``: on the CPU, ``mapped`` (loaded weights are pages of the memory-mapped checkpoints: no copy,
    and the kernel may drop and read them again) or ``copied`` (every load, and every streamed block, copied into
    process memory as onto a device: what a GPU or a Mac pays, for measurements). Other devices always copy.
    """

    attention: str = "auto"
    cpu_weights: str = "mapped"


@dataclass(frozen=True)
class CascadeConfig:
    """A whole cascade: weights, seed, per-stage parameters, export."""

    name: str
    weights: WeightsConfig
    structure: StructureConfig
    shape_512: ShapeConfig
    upsample: UpsampleConfig
    shape_1024: ShapeConfig
    texture: ShapeConfig
    seed: int = ranged(SEED, 42)
    views: ViewsConfig | None = None  # set: the cascade takes posed views, not images
    camera: CameraConfig = field(default_factory=CameraConfig)
    export: ExportSettings = field(default_factory=ExportSettings)  # pixal3d.mesh.settings, checked there
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    source: str = ""  # the file it was read from (set by load_config, not a YAML key)

    def with_overrides(self, *, where: str = "overrides", **changes: Any) -> CascadeConfig:
        """A copy with top-level fields replaced (``dataclasses.replace``), checked like a file's values;
        ``where`` starts the message of a ``ConfigError`` (e.g. the command-line option)."""
        config = dataclasses.replace(self, **changes)
        declared = {f.name: f.metadata.get("range") for f in dataclasses.fields(self)}
        for name in changes:
            check_ranges(getattr(config, name), where=where, key=name, allowed=declared[name])
        _check_config(config, where)
        return config


# -- reading -------------------------------------------------------------------------------------

def shipped_config_names() -> list[str]:
    """The names of the shipped configs."""
    return sorted(p.name for p in shipped_config("x").parent.glob("*.yaml"))


def _locate(path: Path) -> Path:
    """``path``, or the shipped config it names when it is a bare name that is not a file here."""
    if path.is_file() or len(path.parts) != 1:
        return path
    shipped = shipped_config(path.name)
    return shipped if shipped.is_file() else path


def load_config(path: str | Path) -> CascadeConfig:
    """Read and validate a cascade YAML file (following ``base:`` chains); a bare name that is not a file
    here (``tiny``, ``1024_cascade.yaml``) is a shipped config."""
    path = _locate(Path(path))
    raw = _read_merged(path, seen=())
    raw = _absolutize_local_paths(raw, path)
    config = from_dict(CascadeConfig, raw, where=str(path), exclude=("source",))
    _check_config(config, str(path))
    return dataclasses.replace(config, source=str(path))


def _read_merged(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        what = "is a folder, not a config file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {what} (the shipped configs, which can be named alone: "
                          f"{', '.join(shipped_config_names())})")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to {path}")
    try:
        data = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: key 'base' must be a file name (str), got {type(base).__name__}")
    base_path = _locate_base(path.parent, base)
    parent = _read_merged(base_path, seen + (path.resolve(),))
    parent = _absolutize_local_paths(parent, base_path)
    return _deep_merge(parent, data)


def _locate_base(folder: Path, base: str) -> Path:
    """``base`` beside the file that names it, else (a bare name) the shipped config of that name."""
    beside = folder / base
    if beside.is_file() or len(Path(base).parts) != 1:
        return beside
    shipped = shipped_config(base)
    return shipped if shipped.is_file() else beside


def _read_text(path: Path) -> str:
    """The file as UTF-8 text, or a ``ConfigError`` saying what else it is."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read ({err.strerror or err})") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or _ascii_as_utf16(data[:2]):
        raise ConfigError(f"{path} is UTF-16 text; config files are UTF-8 (re-save it as UTF-8, e.g. "
                          f"iconv -f UTF-16 -t UTF-8)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); a config "
                          f"is a YAML file saved as UTF-8") from None


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """Merge ``over`` into ``base`` key by key; a weight source (``weights.<name>``) is replaced whole."""
    merged = dict(base)
    for key, value in over.items():
        atomic = path == ("weights",)
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping) and not atomic:
            merged[key] = _deep_merge(dict(merged[key]), value, path + (key,))
        else:
            merged[key] = value
    return merged


def _absolutize_local_paths(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """``weights.*.local``: ``~`` expanded, relative paths taken from the config file's folder."""
    weights = raw.get("weights")
    if not isinstance(weights, Mapping):
        return raw
    fixed = dict(weights)
    for name, src in weights.items():
        if isinstance(src, Mapping) and isinstance(src.get("local"), str):
            local = Path(src["local"]).expanduser()
            fixed[name] = {**src, "local": str(local if local.is_absolute() else (path.parent / local).resolve())}
    return {**raw, "weights": fixed}


def from_dict(cls: type, data: Any, *, where: str, key: str = "", exclude: tuple[str, ...] = ()) -> Any:
    """Build dataclass ``cls`` from plain data, checking every key and type; errors name ``key`` and ``where``."""
    label = key or "the top level"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: {label} must be a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in exclude}
    unknown = [k for k in data if k not in fields]
    if unknown:
        path = _join(key, str(unknown[0]))
        raise ConfigError(f"{where}: unknown key '{path}' (known keys{' under ' + key if key else ''}: "
                          f"{', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        sub = _join(key, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], where=where, key=sub)
            _check_range(kwargs[name], f.metadata.get("range"), where=where, key=sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key '{sub}'")
    try:
        return cls(**kwargs)
    except ValueError as err:  # a dataclass that checks its own values (e.g. ExportSettings)
        raise ConfigError(f"{where}: key '{label}' is invalid: {err}") from None


def _convert(hint: Any, value: Any, *, where: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, where=where, key=key)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else ConfigError(
            f"{where}: key '{key}' must be {_hint_name(hint)}, got {_describe(value)}")
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where=where, key=key)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: key '{key}' must be a list ({_hint_name(hint)}), got {_describe(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, where=where, key=f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}: key '{key}' must have {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, where=where, key=f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: key '{key}' must be true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: key '{key}' must be an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: key '{key}' must be a finite number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: key '{key}' must be a string, got {_describe(value)}")
        return value
    raise TypeError(f"config field {key} has an unsupported type {hint!r}")  # a programming error


def _check_config(config: CascadeConfig, where: str) -> None:
    """Rules that span several keys."""
    for name in (f.name for f in dataclasses.fields(WeightsConfig)):  # every source, whatever it serves
        src = getattr(config.weights, name)
        if not isinstance(src, WeightSource):
            continue
        set_ = [k for k in ("repo", "local", "url", "generate") if getattr(src, k) is not None]
        if len(set_) != 1:
            raise ConfigError(f"{where}: key 'weights.{name}' needs exactly one of repo, local, url, generate; "
                              f"got {set_ or 'none'}")
        if src.url is not None and not src.filename:
            raise ConfigError(f"{where}: key 'weights.{name}.filename' is required with 'url'")
        if src.generate is not None and src.generate not in GENERATED:
            raise ConfigError(f"{where}: key 'weights.{name}.generate' must be {' or '.join(GENERATED)}, "
                              f"got {src.generate!r}")
    pipeline_json = config.weights.pipeline_json
    if not pipeline_json.endswith(".json") or "/" in pipeline_json or "\\" in pipeline_json:
        raise ConfigError(f"{where}: key 'weights.pipeline_json' must be a .json file name in weights.pixal3d "
                          f"(pipeline.json, pipeline_mv.json), got {pipeline_json!r}")
    for stage in ("structure", "shape_512", "shape_1024", "texture"):
        sampler = getattr(config, stage).sampler
        if sampler.guidance_interval is not None:
            lo, hi = sampler.guidance_interval
            if not 0.0 <= lo <= hi <= 1.0:
                raise ConfigError(f"{where}: key '{stage}.sampler.guidance_interval' must be [lo, hi] with "
                                  f"0 <= lo <= hi <= 1, got {list(sampler.guidance_interval)}")
        mode = getattr(config, stage).condition.naf_mode
        if mode not in ("auto", "full", "frugal"):
            raise ConfigError(f"{where}: key '{stage}.condition.naf_mode' must be auto, full or frugal, got {mode!r}")
    if config.camera.moge_precision not in MOGE_PRECISIONS:
        raise ConfigError(f"{where}: key 'camera.moge_precision' must be {', '.join(MOGE_PRECISIONS)}, "
                          f"got {config.camera.moge_precision!r}")
    if config.runtime.attention not in ATTENTION_ROUTES:
        raise ConfigError(f"{where}: key 'runtime.attention' must be {', '.join(ATTENTION_ROUTES)}, "
                          f"got {config.runtime.attention!r}")
    if config.runtime.cpu_weights not in CPU_WEIGHTS:
        raise ConfigError(f"{where}: key 'runtime.cpu_weights' must be {', '.join(CPU_WEIGHTS)}, "
                          f"got {config.runtime.cpu_weights!r}")
    up = config.upsample
    factor = 2 ** up.times
    if up.hr_resolution % factor or up.min_resolution % factor or up.resolution_step % factor:
        raise ConfigError(f"{where}: keys 'upsample.hr_resolution' ({up.hr_resolution}), 'min_resolution' "
                          f"({up.min_resolution}) and 'resolution_step' ({up.resolution_step}) must be "
                          f"multiples of 2**upsample.times = {factor}")
    if up.min_resolution > up.hr_resolution:
        raise ConfigError(f"{where}: key 'upsample.min_resolution' ({up.min_resolution}) exceeds "
                          f"'upsample.hr_resolution' ({up.hr_resolution})")


def with_sampler_steps(config: CascadeConfig, steps: int) -> CascadeConfig:
    """A copy with every flow stage's sampler set to ``steps`` steps (benchmarks, smoke tests)."""
    changes = {}
    for stage in ("structure", "shape_512", "shape_1024", "texture"):
        cfg = getattr(config, stage)
        changes[stage] = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, steps=steps))
    return dataclasses.replace(config, **changes)


def to_dict(config: Any) -> Any:
    """Plain data (lists for tuples) for ``run.json``."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (tuple, list)):
        return [to_dict(v) for v in config]
    return config


def _ascii_as_utf16(head: bytes) -> bool:
    """The first character is printable ASCII stored in two bytes (UTF-16 without a byte-order mark)."""
    return len(head) == 2 and any(head[i] == 0 and 32 <= head[1 - i] < 127 for i in (0, 1))


def _number(value: float | None) -> str:
    return "" if value is None else (str(int(value)) if float(value).is_integer() else str(value))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
