"""Weight sources: turn a config's ``WeightSource`` into local files, downloading when allowed.

- ``repo``: ``huggingface_hub.snapshot_download`` at the pinned revision with ``allow_patterns``
  limited to the files asked for. With ``HF_HUB_OFFLINE=1`` (or ``offline=True``) only the local
  Hugging Face cache is used.
- ``local``: a folder on disk, used as is.
- ``url``: one file, downloaded once into the pixal3d cache (``$PIXAL3D_CACHE`` or
  ``~/.cache/pixal3d``), checked against its sha256 when the config pins one.
- ``generate: tiny`` (``tiny-mv``): the deterministic demo weights, generated into the cache on first use.

Files that are not there become one ``MissingWeightsError`` naming every missing file of every source, one
per line, where they should come from, the commands that fetch them one source at a time and, last, the one
command that fetches everything (``pixal3d-fetch``, ``pixal3d.fetch``; without network, the first request that
fails stops the lookups: the rest comes from the cache, without retries); a safetensors file that is
truncated, corrupt or a git-lfs pointer is a ``CorruptWeightsError`` whose advice fits its source
(download it again, replace it, or regenerate it). What Pixal3D's ``pipeline.json`` names, and which files one
cascade needs, is ``pixal3d.pipeline_json``'s business.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pixal3d.config import WeightSource
from pixal3d.staging.safetensors_header import SafetensorsHeaderError
from pixal3d.staging.safetensors_header import read_safetensors_header as _read_header
from pixal3d.weights_errors import (CorruptWeightsError, HubAnswerError, HubUnreachableError, MissingWeightsError,
                                    WeightsError)

logger = logging.getLogger(__name__)

TensorSelector = Callable[[Iterable[str]], Iterable[str]]  # a file's tensor names -> the ones to count


def cache_root() -> Path:
    """The pixal3d cache folder: ``$PIXAL3D_CACHE``, else ``$XDG_CACHE_HOME/pixal3d``, else ``~/.cache/pixal3d``."""
    if os.environ.get("PIXAL3D_CACHE"):
        return Path(os.environ["PIXAL3D_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pixal3d"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` asks for cache-only operation."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


# -- sources -------------------------------------------------------------------------------------

@dataclass
class _Missing:
    """Files one source lacks (found while resolving; reported together by ``Fetcher.raise_missing``)."""

    source: WeightSource
    label: str
    files: list[str]
    folder: Path | None
    reason: str | None = None  # what the Hub answered, when it did
    note: str | None = None  # why the files are expected (e.g. named by pipeline.json at the pinned revision)


class Fetcher:
    """Turns ``WeightSource``s plus the files wanted from them into local folders and files.

    Missing files are collected, not raised one by one: ``raise_missing()`` reports every file of every
    source in one ``MissingWeightsError``, with one command per repo, so a partial cache takes one round
    trip to complete. Without ``offline`` the Hub is used only for what the cache lacks, and the first
    time it cannot be reached (no network) the rest is looked up in the cache only, without retries.
    """

    def __init__(self, *, offline: bool, generate: Callable[[Path], Path] | None, config_file: str | None = None,
                 progress: bool = False):
        self.offline = offline
        self.generate = generate
        self.config_file = config_file  # named in the pixal3d-fetch command that ends a missing-weights error
        self.progress = progress  # a progress bar for URL downloads (pixal3d-fetch)
        self.unreachable: str | None = None  # why the Hub could not be reached, once it could not
        self.missing: list[_Missing] = []

    # -- folders and files ---------------------------------------------------------------------
    def folder(self, source: WeightSource, files: list[str], *, label: str) -> Path | None:
        """The folder holding ``files`` (``None`` when not even the folder is known); what is missing from it
        is recorded."""
        reason = None
        if source.repo is not None:
            folder, reason = self._snapshot(source, files, label=label)
        elif source.local is not None:
            folder = Path(source.local)
        elif source.generate is not None:
            folder = self._generated(source.generate) / label.split(".")[-1]
        else:
            raise WeightsError(f"{label}: a url source gives one file, but a folder is needed here; "
                               f"use repo or local")
        missing = [f for f in files if folder is None or not _present(folder, f)]
        if missing:
            self.missing.append(_Missing(source, label, missing, folder, reason))
        return folder

    def file(self, source: WeightSource, *, label: str, strict: bool = False) -> Path | None:
        """The one file ``source`` gives (``None`` when missing: recorded). ``strict`` (``pixal3d-fetch``): a
        download that fails raises its one-line error (``HubAnswerError``, ``HubUnreachableError``,
        ``CorruptWeightsError``) instead of being recorded as missing."""
        if source.url is None:
            folder = self.folder(source, list(source.files), label=label)
            if folder is None or any(m.source is source for m in self.missing):
                return None
            matches = sorted(p for pattern in source.files for p in folder.glob(pattern))
            if len(matches) != 1:
                raise WeightsError(f"{label}: 'files' must name exactly one file for this source, "
                                   f"got {list(source.files)} matching {len(matches)} in {folder}")
            return matches[0]
        target = cache_root() / "downloads" / str(source.filename)
        if not target.is_file():
            if self.offline:
                self.missing.append(_Missing(source, label, [str(source.filename)], target.parent))
                return None
            try:
                _download_url(source.url, target, progress=self.progress)
            except WeightsError as err:
                if strict:
                    raise
                self.missing.append(_Missing(source, label, [str(source.filename)], target.parent, str(err)))
                return None
        if source.sha256:
            digest = _sha256(target)
            if digest != source.sha256.lower():
                raise CorruptWeightsError(f"{target} has sha256 {digest}, but {label}.sha256 pins "
                                          f"{source.sha256}; delete the file and run again to re-download it")
        return target

    def cached_file(self, source: WeightSource, filename: str, *, label: str) -> Path | None:
        """``filename`` of ``source`` when it is on disk already (the Hugging Face cache, a folder, generated), else
        ``None``: nothing is downloaded and nothing is recorded as missing (for the plan)."""
        if source.repo is not None:
            folder = self._cached_snapshot(source, [filename])
        elif source.local is not None:
            folder = Path(source.local)
        elif source.generate is not None:
            folder = self._generated(source.generate) / label.split(".")[-1]
        else:
            return None
        return folder / filename if folder is not None and (folder / filename).is_file() else None

    def planned_bytes(self, source: WeightSource, folder: Path | None, filename: str, *, label: str,
                      select: TensorSelector | None = None) -> int:
        """Tensor bytes of ``folder/filename`` from its header; a file not on disk asks the Hub for the header
        (a few KB) when it can, else is recorded as missing (0). ``select`` (the names of the whole file → the
        names to count) sizes a part of the file, such as one pipeline rank's shard."""
        path = folder / filename if folder is not None else None
        if path is not None and path.is_file() and select is None:
            return verify_safetensors(path, source=source)
        tensors = self.planned_tensors(source, folder, filename, label=label)
        if tensors is None:
            return 0
        names = tensors.keys() if select is None else select(list(tensors))
        return sum(tensors[n] for n in names)

    def planned_tensors(self, source: WeightSource, folder: Path | None, filename: str, *,
                        label: str) -> dict[str, int] | None:
        """Each tensor's bytes in ``folder/filename``, from its header (on disk, else the Hub's, a few KB); None
        when neither can be read (recorded as missing)."""
        path = folder / filename if folder is not None else None
        if path is not None and path.is_file():
            return _tensor_bytes(read_safetensors_header(path, source=source))
        if source.repo is None or self.offline or self.unreachable is not None:
            self.missing.append(_Missing(source, label, [filename], folder))
            return None
        from huggingface_hub import parse_safetensors_file_metadata

        try:
            meta = parse_safetensors_file_metadata(source.repo, filename, revision=source.revision)
        except Exception as err:  # noqa: BLE001 -- network and Hub errors of many kinds: say what failed
            self.missing.append(_Missing(source, label, [filename], folder, self._reason(err)))
            return None
        return _tensor_bytes({name: {"data_offsets": t.data_offsets} for name, t in meta.tensors.items()})

    def repo_file_size(self, source: WeightSource, filename: str, *, notes: list[str]) -> int:
        """Bytes of one (non-safetensors) file from the Hub's file listing, for the plan; 0 with a note
        when unknown (offline, unreachable, not listed)."""
        if source.local is not None:
            path = Path(source.local) / filename
            return path.stat().st_size if path.is_file() else 0
        if source.repo is None or self.offline or self.unreachable is not None or not self._reachable(source, [filename]):
            notes.append(f"{filename}: size unknown offline")
            return 0
        from huggingface_hub import HfApi

        try:
            info = HfApi().get_paths_info(source.repo, [filename], revision=source.revision)
        except Exception as err:  # noqa: BLE001 -- network and Hub errors of many kinds
            notes.append(f"{filename}: size unknown ({type(err).__name__})")
            return 0
        return int(getattr(info[0], "size", 0) or 0) if info else 0

    def expect(self, source: WeightSource, files: list[str], *, label: str, note: str) -> None:
        """Record ``files`` of ``source`` as missing although nothing has looked for them yet (the checkpoints a
        ``pipeline.json`` not downloaded yet will name), so that one error lists them too."""
        if files:
            self.missing.append(_Missing(source, label, list(files), None, note=note))

    def download_repo_file(self, source: WeightSource, filename: str) -> Path:
        """Download one file of a ``repo`` source into the Hugging Face cache at its pinned revision
        (``hf_hub_download``: a progress bar, and a partial ``.incomplete`` file is resumed), then check its
        size against the one the Hub lists; a file of another size is refused (``CorruptWeightsError``)."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

        try:
            expected = get_hf_file_metadata(hf_hub_url(source.repo, filename, revision=source.revision),
                                            timeout=30).size
            path = Path(hf_hub_download(repo_id=source.repo, filename=filename, revision=source.revision))
        except network_errors() as err:
            raise hub_error(err, f"{filename} of {source.describe()}") from None
        got = path.stat().st_size
        if expected is not None and got != int(expected):
            blob = path.resolve()  # the cache's blob behind the snapshot's link: removed both, never kept
            path.unlink()
            blob.unlink(missing_ok=True)
            raise CorruptWeightsError(f"{path} ({source.describe()}) has {got} bytes, but the Hub lists {filename} "
                                      f"with {int(expected)}; it was removed, run pixal3d-fetch again")
        if filename.endswith(".safetensors"):
            verify_safetensors(path, source=source)
        return path

    def raise_missing(self) -> None:
        """One ``MissingWeightsError`` for everything recorded as missing, if anything was."""
        if self.missing:
            raise MissingWeightsError(_missing_message(self.missing, offline=self.offline, reason=self.unreachable,
                                                       config_file=self.config_file))

    # -- the Hub -------------------------------------------------------------------------------
    def _snapshot(self, source: WeightSource, files: list[str], *, label: str) -> tuple[Path | None, str | None]:
        """The snapshot folder (downloading what the cache lacks, when allowed) and, if the Hub refused, why."""
        cached = self._cached_snapshot(source, files)
        complete = cached is not None and all(_present(cached, f) for f in files)
        if self.offline or self.unreachable is not None or (complete and _is_commit(source.revision)):
            return cached, None  # a pinned commit in the cache cannot have changed: no network needed
        if not self._reachable(source, files):
            if complete:
                logger.warning("%s: %s; using the cached %s", label, self.unreachable, source.describe())
            return cached, None
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            path = huggingface_hub.snapshot_download(repo_id=source.repo, revision=source.revision,
                                                     allow_patterns=files, local_files_only=False)
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
            return cached, self._reason(err)
        return Path(path), None

    def _cached_snapshot(self, source: WeightSource, files: list[str]) -> Path | None:
        """The snapshot folder of ``source`` in the local Hugging Face cache, if there is one (no network)."""
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(huggingface_hub.snapshot_download(repo_id=source.repo, revision=source.revision,
                                                          allow_patterns=files, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            return None

    def _reachable(self, source: WeightSource, files: list[str]) -> bool:
        """One request, no retries: can the Hub be reached at all? (``snapshot_download`` retries each of
        its requests five times with backoff, ~25 s, when there is no network.)"""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        try:
            get_hf_file_metadata(hf_hub_url(source.repo, files[0], revision=source.revision), timeout=10)
        except Exception as err:  # noqa: BLE001 -- httpx, OSError, offline-mode errors: all mean "not reachable"
            if not _answered(err):
                self._mark_unreachable(err)
                return False
        return True

    def _reason(self, err: BaseException) -> str | None:
        """What the Hub answered (``None`` when it could not be reached: that is said once, for all files)."""
        if _answered(err):
            return f"{type(err).__name__}: {_first_line(err)}"
        self._mark_unreachable(err)
        return None

    def _mark_unreachable(self, err: BaseException) -> None:
        if self.unreachable is None:
            self.unreachable = f"the Hugging Face Hub could not be reached ({type(err).__name__}: {_first_line(err)})"
            logger.info("%s; using only the local cache from now on", self.unreachable)

    def _generated(self, kind: str) -> Path:
        """The generated folder of ``kind`` (``tiny``: ``self.generate`` when given; ``tiny-mv``: the multi-view
        demo's denoisers, always generated here)."""
        from pixal3d.tiny_weights import ensure_tiny_mv_weights, ensure_tiny_weights

        if kind == "tiny-mv":
            return ensure_tiny_mv_weights(cache_root() / "tiny")
        if self.generate is None:
            return ensure_tiny_weights(cache_root() / "tiny")
        return self.generate(cache_root() / "tiny")


def network_errors() -> tuple[type[BaseException], ...]:
    """What a request to the Hub raises when it could not be made or was refused: ``OSError`` (sockets, urllib,
    requests' ``ConnectionError``, the Hub's ``OfflineModeIsEnabled`` and ``HfHubHTTPError``) and the base error
    of the HTTP client huggingface_hub uses, found as ``HfHubHTTPError``'s own base class (httpx's ``HTTPError``
    in huggingface_hub 1 and 2, requests' before), not by its name: a client that changes needs no change here."""
    from huggingface_hub.errors import HfHubHTTPError

    client = [base for base in HfHubHTTPError.__mro__[1:] if base.__module__ != "builtins"]
    return (OSError, *client[:1])


def hub_error(err: BaseException, what: str) -> WeightsError:
    """One line for a failed request for ``what``: the Hub's answer (``HubAnswerError``: the status and its
    reason) or why it could not be reached (``HubUnreachableError``)."""
    if _answered(err):
        response = getattr(err, "response", None)
        status = getattr(response, "status_code", None)
        reason = getattr(response, "reason_phrase", None) or getattr(response, "reason", None) or ""
        answer = f"{status} {reason}".strip() if status is not None else _first_line(err)
        return HubAnswerError(f"the Hub answered {answer} for {what}")
    return HubUnreachableError(f"the Hugging Face Hub could not be reached for {what} ({type(err).__name__}: "
                               f"{_first_line(err)}); check the network (or HF_ENDPOINT) and run it again")


def _answered(err: BaseException) -> bool:
    """The Hub answered (an HTTP error such as 404 or 401): it is reachable, the request was wrong."""
    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(err, HfHubHTTPError)


def _is_commit(revision: str | None) -> bool:
    return revision is not None and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision.lower())


def _present(folder: Path, pattern: str) -> bool:
    if any(ch in pattern for ch in "*?["):
        return any(folder.glob(pattern))
    return (folder / pattern).is_file()


def merged_missing(missing: list[_Missing]) -> list[_Missing]:
    """One entry per source (and reason for expecting the files), each file once, in a stable order."""
    merged: dict[tuple[int, str | None], _Missing] = {}
    for entry in missing:
        kept = merged.setdefault((id(entry.source), entry.note),
                                 _Missing(entry.source, entry.label, [], entry.folder, note=entry.note))
        kept.files += [f for f in entry.files if f not in kept.files]
        kept.reason = kept.reason or entry.reason
        kept.folder = kept.folder or entry.folder
    for entry in merged.values():
        entry.files.sort()
    return list(merged.values())


def fetch_command(config_file: str | None) -> str:
    """The one command that downloads everything a config needs."""
    return shlex.join(["pixal3d-fetch", "--config", config_file]) if config_file else "pixal3d-fetch --config CONFIG"


def _missing_message(missing: list[_Missing], *, offline: bool, reason: str | None = None,
                     config_file: str | None = None) -> str:
    """Every missing file on its own line (by source), why, the commands per source, then the one command."""
    entries = merged_missing(missing)
    count = sum(len(e.files) for e in entries)
    files = "1 file a run needs is" if count == 1 else f"{count} files a run needs are"
    lines = [f"missing weights: {files} not on this machine"]
    shown: set[int] = set()
    for entry in entries:
        if id(entry.source) not in shown:  # one heading per source, then its files (found missing or expected)
            shown.add(id(entry.source))
            folder = next((e.folder for e in entries if e.source is entry.source and e.folder is not None), None)
            where = f" (in {folder})" if folder is not None and entry.source.local is None else ""
            lines.append(f"  {entry.label} from {entry.source.describe()}{where}:")
            for same in (e for e in entries if e.source is entry.source):
                why = f" ({same.note})" if same.note else ""
                answer = f" [{same.reason}]" if same.reason else ""
                lines += [f"    {name}{why}{answer}" for name in same.files]
    if reason:
        lines.append(reason)
    if any(e.source.repo is not None for e in entries):
        if offline:
            lines.append("HF_HUB_OFFLINE is set, so only the local cache was searched")
        elif reason:
            lines.append("set HF_HUB_OFFLINE=1 to skip the network")
    fixes = dict.fromkeys(_fix(entry, offline=offline) for entry in merged_missing(
        [_Missing(e.source, e.label, e.files, e.folder) for e in entries]))
    lines += list(fixes)
    if any(e.source.repo is not None or e.source.url is not None for e in entries):
        lines.append(f"fetch everything this config needs with: {fetch_command(config_file)}")
    return "\n".join(lines)


def _fix(entry: _Missing, *, offline: bool) -> str:
    source = entry.source
    if source.repo is not None:
        command = ["hf", "download", source.repo, *entry.files]
        if source.revision:
            command += ["--revision", source.revision]
        return f"or this source alone ({'online' if offline else 'with network access'}): {shlex.join(command)}"
    if source.url is not None:
        target = cache_root() / "downloads" / str(source.filename)
        return f"or this file alone: curl -L -o {shlex.quote(str(target))} {shlex.quote(source.url)}"
    if source.local is not None:
        return "put the files there or point the config at the folder that holds them"
    return f"delete {entry.folder.parent if entry.folder else cache_root() / 'tiny'} and run again to regenerate it"


def _download_url(url: str, target: Path, *, progress: bool = False) -> None:
    """Download ``url`` to ``target`` through a ``.part`` file that a later call resumes (an HTTP range
    request); the size is checked against the server's ``Content-Length``. A failure is one line:
    ``HubAnswerError`` (the server answered an error), ``HubUnreachableError`` (it could not be reached; the
    ``.part`` stays for the next run), ``CorruptWeightsError`` (fewer bytes than announced: removed)."""
    import urllib.error
    import urllib.request

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    done = tmp.stat().st_size if tmp.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={done}-"} if done else {})
    logger.info("downloading %s to %s%s", url, target, f" (resuming after {done} bytes)" if done else "")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status = getattr(response, "status", 200)
            if done and status != 206:  # the server ignored the range: start again
                done = 0
            length = response.headers.get("Content-Length")
            expected = done + int(length) if length is not None else None
            bar = _progress_bar(progress, expected, done, target.name)
            with open(tmp, "ab" if done else "wb") as out:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            if bar is not None:
                bar.close()
    except urllib.error.HTTPError as err:  # the server answered: the .part (if any) stays
        raise HubAnswerError(f"{url} answered {err.code} {err.reason} for {target.name}") from None
    except OSError as err:  # not reached, or cut off: the .part stays, the next run resumes it
        raise HubUnreachableError(f"could not download {target.name} from {url} ({_first_line(err)}); check the "
                                  f"network and run it again (the partial file is resumed)") from None
    got = tmp.stat().st_size
    if expected is not None and got != expected:
        tmp.unlink()
        raise CorruptWeightsError(f"the download of {target.name} from {url} has {got} bytes, but the server "
                                  f"announced {expected}; it was removed, run it again")
    tmp.replace(target)


def _progress_bar(enabled: bool, total: int | None, done: int, name: str) -> Any:
    """A tqdm byte bar on stderr when ``enabled`` (else ``None``)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=name)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


# -- safetensors ---------------------------------------------------------------------------------

def read_safetensors_header(path: str | Path, *, source: WeightSource | None = None) -> dict[str, Any]:
    """The tensors of a safetensors file's header (name → dtype, shape, offsets), after checking the file
    is complete; ``MissingWeightsError`` / ``CorruptWeightsError`` say what is wrong and what to do, which
    depends on where the file came from (``source``: downloaded, a folder of the user's, generated)."""
    try:
        return _read_header(path).tensors
    except SafetensorsHeaderError as err:
        if err.problem == "missing":
            raise MissingWeightsError(str(err)) from None
        if source is not None and source.generate is not None:
            folder = _generated_folder(Path(path))
            raise CorruptWeightsError(f"{err}; delete {folder} and run again to regenerate it") from None
        if source is not None and source.local is not None:
            raise CorruptWeightsError(f"{err}; replace it with a complete copy (delete it and download it "
                                      f"again into {source.local})") from None
        if err.problem == "lfs-pointer":
            raise CorruptWeightsError(f"{err}; download the real file (hf download, or git lfs pull)") from None
        raise CorruptWeightsError(f"{err}; delete it and download it again") from None


def _tensor_bytes(tensors: dict[str, Any]) -> dict[str, int]:
    """Name -> bytes of every tensor, from header offsets."""
    return {name: int(info["data_offsets"][1]) - int(info["data_offsets"][0]) for name, info in tensors.items()}


def verify_safetensors(path: str | Path, *, source: WeightSource | None = None) -> int:
    """Check ``path`` is a complete safetensors file; return its tensor bytes."""
    return max((int(v["data_offsets"][1]) for v in read_safetensors_header(path, source=source).values()),
               default=0)


def _generated_folder(path: Path) -> Path:
    """The generated version folder (``<cache>/tiny/tiny-vN``) holding ``path``."""
    for parent in path.parents:
        if parent.parent.name == "tiny":
            return parent
    return path.parent
