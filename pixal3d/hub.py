"""Find, download and verify the files a cascade config names.

``resolve_weights(config.weights, models=...)`` turns every weight source into local paths:

- ``repo``: ``huggingface_hub.snapshot_download`` at the pinned revision with ``allow_patterns``
  limited to the files the run needs (``pipeline.json`` first, then the checkpoints it names). With
  ``HF_HUB_OFFLINE=1`` (or ``offline=True``) only the local Hugging Face cache is used.
- ``local``: a folder on disk, used as is.
- ``url``: one file, downloaded once into the pixal3d cache (``$PIXAL3D_CACHE`` or
  ``~/.cache/pixal3d``), checked against its sha256 when the config pins one.
- ``generate: tiny``: the deterministic demo weights, generated into the cache on first use.

``planned_sizes`` gives each model's bytes for the memory plan without downloading any checkpoint
(headers on disk, or the header the Hub serves). Files that are not there become one
``MissingWeightsError`` naming the files, where they should come from and the command that fetches
them. Every safetensors file the run will read is checked
(header parses, file is as long as the header says, not a git-lfs pointer) before anything loads.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pixal3d.config import WeightsConfig, WeightSource

logger = logging.getLogger(__name__)

# Registry names of the checkpoints listed in pipeline.json's args.models.
PIPELINE_MODELS = (
    "sparse_structure_flow_model", "sparse_structure_decoder", "shape_slat_flow_model_512",
    "shape_slat_flow_model_1024", "tex_slat_flow_model_1024", "shape_slat_decoder", "tex_slat_decoder",
)


class WeightsError(RuntimeError):
    """Base class: the weights a config names cannot be used."""


class MissingWeightsError(WeightsError):
    """Files a run needs are not on disk (and could not be downloaded)."""


class CorruptWeightsError(WeightsError):
    """A weights file exists but is truncated, corrupt or a git-lfs pointer."""


@dataclass(frozen=True)
class Normalization:
    """Per-channel latent normalization read from ``pipeline.json`` (``latent * std + mean``)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class ResolvedWeights:
    """Local paths for every model of a run, plus what ``pipeline.json`` says.

    checkpoints: registry name → checkpoint stem (``<stem>.json`` + ``<stem>.safetensors``)
    """

    pipeline_dir: Path
    checkpoints: dict[str, Path]
    shape_normalization: Normalization
    tex_normalization: Normalization
    dinov3: Path
    naf: Path
    rembg: str
    moge: Path | None = None
    pipeline: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def safetensors(self) -> dict[str, Path]:
        """Registry name → the safetensors file it loads from (for memory planning)."""
        files = {name: stem.with_suffix(".safetensors") for name, stem in self.checkpoints.items()}
        files["dinov3"] = self.dinov3 / "model.safetensors"
        if self.naf.suffix == ".safetensors":
            files["naf"] = self.naf
        return files


def cache_root() -> Path:
    """The pixal3d cache folder: ``$PIXAL3D_CACHE``, else ``$XDG_CACHE_HOME/pixal3d``, else ``~/.cache/pixal3d``."""
    if os.environ.get("PIXAL3D_CACHE"):
        return Path(os.environ["PIXAL3D_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pixal3d"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` asks for cache-only operation."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_weights(weights: WeightsConfig, *, models: Iterable[str] = PIPELINE_MODELS,
                    need_moge: bool = False, offline: bool | None = None,
                    generate: Callable[[Path], Path] | None = None) -> ResolvedWeights:
    """Resolve, download (unless offline) and verify the files for ``models``.

    ``generate(folder) -> folder`` builds the tiny weights for ``generate: tiny`` sources (by
    default ``pipelines.tiny_weights.ensure_tiny_weights``).
    """
    offline = hub_offline() if offline is None else offline
    wanted = [m for m in models if m in PIPELINE_MODELS]
    fetch = _Fetcher(offline=offline, generate=generate)

    # 1. pipeline.json, then the checkpoints it names for the models this run uses
    pipe_dir = fetch.folder(weights.pixal3d, ["pipeline.json"], label="weights.pixal3d")
    pipeline = _read_pipeline_json(pipe_dir / "pipeline.json")
    stems = _checkpoint_stems(pipeline, wanted, pipe_dir / "pipeline.json")
    files = [f"{stem}{suffix}" for stem in stems.values() for suffix in (".json", ".safetensors")]
    pipe_dir = fetch.folder(weights.pixal3d, ["pipeline.json", *files], label="weights.pixal3d")
    checkpoints = {name: pipe_dir / stem for name, stem in stems.items()}

    # 2. the helpers: DINOv3 folder, NAF file, optional MoGe
    dinov3 = fetch.folder(weights.dinov3, list(weights.dinov3.files) or ["config.json", "model.safetensors"],
                          label="weights.dinov3")
    naf = fetch.file(weights.naf, label="weights.naf")
    moge = None
    if need_moge:
        if weights.moge is None:
            raise MissingWeightsError("no MoGe-2 source is configured (weights.moge) and no field of view was "
                                      "given; pass --fov DEG or add weights.moge to the config")
        moge = fetch.folder(weights.moge, list(weights.moge.files), label="weights.moge")

    # 3. every safetensors file the run will read must be whole
    resolved = ResolvedWeights(
        pipeline_dir=pipe_dir, checkpoints=checkpoints, dinov3=dinov3, naf=naf, rembg=weights.rembg, moge=moge,
        shape_normalization=_normalization(pipeline, "shape_slat_normalization", pipe_dir / "pipeline.json"),
        tex_normalization=_normalization(pipeline, "tex_slat_normalization", pipe_dir / "pipeline.json"),
        pipeline=pipeline)
    for path in resolved.safetensors().values():
        verify_safetensors(path)
    return resolved


def planned_sizes(weights: WeightsConfig, *, models: Iterable[str], offline: bool | None = None,
                  generate: Callable[[Path], Path] | None = None) -> tuple[dict[str, int], list[str]]:
    """Bytes of each model in ``models`` for the memory plan, without downloading any weights.

    Files already on disk (folder, Hugging Face cache, generated) give their safetensors header; a
    checkpoint not downloaded yet gives the header the Hub serves for it (a few KB, needs network).
    Only ``pipeline.json`` is fetched, to learn the checkpoint names. Returns ``(sizes, notes)``,
    notes naming models whose size is unknown (counted as 0).
    """
    offline = hub_offline() if offline is None else offline
    wanted = list(models)
    fetch = _Fetcher(offline=offline, generate=generate)
    sizes: dict[str, int] = {}
    notes: list[str] = []
    pipe_dir = fetch.folder(weights.pixal3d, ["pipeline.json"], label="weights.pixal3d")
    stems = _checkpoint_stems(_read_pipeline_json(pipe_dir / "pipeline.json"),
                              [m for m in wanted if m in PIPELINE_MODELS], pipe_dir / "pipeline.json")
    for name, stem in stems.items():
        sizes[name] = _planned_file_bytes(weights.pixal3d, pipe_dir, f"{stem}.safetensors", offline=offline,
                                          label="weights.pixal3d")
    if "dinov3" in wanted:
        folder = fetch.folder(weights.dinov3, ["config.json"], label="weights.dinov3")
        sizes["dinov3"] = _planned_file_bytes(weights.dinov3, folder, "model.safetensors", offline=offline,
                                              label="weights.dinov3")
    if "naf" in wanted:
        if weights.naf.url is not None:
            target = cache_root() / "downloads" / str(weights.naf.filename)
            sizes["naf"] = target.stat().st_size if target.is_file() else 0
            if not target.is_file():
                notes.append("naf: not downloaded yet, size unknown (about 3 MB)")
        else:
            sizes["naf"] = fetch.file(weights.naf, label="weights.naf").stat().st_size
    if "moge" in wanted and weights.moge is not None:
        sizes["moge"] = _planned_repo_file_size(weights.moge, "model.pt", offline=offline, notes=notes)
    if "rembg" in wanted:
        sizes["rembg"] = 0
        notes.append("rembg: its ONNX model size is not counted")
    return sizes, notes


def _planned_file_bytes(source: WeightSource, folder: Path, filename: str, *, offline: bool, label: str) -> int:
    path = folder / filename
    if path.is_file():
        return verify_safetensors(path)
    if source.repo is None or offline:
        raise MissingWeightsError(_missing_message(source, [filename], folder, label, offline=offline))
    from huggingface_hub import parse_safetensors_file_metadata

    try:
        meta = parse_safetensors_file_metadata(source.repo, filename, revision=source.revision)
    except Exception as err:  # noqa: BLE001 -- network and Hub errors of many kinds: say what failed
        raise MissingWeightsError(_missing_message(source, [filename], None, label, offline=offline,
                                                   reason=f"{type(err).__name__}: {_first_line(err)}")) from None
    return sum(int(t.data_offsets[1]) - int(t.data_offsets[0]) for t in meta.tensors.values())


def _planned_repo_file_size(source: WeightSource, filename: str, *, offline: bool, notes: list[str]) -> int:
    if source.local is not None:
        path = Path(source.local) / filename
        return path.stat().st_size if path.is_file() else 0
    if source.repo is None or offline:
        notes.append(f"{filename}: size unknown offline")
        return 0
    from huggingface_hub import HfApi

    try:
        info = HfApi().get_paths_info(source.repo, [filename], revision=source.revision)
    except Exception as err:  # noqa: BLE001 -- network and Hub errors of many kinds
        notes.append(f"{filename}: size unknown ({type(err).__name__})")
        return 0
    return int(getattr(info[0], "size", 0) or 0) if info else 0


# -- sources -------------------------------------------------------------------------------------

class _Fetcher:
    """Turns one ``WeightSource`` plus the files wanted from it into a local folder or file."""

    def __init__(self, *, offline: bool, generate: Callable[[Path], Path] | None):
        self.offline = offline
        self.generate = generate

    def folder(self, source: WeightSource, files: list[str], *, label: str) -> Path:
        if source.repo is not None:
            folder = self._snapshot(source, files, label=label)
        elif source.local is not None:
            folder = Path(source.local)
        elif source.generate is not None:
            folder = self._generated()
            sub = label.split(".")[-1]
            folder = folder / sub
        else:
            raise WeightsError(f"{label}: a url source gives one file, but a folder is needed here; "
                               f"use repo or local")
        missing = [f for f in files if not _present(folder, f)]
        if missing:
            raise MissingWeightsError(_missing_message(source, missing, folder, label, offline=self.offline))
        return folder

    def file(self, source: WeightSource, *, label: str) -> Path:
        if source.url is None:
            folder = self.folder(source, list(source.files), label=label)
            matches = sorted(p for pattern in source.files for p in folder.glob(pattern))
            if len(matches) != 1:
                raise WeightsError(f"{label}: 'files' must name exactly one file for this source, "
                                   f"got {list(source.files)} matching {len(matches)} in {folder}")
            return matches[0]
        target = cache_root() / "downloads" / str(source.filename)
        if not target.is_file():
            if self.offline:
                raise MissingWeightsError(_missing_message(source, [str(source.filename)], target.parent, label,
                                                           offline=True))
            _download_url(source.url, target, label=label)
        if source.sha256:
            digest = _sha256(target)
            if digest != source.sha256.lower():
                raise CorruptWeightsError(f"{target} has sha256 {digest}, but {label}.sha256 pins "
                                          f"{source.sha256}; delete the file and run again to re-download it")
        return target

    def _snapshot(self, source: WeightSource, files: list[str], *, label: str) -> Path:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            path = huggingface_hub.snapshot_download(
                repo_id=source.repo, revision=source.revision, allow_patterns=files,
                local_files_only=self.offline)
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
            raise MissingWeightsError(_missing_message(source, files, None, label, offline=self.offline,
                                                       reason=f"{type(err).__name__}: {_first_line(err)}")) from None
        return Path(path)

    def _generated(self) -> Path:
        if self.generate is None:
            from pipelines.tiny_weights import ensure_tiny_weights
            return ensure_tiny_weights(cache_root() / "tiny")
        return self.generate(cache_root() / "tiny")


def _present(folder: Path, pattern: str) -> bool:
    if any(ch in pattern for ch in "*?["):
        return any(folder.glob(pattern))
    return (folder / pattern).is_file()


def _missing_message(source: WeightSource, missing: list[str], folder: Path | None, label: str, *,
                     offline: bool, reason: str | None = None) -> str:
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    where = f" in {folder}" if folder is not None else ""
    text = f"missing weights for {label}: {shown}{where} (from {source.describe()})"
    if reason:
        text += f" [{reason}]"
    if source.repo is not None:
        command = ["hf", "download", source.repo, *missing]
        if source.revision:
            command += ["--revision", source.revision]
        hint = "online" if offline else "with network access"
        text += f"; fetch them {hint} with: {shlex.join(command)}"
        if offline:
            text += " (HF_HUB_OFFLINE is set, so only the local cache was searched)"
    elif source.url is not None:
        target = cache_root() / "downloads" / str(source.filename)
        text += f"; fetch it with: curl -L -o {shlex.quote(str(target))} {shlex.quote(source.url)}"
    elif source.local is not None:
        text += "; put the files there or point the config at the folder that holds them"
    else:
        text += "; delete the folder and run again to regenerate it (scripts/make_tiny_weights.py)"
    return text


def _download_url(url: str, target: Path, *, label: str) -> None:
    import urllib.request

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    logger.info("downloading %s to %s", url, target)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise MissingWeightsError(f"could not download {label} from {url} ({_first_line(err)}); fetch it with: "
                                  f"curl -L -o {shlex.quote(str(target))} {shlex.quote(url)}") from None
    tmp.replace(target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


# -- pipeline.json -------------------------------------------------------------------------------

def _read_pipeline_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CorruptWeightsError(f"{path} is not valid JSON ({err}); delete it and download it again") from None
    if not isinstance(data, dict) or not isinstance(data.get("args"), dict):
        raise CorruptWeightsError(f"{path} has no 'args' object; is this a Pixal3D pipeline.json?")
    return data


def _checkpoint_stems(pipeline: Mapping[str, Any], wanted: list[str], path: Path) -> dict[str, str]:
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


def _normalization(pipeline: Mapping[str, Any], key: str, path: Path) -> Normalization:
    value = pipeline["args"].get(key)
    if not isinstance(value, Mapping) or "mean" not in value or "std" not in value:
        raise CorruptWeightsError(f"{path}: args.{key} must have 'mean' and 'std' lists")
    mean, std = tuple(float(v) for v in value["mean"]), tuple(float(v) for v in value["std"])
    if len(mean) != len(std) or not mean:
        raise CorruptWeightsError(f"{path}: args.{key} mean ({len(mean)}) and std ({len(std)}) differ in length")
    return Normalization(mean=mean, std=std)


# -- safetensors ---------------------------------------------------------------------------------

def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The parsed JSON header of a safetensors file, after checking the file is complete.

    Raises ``CorruptWeightsError`` for a git-lfs pointer, an unreadable header, or a file shorter
    (or longer) than its header says.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingWeightsError(f"weights file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if head.startswith(b"version "):
            raise CorruptWeightsError(f"{path} is a git-lfs pointer, not the weights; download the real file "
                                      f"(hf download, or git lfs pull)")
        if len(head) < 8:
            raise CorruptWeightsError(f"{path} is truncated ({size} bytes); delete it and download it again")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > 100_000_000:
            raise CorruptWeightsError(f"{path} is truncated or not a safetensors file (header of {length} bytes "
                                      f"in a {size}-byte file); delete it and download it again")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CorruptWeightsError(f"{path} has a corrupt header; delete it and download it again") from None
    if not isinstance(header, dict):
        raise CorruptWeightsError(f"{path} has a corrupt header; delete it and download it again")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise CorruptWeightsError(f"{path}: tensor {key!r} has no valid data_offsets; the file is corrupt; "
                                      f"delete it and download it again") from None
    expected = 8 + length + end
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise CorruptWeightsError(f"{path} is {state} ({size} bytes, header says {expected}); "
                                  f"delete it and download it again")
    return header


def verify_safetensors(path: str | Path) -> int:
    """Check ``path`` is a complete safetensors file; return its tensor bytes."""
    header = read_safetensors_header(path)
    return max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
