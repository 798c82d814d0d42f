"""The options of ``pixal3d-image-to-mesh``, importing nothing heavy: ``--help`` and a usage error answer at once,
before torch loads (``pipelines.cli`` imports the command's body only after parsing)."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .job import DEFAULT_CONFIG, POLICIES, SETTINGS

__all__ = ["DEFAULT_CONFIG", "POLICIES", "parse_args"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command's arguments (``argparse`` exits with its usage line on an error, and after ``--help``)."""
    parser = argparse.ArgumentParser(prog="pixal3d-image-to-mesh", allow_abbrev=False,
                                     description="Pixal3D image → textured 3D mesh (GLB), staged for memory.")
    parser.add_argument("inputs", nargs="*", type=Path, help="image file(s) or folder(s) of images")
    parser.add_argument("--views", nargs="+", type=Path, default=None, metavar="DIR",
                        help="posed views instead of images: folder(s) holding a transforms.json and the view images "
                             "(docs/views.md); default config 1024_cascade_mv")
    parser.add_argument("--mesh", action="append", type=Path, default=None, metavar="MESH",
                        help="texture this mesh (GLB, OBJ or PLY) from the image instead of generating one; its "
                             "vertices and faces are kept, its UVs too when it has them (docs/mesh-input.md)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="output .glb (one input) or folder (several); default outputs/<name>.glb")
    parser.add_argument("--config", type=Path, default=None,
                        help="cascade config: a file, or a shipped one by name (default: 1024_cascade, or "
                             "1024_cascade_mv with --views; tiny and tiny_mv are the offline demos)")
    for setting in SETTINGS:  # the job's settings (pipelines/job.py), as the app and the server take them too
        if setting.kind == "flag":  # a switch: given, or unset (None: the job's default)
            parser.add_argument(setting.flag, dest=setting.name, action="store_true", default=None, help=setting.help)
            continue
        parser.add_argument(setting.flag, dest=setting.name, default=None, metavar=setting.metavar,
                            type={"int": int, "float": float}.get(setting.kind, str), help=setting.help,
                            choices=setting.choices() if setting.choices is not None else None)
    parser.add_argument("--device", default=None, help="torch device (default: cuda, else mps, else cpu)")
    parser.add_argument("--trace", type=Path, default=None, help="write the memory trace (JSONL) here")
    parser.add_argument("--plan", action="store_true", help="print the memory plan and policy, then exit")
    parser.add_argument("--keep-latents", type=Path, default=None, metavar="DIR",
                        help="also save each run's coords and latents to DIR/<name>.latents.pt")
    parser.add_argument("--batch-order", choices=("image", "stage"), default=None,
                        help="several inputs: each image through every stage, or each stage over every image (loads "
                             "each model once per batch); default: stage under staged/offload, image otherwise")
    parser.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                        help="keep every stage's outputs in DIR as it finishes; the same command run again resumes")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, plan or table")
    group = parser.add_argument_group("several devices (under torchrun; docs/parallel.md)")
    group.add_argument("--parallel", default="none", choices=["none", "cfg", "pipefusion", "both", "data"],
                       help="spread the flow stages over torchrun's processes: cfg (2, exact), pipefusion (N, "
                            "approximate unless --warmup >= steps or --patches 1), both (2 x N); or spread a batch's "
                            "images over them: data (each process runs its share of the images); default none")
    group.add_argument("--pp", type=int, default=None, metavar="N",
                       help="pipefusion/both: pipeline ranks per flow model (default: the processes torchrun "
                            "started, halved for both)")
    group.add_argument("--pp-split", default=None, metavar="auto|B1,B2,...",
                       help="pipefusion/both: blocks per pipeline rank, e.g. 1,3, or auto (in proportion to each "
                            "rank's usable memory); default near-equal")
    group.add_argument("--patches", type=int, default=None, metavar="M",
                       help="pipefusion/both: token patches per step (default: N)")
    group.add_argument("--warmup", type=int, default=None, metavar="W",
                       help="pipefusion/both: leading steps run synchronously, exact (default 1)")
    group.add_argument("--data-groups", type=int, default=None, metavar="K",
                       help="cfg/pipefusion/both: K groups of the processes, each its own cfg/pipefusion job on its "
                            "share of a batch's images (K x 2 x N processes; --work-dir: groups claim images); "
                            "default 1")
    group.add_argument("--parallel-timeout", type=float, default=600.0, metavar="S",
                       help="longest wait for another rank before every rank stops with an error (default 600; "
                            "raise it when rank 0's decode and export take longer)")
    return parser.parse_args(argv)
