"""``pixal3d-image-to-mesh``: one image (or several, or a folder) in, one textured GLB per image out.

    pixal3d-image-to-mesh input.png [-o out.glb] [--config configs/1024_cascade.yaml] [--seed N]
        [--fov DEG] [--memory-policy auto|staged|resident|offload|eager] [--memory-budget SIZE] [--device D]
        [--trace trace.jsonl] [--plan] [--keep-latents DIR] [--batch-order image|stage] [--work-dir DIR] [--quiet]
        [--parallel none|cfg|pipefusion|both|data [--pp N] [--pp-split auto|B1,B2,...] [--patches M] [--warmup W]
         [--parallel-timeout S]]

A front end beside the web app and the job server, over the same floor: the options make a job
(``pipelines.job.Job.from_args``; the settings' options come from ``pipelines.job.SETTINGS``), the process role under
torchrun is decided once (``pipelines.launch``) and the run goes through a session (``pipelines.session``). One path:
the command checks its inputs, outputs and options before any weight is read, prints the memory plan and the
chosen policy (``--plan`` prints them and exits), then hands every usable input to ``Pixal3D.run_batch`` (one
input is a batch of one) with the seed and field of view, and writes each image's GLB, ``<output>.run.json`` and
latents as it comes (``Session.write``), with its per-stage table (``Result.table``).
Errors a user can cause (``pipelines.errors.classify``) print one line on stderr, naming the library's
settings by their flags (``in_flags``), and exit non-zero (2 before the run starts, 1 during it,
130/143/129 when SIGINT/SIGTERM/SIGHUP stop it). The GLB, its run.json and its latents appear together or not at all; no partial or
temporary file is ever left. After a SIGKILL or a power loss the GLB still never appears without its record (it is
renamed last: ``Result.save_outputs``), and the next run over the same outputs removes what the killed one left
(``pipelines/leftovers.py``) and says so in one line.

Several inputs (or a folder) are a batch (``pipelines.batch``): stage by stage under staged/offload, so each
model loads once per batch. An input that is not a usable image is reported in one line and skipped, the
others are written; a summary line and ``batch.json`` beside the outputs end it, and the exit code is 1 when
any image failed. With ``--work-dir`` every stage's outputs are kept as they finish: the same command run
again resumes where it stopped, also after a SIGKILL.

Under torchrun, ``--parallel`` spreads the flow stages over the job's processes. Every rank joins the job
before it reads a config or a weight (a failure after that reaches every rank); rank 0 runs the command as
above, image by image; the other ranks plan their part and follow it (``Pixal3D.follow``), writing nothing.
An error every rank sees alike is printed by rank 0 only, any other by the rank that has it.
``--pp-split`` gives PipeFusion's blocks per pipeline rank (``auto``: in proportion to each rank's memory).

``--parallel data`` spreads a batch's images over the job's processes instead (``pipelines.data_parallel``):
each rank runs the command on its share (claimed in a shared ``--work-dir`` as it goes, else image i to rank
i mod K), rank 0 writes the one summary and ``batch.json``, and every rank exits with rank 0's code.
"""
from __future__ import annotations

import gc
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli_args import DEFAULT_CONFIG, parse_args
from .job import BY_NAME

if TYPE_CHECKING:
    from .errors import Failure

__all__ = ["DEFAULT_CONFIG", "CommandVoice", "in_flags", "main", "parse_args"]

PROG = "pixal3d-image-to-mesh"
OUR_LOGGERS = ("pixal3d", "pipelines", PROG)
FLAGS = {"memory_budget": "--memory-budget", "policy": "--memory-policy", "seed": "--seed", "fov": "--fov",
         "num_views": "--num-views",
         "work_dir": "--work-dir", "mode": "--parallel", "pp": "--pp", "patches": "--patches", "warmup": "--warmup",
         "pp_split": "--pp-split", "data_groups": "--data-groups"}
"""The command's flag for each library setting: library messages name a setting ``name=value`` (or, for one with
an underscore, by its name), an error about one setting carries it (``SettingError.setting``; a job setting's
flag is its row's in ``pipelines.job.SETTINGS``)."""
_VALUED = re.compile(rf"\b({'|'.join(FLAGS)})=([^\s,;:)]*)")
_NAMED = re.compile(rf"\b({'|'.join(name for name in FLAGS if '_' in name)})\b(?!=)")
_log_handler: logging.Handler | None = None


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code. The arguments are parsed before torch is imported."""
    args = parse_args(argv)
    _configure_logging(quiet=args.quiet)
    if args.quiet:
        _quiet_transformers()
    from .job import Job
    from .launch import launch, refused

    # Freeze what the imports created (torch, transformers: millions of objects) so the gc.collect
    # that every model release runs scans only the run's own objects (0.5 s → ~0.01 s per release).
    gc.freeze()
    voice = CommandVoice()
    try:
        job = Job.from_args(args, command=command_as_typed(argv))
    except Exception as err:  # noqa: BLE001 - the voice's classify decides; a refusal every rank makes alike
        return refused(err, voice)
    return launch(job, voice)


def in_flags(text: str) -> str:
    """Library words in the command's: ``warmup=2`` becomes ``--warmup 2``, ``memory_budget`` ``--memory-budget``."""
    text = _VALUED.sub(lambda m: f"{FLAGS[m[1]]} {m[2]}".rstrip(), text)
    return _NAMED.sub(lambda m: FLAGS[m[1]], text)


class CommandVoice:
    """What the command says (``pipelines.launch.Voice``): the plan, tables and summary on stdout, one error line
    and notes on stderr, the library's settings named by their flags."""

    name = "cli"

    def failure(self, err: BaseException, *, started: bool) -> Failure | None:
        """``classify`` in the command's words (``in_flags``), an error about one setting prefixed by its flag."""
        from .errors import classify

        failure = classify(err, started=started)
        if failure is None:
            return None
        setting = getattr(err, "setting", None)
        flag = BY_NAME[setting].flag if setting in BY_NAME else FLAGS.get(setting)
        return replace(failure, message=(f"{flag}: " if flag else "") + in_flags(failure.message))

    def words(self, text: str) -> str:
        return in_flags(text)

    def error(self, message: str) -> None:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    def say(self, text: str, *, failed: bool = False) -> None:
        print(text, file=sys.stderr if failed else sys.stdout, flush=True)


def command_as_typed(argv: Sequence[str] | None = None) -> list[str]:
    """run.json's and batch.json's ``command``: the program as the user started it (``python
    scripts/image_to_mesh.py``, ``pixal3d-image-to-mesh``, ``python -m pipelines.cli``) and its arguments, so
    pasting it runs the same thing; ``main(argv)`` called from Python is recorded under the command's name."""
    if argv is not None:
        return [PROG, *argv]
    program = sys.argv[0]
    if program and Path(program).resolve() == Path(__file__).resolve():
        head = ["python", "-m", "pipelines.cli"]
    elif program.endswith(".py"):
        head = ["python", program]
    else:
        head = [Path(program).name or PROG]
    return [*head, *sys.argv[1:]]


def _quiet_transformers() -> None:
    """Silence transformers' "Loading weights" bar (it ignores our --quiet) without importing transformers, whose
    modeling code costs seconds that ``--plan`` never needs: it reads huggingface_hub's switch when imported."""
    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.disable_progress_bar()
    else:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _configure_logging(*, quiet: bool) -> None:
    """One stderr handler on our own loggers (warnings; errors only with --quiet). Library loggers
    (huggingface_hub, transformers, ...) keep their own configuration: the root logger is left alone."""
    global _log_handler
    if _log_handler is None:
        _log_handler = _StderrHandler()
        _log_handler.setFormatter(_InFlags("pixal3d: %(levelname)s: %(message)s"))
        for name in OUR_LOGGERS:
            logging.getLogger(name).addHandler(_log_handler)
    _log_handler.setLevel(logging.ERROR if quiet else logging.WARNING)


class _InFlags(logging.Formatter):
    """Log lines in the command's words (``in_flags``)."""

    def format(self, record: logging.LogRecord) -> str:
        return in_flags(super().format(record))


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is when a record comes (tests and embedding
    programs replace it between calls)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
