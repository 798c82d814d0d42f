"""Typed cascade configuration read from YAML: frozen dataclasses, strict keys, strict types.

A config file describes one cascade: where every model's weights come from (``weights``), the
parameters of each stage, and the export settings. ``load_config(path)`` reads it; a key the
dataclasses do not declare, a missing required key, or a value of the wrong type is a
``ConfigError`` that names the key (dotted path) and the file. A file may start from another one
with ``base: other.yaml`` (path relative to the file) and override only some keys; mappings are
merged key by key (a weight source under ``weights`` is replaced whole), everything else is replaced.
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

from pixal3d.mesh.export import ExportSettings


class ConfigError(ValueError):
    """A configuration file is invalid (unknown key, wrong type, missing value, bad combination)."""


# -- weights -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightSource:
    """Where one group of files comes from. Exactly one of ``repo``, ``local``, ``url``, ``generate``.

    repo:     Hugging Face repo id, downloaded with ``snapshot_download`` at the pinned ``revision``
    local:    a folder on disk (relative paths are relative to the config file)
    url:      one file over HTTPS (``filename`` in the cache, checked against ``sha256``)
    generate: ``tiny``: deterministic demo weights written by ``scripts/make_tiny_weights.py``
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
    """

    pixal3d: WeightSource
    dinov3: WeightSource
    naf: WeightSource
    rembg: str | None = "birefnet-general"
    moge: WeightSource | None = None


# -- stages --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplerConfig:
    """Flow-matching Euler sampler parameters (reference §4)."""

    steps: int
    guidance_strength: float
    guidance_rescale: float
    guidance_interval: tuple[float, float]
    rescale_t: float
    sigma_min: float = 1e-5


@dataclass(frozen=True)
class ConditionConfig:
    """One DINOv3 projection extractor: backbone input size, projection grid, NAF target size."""

    image_size: int
    grid_resolution: int | None = None   # None: the stage's token grid
    naf_size: int | None = None          # None: no NAF branch (sparse structure)


@dataclass(frozen=True)
class CameraConfig:
    """Field of view in degrees (``None``: estimate with MoGe-2, or fall back to the reference default)."""

    fov_deg: float | None = None


@dataclass(frozen=True)
class StructureConfig:
    """Sparse structure: dense noise ``[1, latent_channels, R, R, R]`` → decoder → max-pool to coords."""

    noise_resolution: int
    latent_channels: int
    coords_resolution: int
    sampler: SamplerConfig
    condition: ConditionConfig


@dataclass(frozen=True)
class ShapeConfig:
    """A sparse shape or texture flow stage: noise ``[N, latent_channels]`` on the stage's coords."""

    latent_channels: int
    sampler: SamplerConfig
    condition: ConditionConfig


@dataclass(frozen=True)
class UpsampleConfig:
    """Cascade LR→HR coords: decoder upsample ×2^times, quantize to the HR token grid, token budget.

    The HR token grid is ``hr_resolution // 2**times``; while the HR token count is at least
    ``max_tokens`` and the resolution is above ``min_resolution``, the resolution drops by
    ``resolution_step`` (reference §1.6, §1.12).
    """

    times: int
    hr_resolution: int
    max_tokens: int = 49152
    resolution_step: int = 128
    min_resolution: int = 1024


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
    seed: int = 42
    camera: CameraConfig = field(default_factory=CameraConfig)
    export: ExportSettings = field(default_factory=ExportSettings)  # pixal3d.mesh.export, checked there
    source: str = ""  # the file it was read from (set by load_config, not a YAML key)

    def with_overrides(self, **changes: Any) -> CascadeConfig:
        """A copy with top-level fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


# -- reading -------------------------------------------------------------------------------------

def load_config(path: str | Path) -> CascadeConfig:
    """Read and validate a cascade YAML file (following ``base:`` chains)."""
    path = Path(path)
    raw = _read_merged(path, seen=())
    raw = _absolutize_local_paths(raw, path)
    config = from_dict(CascadeConfig, raw, where=str(path), exclude=("source",))
    _check_config(config, str(path))
    return dataclasses.replace(config, source=str(path))


def _read_merged(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (try configs/1024_cascade.yaml or configs/tiny.yaml)")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: key 'base' must be a file name (str), got {type(base).__name__}")
    parent = _read_merged(path.parent / base, seen + (path.resolve(),))
    parent = _absolutize_local_paths(parent, path.parent / base)
    return _deep_merge(parent, data)


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
    for name in ("pixal3d", "dinov3", "naf", "moge"):
        src = getattr(config.weights, name)
        if src is None:
            continue
        set_ = [k for k in ("repo", "local", "url", "generate") if getattr(src, k) is not None]
        if len(set_) != 1:
            raise ConfigError(f"{where}: key 'weights.{name}' needs exactly one of repo, local, url, generate; "
                              f"got {set_ or 'none'}")
        if src.url is not None and not src.filename:
            raise ConfigError(f"{where}: key 'weights.{name}.filename' is required with 'url'")
        if src.generate is not None and src.generate != "tiny":
            raise ConfigError(f"{where}: key 'weights.{name}.generate' must be 'tiny', got {src.generate!r}")
    for stage in ("structure", "shape_512", "shape_1024", "texture"):
        sampler = getattr(config, stage).sampler
        lo, hi = sampler.guidance_interval
        if sampler.steps < 1:
            raise ConfigError(f"{where}: key '{stage}.sampler.steps' must be at least 1, got {sampler.steps}")
        if not 0.0 <= lo <= hi <= 1.0:
            raise ConfigError(f"{where}: key '{stage}.sampler.guidance_interval' must be [lo, hi] with "
                              f"0 <= lo <= hi <= 1, got {list(sampler.guidance_interval)}")
    up = config.upsample
    factor = 2 ** up.times
    if up.hr_resolution % factor or up.min_resolution % factor or up.resolution_step % factor:
        raise ConfigError(f"{where}: keys 'upsample.hr_resolution' ({up.hr_resolution}), 'min_resolution' "
                          f"({up.min_resolution}) and 'resolution_step' ({up.resolution_step}) must be "
                          f"multiples of 2**upsample.times = {factor}")
    if up.min_resolution > up.hr_resolution:
        raise ConfigError(f"{where}: key 'upsample.min_resolution' ({up.min_resolution}) exceeds "
                          f"'upsample.hr_resolution' ({up.hr_resolution})")
    if config.camera.fov_deg is not None and not 0.0 < config.camera.fov_deg < 180.0:
        raise ConfigError(f"{where}: key 'camera.fov_deg' must be in (0, 180) degrees, got {config.camera.fov_deg}")


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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
