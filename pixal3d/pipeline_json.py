"""Pixal3D's ``pipeline.json`` and the files of one cascade: which checkpoints it names, the latent
normalizations, and every weight a config names resolved to local paths (``pixal3d.hub`` fetches them).

``resolve_weights(config.weights, models=...)`` downloads (unless offline) and verifies what a run reads:
``pipeline.json`` first, then the checkpoints it names, DINOv3, NAF and optionally MoGe-2.
``planned_sizes`` gives each model's bytes for the memory plan without downloading any checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pixal3d.config import DEFAULT_SIGMA_MIN, CascadeConfig, ConfigError, WeightsConfig
from pixal3d.weight_sources import BY_NAME, MODEL_SOURCES

from .hub import (
    CorruptWeightsError,
    Fetcher,
    MissingWeightsError,
    TensorSelector,
    hub_offline,
    verify_safetensors,
)

logger = logging.getLogger(__name__)

# Registry names of the checkpoints listed in pipeline.json's args.models.
PIPELINE_MODELS = (
    "sparse_structure_flow_model", "sparse_structure_decoder", "shape_slat_flow_model_512",
    "shape_slat_flow_model_1024", "tex_slat_flow_model_1024", "shape_slat_decoder", "tex_slat_decoder",
)
STANDING_MODELS = (*PIPELINE_MODELS, *(row.name for row in MODEL_SOURCES if not row.on_demand))
"""Every model a cascade may need whatever its run: Pixal3D's checkpoints and the sources of their own located every
time (``weight_sources``; MoGe-2 is located only when a run asks for it)."""

_PUBLISHED_DECODERS = {
    "sparse_structure_decoder": "ckpts/ss_dec_conv3d_16l8_fp16",
    "shape_slat_decoder": "ckpts/shape_dec_next_dc_f16c32_fp16",
    "tex_slat_decoder": "ckpts/tex_dec_next_dc_f16c32_fp16",
}
_PUBLISHED_FLOWS = {
    "sparse_structure_flow_model": "ckpts/ss_flow_img_dit_1_3B_64_bf16",
    "shape_slat_flow_model_512": "ckpts/slat_flow_img2shape_dit_1_3B_512_bf16",
    "shape_slat_flow_model_1024": "ckpts/slat_flow_img2shape_dit_1_3B_1024_bf16",
    "tex_slat_flow_model_1024": "ckpts/slat_flow_imgshape2tex_dit_1_3B_1024_bf16",
}
PINNED_CHECKPOINTS: dict[tuple[str, str, str], dict[str, str]] = {
    ("TencentARC/Pixal3D", "b0cb2e1b794cab9aa0ac38a95d794a4d9337437f", "pipeline.json"): {
        **_PUBLISHED_FLOWS, **_PUBLISHED_DECODERS},
    # the multi-view denoisers (ckpts/*_mv) beside the single-view ones, the decoders shared
    ("TencentARC/Pixal3D", "b0cb2e1b794cab9aa0ac38a95d794a4d9337437f", "pipeline_mv.json"): {
        **{name: f"{stem}_mv" for name, stem in _PUBLISHED_FLOWS.items()}, **_PUBLISHED_DECODERS},
}
"""What the pipeline file (``pipeline.json``, ``pipeline_mv.json``) names (``args.models``, as ``checkpoint_stems``
reads it) at the revisions configs pin (reference: pixal3d-inference.md §weights; the ``_mv`` names from public
ports' file lists), so that a missing-weights error can list the checkpoints before the pipeline file is
downloaded. A run always reads the downloaded file, never this table."""


def expect_pinned_checkpoints(fetch: Fetcher, weights: WeightsConfig, wanted: Iterable[str]) -> None:
    """With ``pipeline.json`` not on disk, record the checkpoints it will name at the pinned revision as missing
    too (nothing when the revision is not in ``PINNED_CHECKPOINTS``), so one error lists every file."""
    source = weights.pixal3d
    stems = PINNED_CHECKPOINTS.get((str(source.repo), str(source.revision), weights.pipeline_json), {})
    files = [f"{stems[m]}{suffix}" for m in wanted if m in stems for suffix in (".json", ".safetensors")]
    fetch.expect(source, files, label="weights.pixal3d", note=f"named by {weights.pipeline_json} at this revision")


@dataclass(frozen=True)
class Normalization:
    """Per-channel latent normalization read from ``pipeline.json`` (``latent * std + mean``)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class ResolvedWeights:
    """Local paths for every model of a run, plus what ``pipeline.json`` says.

    checkpoints: registry name → checkpoint stem (``<stem>.json`` + ``<stem>.safetensors``)
    sources:     the models with a source of their own (``pixal3d.weight_sources``) this run reads → their folder or
                 file (a parallel job's follower rank has no DINOv3 and no NAF; MoGe-2 only without a field of view)
    """

    pipeline_dir: Path
    checkpoints: dict[str, Path]
    shape_normalization: Normalization
    tex_normalization: Normalization
    rembg: str | None
    sources: Mapping[str, Path] = field(default_factory=dict)
    pipeline: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def path(self, name: str) -> Path | None:
        """The folder or file of the model ``name`` with a source of its own, or None when this run has none."""
        return self.sources.get(name)

    def safetensors(self) -> dict[str, Path]:
        """Registry name → the safetensors file it loads from (for memory planning)."""
        files = {name: stem.with_suffix(".safetensors") for name, stem in self.checkpoints.items()}
        for row in MODEL_SOURCES:
            path = self.sources.get(row.name)
            tensors = None if path is None else row.safetensors(path)
            if tensors is not None:
                files[row.name] = tensors
        return files


def resolve_weights(weights: WeightsConfig, *, models: Iterable[str] | None = None,
                    need_moge: bool = False, offline: bool | None = None,
                    generate: Callable[[Path], Path] | None = None,
                    config_file: str | None = None) -> ResolvedWeights:
    """Resolve, download (unless offline) and verify the files for ``models`` (registry names; default:
    the seven checkpoints, DINOv3 and NAF; MoGe-2 with ``need_moge``); every file that is missing, from every source,
    is named in one
    ``MissingWeightsError``. DINOv3 and NAF are fetched only when named (a follower rank needs neither).

    ``generate(folder) -> folder`` builds the tiny weights for ``generate: tiny`` sources (by
    default ``pixal3d.tiny_weights.ensure_tiny_weights``). ``config_file`` is named in the error's
    ``pixal3d-fetch`` command.
    """
    offline = hub_offline() if offline is None else offline
    models = list(STANDING_MODELS) if models is None else list(models)
    if need_moge and "moge" not in models:
        models.append("moge")
    fetch = Fetcher(offline=offline, generate=generate, config_file=config_file)

    pipe_dir, pipeline, checkpoints, sources = _locate(fetch, weights, models)
    fetch.raise_missing()  # everything missing, from every source, in one error

    # 3. every safetensors file the run will read must be whole
    resolved = ResolvedWeights(
        pipeline_dir=pipe_dir, checkpoints=checkpoints, rembg=weights.rembg, sources=sources,
        shape_normalization=read_normalization(pipeline, "shape_slat_normalization", pipe_dir / weights.pipeline_json),
        tex_normalization=read_normalization(pipeline, "tex_slat_normalization", pipe_dir / weights.pipeline_json),
        pipeline=pipeline)
    for name, path in resolved.safetensors().items():
        row = BY_NAME.get(name)
        verify_safetensors(path, source=weights.pixal3d if row is None else row.source(weights))
    return resolved


def _locate(fetch: Fetcher, weights: WeightsConfig, models: list[str]) -> tuple[Any, ...]:
    """Steps 1-2 of ``resolve_weights``: every file's place, what is missing recorded in ``fetch`` (a model with a
    source of its own is located when ``models`` names it; an on-demand one, MoGe-2 or the shape encoder, only
    then)."""
    wanted = [m for m in models if m in PIPELINE_MODELS]
    # 1. the pipeline file (pipeline.json), then the checkpoints it names for the models this run uses
    name = weights.pipeline_json
    pipe_dir = fetch.folder(weights.pixal3d, [name], label="weights.pixal3d")
    pipeline: dict[str, Any] = {}
    checkpoints: dict[str, Path] = {}
    if pipe_dir is not None and (pipe_dir / name).is_file():
        pipeline = read_pipeline_json(pipe_dir / name)
        stems = checkpoint_stems(pipeline, wanted, pipe_dir / name)
        files = [f"{stem}{suffix}" for stem in stems.values() for suffix in (".json", ".safetensors")]
        pipe_dir = fetch.folder(weights.pixal3d, [name, *files], label="weights.pixal3d")
        checkpoints = {name: pipe_dir / stem for name, stem in stems.items()} if pipe_dir is not None else {}
    else:
        expect_pinned_checkpoints(fetch, weights, wanted)

    # 2. the models with a source of their own (pixal3d.weight_sources): DINOv3, NAF, MoGe-2 and the shape encoder
    #    when asked for
    sources: dict[str, Path] = {}
    for row in MODEL_SOURCES:
        if row.name not in models:
            continue
        source = row.source(weights)
        if source is None:
            raise MissingWeightsError(row.absent or f"the config names no source for {row.label}")
        path = row.locate(fetch, source)
        if path is not None:
            sources[row.name] = path
    return pipe_dir, pipeline, checkpoints, sources


def missing_files(weights: WeightsConfig, *, include_moge: bool, include_encoder: bool = False,
                  config_file: str | None = None) -> Fetcher:
    """A ``Fetcher`` holding every file a run of ``weights`` needs that is not on disk (its ``missing``; the
    checkpoints of a ``pipeline.json`` not downloaded yet from ``PINNED_CHECKPOINTS``), found without the network:
    the one list ``pixal3d-fetch`` downloads and a missing-weights error names. MoGe-2 with ``include_moge``, the
    shape encoder (texturing a given mesh) with ``include_encoder``."""
    fetch = Fetcher(offline=True, generate=None, config_file=config_file)
    asked = {"moge": include_moge, "shape_encoder": include_encoder}
    on_demand = [r.name for r in MODEL_SOURCES if r.on_demand and r.source(weights) is not None and asked[r.name]]
    _locate(fetch, weights, [*STANDING_MODELS, *on_demand])
    return fetch


def _raise_everything_missing(fetch: Fetcher, weights: WeightsConfig, config_file: str | None) -> None:
    """When ``fetch`` found files missing, one ``MissingWeightsError`` naming every file a run needs that is not on
    disk (``missing_files``: the list ``pixal3d-fetch`` downloads), with what ``fetch`` learnt of each (the Hub's
    answer, why it was unreachable, whether it was offline)."""
    if not fetch.missing:
        return
    everything = missing_files(weights, include_moge=True, config_file=config_file)
    everything.offline, everything.unreachable = fetch.offline, fetch.unreachable
    everything.missing = [*fetch.missing, *everything.missing]  # the Hub's answers first: they are kept
    everything.raise_missing()


def planned_sizes(weights: WeightsConfig, *, models: Iterable[str], offline: bool | None = None,
                  generate: Callable[[Path], Path] | None = None,
                  select: Mapping[str, TensorSelector] | None = None,
                  config_file: str | None = None) -> tuple[dict[str, int], list[str]]:
    """Bytes of each model in ``models`` for the memory plan, without downloading any weights.

    Files already on disk (folder, Hugging Face cache, generated) give their safetensors header; a
    checkpoint not downloaded yet (the flows, DINOv3) gives the header the Hub serves for it (a few KB through
    HTTP range reads, needs network), MoGe-2 its size in the Hub's file listing. Only ``pipeline.json`` (a few
    KB) is fetched, to learn the checkpoint names. Returns ``(sizes, notes)``,
    notes naming models whose size is unknown (counted as 0). Files that are neither on disk nor
    reachable are named, all of them, in one ``MissingWeightsError``. ``select`` counts only part of a
    Pixal3D checkpoint (model name → tensor selector), e.g. a pipeline rank's shard of a flow model.
    """
    offline = hub_offline() if offline is None else offline
    select = select or {}
    wanted = list(models)
    fetch = Fetcher(offline=offline, generate=generate, config_file=config_file)
    sizes: dict[str, int] = {}
    notes: list[str] = []
    name = weights.pipeline_json
    pipe_dir = fetch.folder(weights.pixal3d, [name], label="weights.pixal3d")
    if pipe_dir is not None and (pipe_dir / name).is_file():
        stems = checkpoint_stems(read_pipeline_json(pipe_dir / name),
                                  [m for m in wanted if m in PIPELINE_MODELS], pipe_dir / name)
        for name, stem in stems.items():
            sizes[name] = fetch.planned_bytes(weights.pixal3d, pipe_dir, f"{stem}.safetensors", label="weights.pixal3d",
                                              select=select.get(name))
    else:
        expect_pinned_checkpoints(fetch, weights, [m for m in wanted if m in PIPELINE_MODELS])
    rows = [row for row in MODEL_SOURCES if row.name in wanted and row.source(weights) is not None]
    for row in rows:  # headers and sizes, nothing of the weights downloaded
        if not row.sized_late:
            sizes[row.name] = row.planned_bytes(fetch, row.source(weights), notes)
    _raise_everything_missing(fetch, weights, config_file)
    for row in rows:
        if row.sized_late:
            sizes[row.name] = row.planned_bytes(fetch, row.source(weights), notes)
    if "rembg" in wanted:
        sizes["rembg"] = 0
        notes.append("rembg: its ONNX model size is not counted")
    return sizes, notes


def planned_tensor_bytes(weights: WeightsConfig, *, models: Iterable[str], offline: bool | None = None,
                         config_file: str | None = None) -> dict[str, dict[str, int]]:
    """Each model in ``models`` that can stream: its tensors' bytes (name -> bytes) from its header, on disk or
    the Hub's, as ``planned_sizes`` reads them (nothing downloaded but ``pipeline.json``): what the ``stream``
    policy's plan splits into the part that stays resident and the blocks. Pixal3D's checkpoints, and the models
    of a source of their own that stream (``ModelSource.load_streamed``: DINOv3, MoGe-2) where their tensors are
    known (``ModelSource.planned_tensors``)."""
    wanted = list(models)
    pixal3d = [m for m in wanted if m in PIPELINE_MODELS]
    rows = [row for row in MODEL_SOURCES
            if row.name in wanted and row.load_streamed is not None and row.source(weights) is not None]
    if not pixal3d and not rows:
        return {}
    offline = hub_offline() if offline is None else offline
    fetch = Fetcher(offline=offline, generate=None, config_file=config_file)
    out: dict[str, dict[str, int]] = {}
    if pixal3d:
        name = weights.pipeline_json
        pipe_dir = fetch.folder(weights.pixal3d, [name], label="weights.pixal3d")
        if pipe_dir is not None and (pipe_dir / name).is_file():
            stems = checkpoint_stems(read_pipeline_json(pipe_dir / name), pixal3d, pipe_dir / name)
            for name, stem in stems.items():
                tensors = fetch.planned_tensors(weights.pixal3d, pipe_dir, f"{stem}.safetensors",
                                                label="weights.pixal3d")
                if tensors is not None:
                    out[name] = tensors
    notes: list[str] = []
    for row in rows:
        tensors = row.planned_tensors(fetch, row.source(weights), notes)
        if tensors is not None:
            out[row.name] = tensors
    fetch.raise_missing()
    return out


# -- pipeline.json -------------------------------------------------------------------------------

def read_pipeline_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CorruptWeightsError(f"{path} is not valid JSON ({err}); delete it and download it again") from None
    if not isinstance(data, dict) or not isinstance(data.get("args"), dict):
        raise CorruptWeightsError(f"{path} has no 'args' object; is this a Pixal3D pipeline.json?")
    return data


def checkpoint_stems(pipeline: Mapping[str, Any], wanted: list[str], path: Path) -> dict[str, str]:
    models = pipeline["args"].get("models", {})
    absent = [m for m in wanted if m not in models]
    if absent:
        raise CorruptWeightsError(f"{path}: args.models lacks {absent}; the 1024 cascade needs them")
    stems = {}
    for name in wanted:
        stem = str(models[name])
        if stem.count("/") >= 2 and not stem.startswith(("ckpts/", "./")):
            # "owner/repo/ckpts/x" names another repository (TRELLIS convention); the Pixal3D repo ships
            # the same checkpoint as ckpts/x, which is what we fetch (pinned with this repo).
            local = "ckpts/" + stem.rsplit("/", 1)[-1]
            logger.info("%s: args.models.%s = %r points into another repository; using %s from this one",
                        path, name, stem, local)
            stem = local
        stems[name] = stem
    return stems


def read_normalization(pipeline: Mapping[str, Any], key: str, path: Path) -> Normalization:
    value = pipeline["args"].get(key)
    if not isinstance(value, Mapping) or "mean" not in value or "std" not in value:
        raise CorruptWeightsError(f"{path}: args.{key} must have 'mean' and 'std' lists")
    mean, std = tuple(float(v) for v in value["mean"]), tuple(float(v) for v in value["std"])
    if len(mean) != len(std) or not mean:
        raise CorruptWeightsError(f"{path}: args.{key} mean ({len(mean)}) and std ({len(std)}) differ in length")
    return Normalization(mean=mean, std=std)


# -- sampler settings ----------------------------------------------------------------------------

SAMPLER_SECTIONS = {"structure": "sparse_structure_sampler", "shape_512": "shape_slat_sampler",
                    "shape_1024": "shape_slat_sampler", "texture": "tex_slat_sampler"}
"""Cascade config stage → the ``pipeline.json`` sampler it uses (the two shape stages share one)."""

PUBLISHED_INTERVALS = {"sparse_structure_sampler": (0.6, 1.0), "shape_slat_sampler": (0.6, 1.0),
                       "tex_slat_sampler": (0.6, 0.9)}
"""The guidance intervals the published pipeline.json gives (reference §4), for files and benchmarks that stand
in for it (``published_samplers()``); a run reads the real file."""

_reported: set[tuple[str, ...]] = set()  # differences already logged (once per process)


def published_samplers() -> dict[str, Any]:
    """The sampler sections of the published ``pipeline.json`` (``args.<section>``: name, sigma_min, interval)."""
    return {section: {"name": "FlowEulerGuidanceIntervalSampler", "args": {"sigma_min": DEFAULT_SIGMA_MIN},
                      "params": {"guidance_interval": list(interval)}} for section, interval in PUBLISHED_INTERVALS.items()}


def sampler_settings(pipeline: Mapping[str, Any], section: str) -> dict[str, Any]:
    """``{"guidance_interval": (lo, hi), "sigma_min": s}`` as ``pipeline.json`` gives them for one sampler
    (``args.<section>.params.guidance_interval``, ``args.<section>.args.sigma_min``); absent keys left out."""
    entry = pipeline.get("args", {}).get(section)
    entry = entry if isinstance(entry, Mapping) else {}
    params, args = entry.get("params"), entry.get("args")
    out: dict[str, Any] = {}
    if isinstance(params, Mapping) and params.get("guidance_interval") is not None:
        out["guidance_interval"] = tuple(float(v) for v in params["guidance_interval"])
    if isinstance(args, Mapping) and args.get("sigma_min") is not None:
        out["sigma_min"] = float(args["sigma_min"])
    return out


def resolve_samplers(config: CascadeConfig, pipeline: Mapping[str, Any] | None) -> CascadeConfig:
    """``config`` with each flow stage's ``guidance_interval`` and ``sigma_min`` as the reference reads them:
    from ``pipeline.json``, unless the config sets the interval or changes ``sigma_min`` from the sampler's
    default. Where the two differ, a warning names both and which is used (once per value and process). An
    interval set by neither is a ``ConfigError``."""
    changes = {}
    for stage, section in SAMPLER_SECTIONS.items():
        stage_config = getattr(config, stage)
        sampler = stage_config.sampler
        given = sampler_settings(pipeline, section) if pipeline is not None else {}
        values: dict[str, Any] = {}
        if sampler.guidance_interval is None:
            if "guidance_interval" not in given:
                raise ConfigError(f"{config.source or 'the config'}: key '{stage}.sampler.guidance_interval' is set "
                                  f"neither there nor in pipeline.json (args.{section}.params.guidance_interval); "
                                  f"set it in the config, e.g. [0.6, 1.0]")
            values["guidance_interval"] = given["guidance_interval"]
        elif "guidance_interval" in given and tuple(sampler.guidance_interval) != given["guidance_interval"]:
            _report(config, stage, section, "guidance_interval", sampler.guidance_interval, given, "the config's")
        if "sigma_min" in given and sampler.sigma_min != given["sigma_min"]:
            explicit = sampler.sigma_min != DEFAULT_SIGMA_MIN
            _report(config, stage, section, "sigma_min", sampler.sigma_min, given,
                    "the config's" if explicit else "pipeline.json's")
            if not explicit:
                values["sigma_min"] = given["sigma_min"]
        if values:
            changes[stage] = dataclasses.replace(stage_config, sampler=dataclasses.replace(sampler, **values))
    return dataclasses.replace(config, **changes) if changes else config


def _report(config: CascadeConfig, stage: str, section: str, key: str, own: Any, given: Mapping[str, Any],
            used: str) -> None:
    report = (config.source, stage, key, repr(own), repr(given[key]))
    if report not in _reported:
        _reported.add(report)
        logger.warning("%s.sampler.%s: the config says %s, pipeline.json's %s says %s; using %s", stage, key,
                       _show(own), section, _show(given[key]), used)


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else f"{value:g}"


def planned_pipeline_json(weights: WeightsConfig, *, offline: bool | None = None,
                          generate: Callable[[Path], Path] | None = None) -> dict[str, Any] | None:
    """``pipeline.json`` for planning (fetched alone, like ``planned_sizes`` does), or None when it cannot be
    had now: ``planned_sizes`` then names it with every other missing file."""
    fetch = Fetcher(offline=hub_offline() if offline is None else offline, generate=generate)
    folder = fetch.folder(weights.pixal3d, [weights.pipeline_json], label="weights.pixal3d")
    if folder is None or fetch.missing:
        return None
    return read_pipeline_json(folder / weights.pipeline_json)
