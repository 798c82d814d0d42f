"""What a killed earlier run left behind, found and removed before a run writes to the same places.

A SIGKILL or a power loss skips every ``finally``: the temporary files of an atomic write (``.a.glb.x1y2.tmp``,
``pixal3d.files``), the lock files of the outputs and of the work directory (``pixal3d.locks``) and, killed
between the renames of an image's group, a run.json whose GLB never appeared. None of them is ever mistaken
for an output (hidden names; a run.json without its GLB counts as absent: the GLB is the group's commit
point), but they would stay for good. ``clean_leftovers`` removes them, and is called only by a run that holds
the locks of the paths concerned, so nothing it removes can belong to a live run: a temporary file beside a
locked target is only ever made by that target's writer, and a lock file is removed only when nobody holds it.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pixal3d.files import leftover_temporaries
from pixal3d.locks import remove_if_stale

from .result import run_json_path


def clean_leftovers(outputs: Sequence[Path], *, latents: Sequence[Path] = (), work_dir: Path | None = None,
                    temporaries: bool = True) -> list[Path]:
    """Remove what a killed run left for these outputs (their temporary files, a run.json without its GLB),
    for these latents files, in the outputs' folders (output locks nobody holds) and in ``work_dir`` (temporary
    files of its records); return the paths removed. The caller holds the locks of ``outputs`` and of
    ``work_dir``. (``batch.json``'s temporary file is left alone: no lock says whether another batch writing to
    the same folder is writing it now.) ``temporaries=False``: only the lock files, for a caller whose locks do not
    keep other writers away (a ``--parallel data`` job's other groups write the same outputs)."""
    found: list[Path] = []
    for output in outputs if temporaries else ():
        record = run_json_path(output)
        found += leftover_temporaries(output) + leftover_temporaries(record)
        if record.is_file() and not output.exists():  # killed between the record's rename and the GLB's
            found.append(record)
    for path in latents if temporaries else ():
        found += leftover_temporaries(path)
    if temporaries and work_dir is not None and work_dir.is_dir():
        found += sorted(work_dir.glob(".*.tmp")) + sorted(work_dir.glob("*/.*.tmp"))
    removed = []
    for path in dict.fromkeys(found):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    for folder in dict.fromkeys(output.parent for output in outputs):
        try:
            locks = sorted(p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".glb.lock"))
        except OSError:
            continue
        removed += [lock for lock in locks if remove_if_stale(lock)]
    return removed


def cleaned_line(removed: Sequence[Path]) -> str:
    """One line saying what was removed (the names, and their folders once each)."""
    folders = ", ".join(str(f) for f in dict.fromkeys(p.parent for p in removed))
    names = ", ".join(p.name for p in removed)
    return (f"removed {len(removed)} file{'s' if len(removed) != 1 else ''} a killed earlier run left "
            f"({names}) in {folders}")
