"""Weight sources: turn a config's ``WeightSource`` into local files, downloading when allowed.

- ``repo``: ``huggingface_hub.snapshot_download`` at the pinned revision with ``allow_patterns``
  limited to the files asked for. With ``HF_HUB_OFFLINE=1`` (or ``offline=True``) only the local
  Hugging Face cache is used.
- ``local``: a folder on disk, used as is.
- ``url``: one file, downloaded once into the pixal3d cache (``$PIXAL3D_CACHE`` or
  ``~/.cache/pixal3d``), checked against its sha256 when the config pins one.
- ``generate: tiny``: the deterministic demo weights, generated into the cache on first use.

Files that are not there become one ``MissingWeightsError`` naming the files, where they should come
from and the command that fetches them; a safetensors file that is truncated, corrupt or a git-lfs
pointer is a ``CorruptWeightsError``. What Pixal3D's ``pipeline.json`` names, and which files one
cascade needs, is ``pixal3d.pipeline_json``'s business.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pixal3d.config import WeightSource
from pixal3d.staging.safetensors_header import SafetensorsHeaderError
from pixal3d.staging.safetensors_header import read_safetensors_header as _read_header

logger = logging.getLogger(__name__)


class WeightsError(RuntimeError):
    """Base class: the weights a config names cannot be used."""


class MissingWeightsError(WeightsError):
    """Files a run needs are not on disk (and could not be downloaded)."""


class CorruptWeightsError(WeightsError):
    """A weights file exists but is truncated, corrupt or a git-lfs pointer."""


def cache_root() -> Path:
    """The pixal3d cache folder: ``$PIXAL3D_CACHE``, else ``$XDG_CACHE_HOME/pixal3d``, else ``~/.cache/pixal3d``."""
    if os.environ.get("PIXAL3D_CACHE"):
        return Path(os.environ["PIXAL3D_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pixal3d"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` asks for cache-only operation."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def planned_file_bytes(source: WeightSource, folder: Path, filename: str, *, offline: bool, label: str) -> int:
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


def planned_repo_file_size(source: WeightSource, filename: str, *, offline: bool, notes: list[str]) -> int:
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

class Fetcher:
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
            from pixal3d.tiny_weights import ensure_tiny_weights
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


# -- safetensors ---------------------------------------------------------------------------------

def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The tensors of a safetensors file's header (name → dtype, shape, offsets), after checking the file
    is complete; ``MissingWeightsError`` / ``CorruptWeightsError`` say what is wrong and what to do."""
    try:
        return _read_header(path).tensors
    except SafetensorsHeaderError as err:
        if err.problem == "missing":
            raise MissingWeightsError(str(err)) from None
        if err.problem == "lfs-pointer":
            raise CorruptWeightsError(f"{err}; download the real file (hf download, or git lfs pull)") from None
        raise CorruptWeightsError(f"{err}; delete it and download it again") from None


def verify_safetensors(path: str | Path) -> int:
    """Check ``path`` is a complete safetensors file; return its tensor bytes."""
    return max((int(v["data_offsets"][1]) for v in read_safetensors_header(path).values()), default=0)
