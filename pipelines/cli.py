"""``pixal3d-image-to-mesh``: one image (or several, or a folder) in, one textured GLB per image out.

    pixal3d-image-to-mesh input.png [-o out.glb] [--config configs/1024_cascade.yaml] [--seed N]
        [--fov DEG] [--memory-policy auto|staged|resident|offload|eager] [--memory-budget SIZE] [--device D]
        [--trace trace.jsonl] [--plan] [--keep-latents DIR] [--batch-order image|stage] [--work-dir DIR] [--quiet]
        [--parallel none|cfg|pipefusion|both|data [--pp N] [--pp-split auto|B1,B2,...] [--patches M] [--warmup W]
         [--parallel-timeout S]]

One path: the command checks its inputs, outputs and options before any weight is read, prints the memory
plan and the chosen policy (``--plan`` prints them and exits), then hands every usable input to
``Pixal3D.run_batch`` (one input is a batch of one) with the seed and field of view, and writes each
image's GLB, ``<output>.run.json`` and latents as it comes, with its per-stage table (``Result.table``).
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

from collections.abc import Sequence
from typing import Any

from .cli_args import DEFAULT_CONFIG, parse_args

__all__ = ["DEFAULT_CONFIG", "main", "parse_args"]


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code. The arguments are parsed before torch is imported."""
    args = parse_args(argv)
    from . import command

    return command.run(args, argv)


def __getattr__(name: str) -> Any:
    """The command's other names (``UsageError``, ``in_flags``, ...), from ``pipelines.command``."""
    if name.startswith("__"):
        raise AttributeError(name)
    from . import command

    return getattr(command, name)


if __name__ == "__main__":
    raise SystemExit(main())
