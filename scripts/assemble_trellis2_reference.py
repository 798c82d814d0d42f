"""Assemble TRELLIS.2's texturing code for the parity test (tests/pixal3d/models/test_texturing_reference_parity.py).

Copies, byte for byte, the files of TRELLIS.2 that ``Trellis2TexturingPipeline``'s shape encoding, texture sampling
and texture decoding run (``FILES``, from a git repository at ``--commit`` or from a plain checkout), and writes small
stand-ins (``STAND_INS``) for what those files import but that needs CUDA or is not installed here, or that the
path does not use. No network: ``--source`` is a local clone (bare or not, e.g. a mirror) or a checkout folder.

    python scripts/assemble_trellis2_reference.py --out /work/refs/trellis2-tex \\
        [--source /work/.mirror/microsoft+TRELLIS.2/repo] [--commit 5565d24]

The folder is never part of this repository. Then:

    PIXAL3D_TRELLIS2_REFERENCE=/work/refs/trellis2-tex python -m pytest -q \\
        tests/pixal3d/models/test_texturing_reference_parity.py
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

COMMIT = "5565d24"
DEFAULT_SOURCE = Path("/work/.mirror/microsoft+TRELLIS.2/repo")

FILES = (
    "trellis2/pipelines/__init__.py",
    "trellis2/pipelines/base.py",
    "trellis2/pipelines/trellis2_texturing.py",
    "trellis2/pipelines/samplers/__init__.py",
    "trellis2/pipelines/samplers/base.py",
    "trellis2/pipelines/samplers/flow_euler.py",
    "trellis2/pipelines/samplers/classifier_free_guidance_mixin.py",
    "trellis2/pipelines/samplers/guidance_interval_mixin.py",
    "trellis2/models/__init__.py",
    "trellis2/models/sc_vaes/sparse_unet_vae.py",
    "trellis2/models/sc_vaes/fdg_vae.py",
    "trellis2/modules/norm.py",
    "trellis2/modules/utils.py",
    "trellis2/modules/sparse/__init__.py",
    "trellis2/modules/sparse/basic.py",
    "trellis2/modules/sparse/config.py",
    "trellis2/modules/sparse/linear.py",
    "trellis2/modules/sparse/spatial/__init__.py",
    "trellis2/modules/sparse/spatial/basic.py",
    "trellis2/modules/sparse/spatial/spatial2channel.py",
    "trellis2/modules/sparse/conv/__init__.py",
    "trellis2/modules/sparse/conv/config.py",
    "trellis2/modules/sparse/conv/conv.py",
    "trellis2/modules/sparse/conv/conv_flex_gemm.py",
)
"""TRELLIS.2's own files, copied unchanged (paths in its repository)."""

_FLEX_GEMM_SPCONV = '''"""Stand-in for FlexGEMM's submanifold convolution (CUDA): this project's kernel computes it.

Same call and weight layout as ``flex_gemm.ops.spconv.sparse_submanifold_conv3d`` (``weight [Co, Kd, Kh, Kw, Ci]``,
kernel dims walking the coordinate columns x, y, z): TRELLIS.2's ``conv_flex_gemm.py`` calls it unchanged. The
neighbour cache it returns is the ``[N, V]`` map ``pixal3d.nn.sparse_conv`` builds; TRELLIS.2 keeps it in its
spatial cache and hands it back for the next convolution on the same scale, which this stand-in then uses.
"""
import torch

from pixal3d.nn.sparse_conv import neighbor_map, sparse_conv3d
from pixal3d.nn.sparse_tensor import SparseTensor


def set_algorithm(algorithm):
    pass


def set_hashmap_ratio(ratio):
    pass


def sparse_submanifold_conv3d(feats, coords, shape, weight, bias, neighbor_cache, dilation):
    if len(set(dilation)) != 1:
        raise NotImplementedError(f"stand-in: dilation {dilation} must be the same on every axis")
    d, kernel = dilation[0], tuple(weight.shape[1:4])
    x = SparseTensor(feats, coords.to(torch.int32))
    if neighbor_cache is not None:
        if neighbor_cache.shape[0] != feats.shape[0]:
            raise ValueError("stand-in: the neighbour cache TRELLIS.2 handed back is for another coordinate set")
        x.cache[f"submconv_neighbors_{kernel[0]}x{kernel[1]}x{kernel[2]}_d{d}"] = neighbor_cache
    out = sparse_conv3d(x, weight, bias, dilation=d)
    return out.feats, neighbor_map(x, kernel, d)
'''

_RAISES = '''

def {name}(*args, **kwargs):
    raise NotImplementedError("stand-in: {what} is not part of the texturing parity path")
'''

STAND_INS = {
    "trellis2/__init__.py": '"""Stand-in: empty (TRELLIS.2\'s imports every subpackage, renderers included)."""\n',
    "trellis2/modules/image_feature_extractor.py":
        '"""Stand-in: DINOv3 conditioning (torchvision, transformers) is not compared."""\n',
    "trellis2/pipelines/rembg/__init__.py": '"""Stand-in: background removal (BiRefNet) is not run."""\n',
    "trellis2/representations/__init__.py":
        '"""Stand-in: ``Mesh`` (only the shape decoder\'s forward builds one; not run)."""\n\n\n'
        'class Mesh:\n    def __init__(self, *args, **kwargs):\n'
        '        raise NotImplementedError("stand-in: trellis2.representations.Mesh is not run")\n',
    "o_voxel/__init__.py": '"""Stand-in for o_voxel (C++/CUDA): only ``convert``."""\nfrom . import convert\n',
    "o_voxel/convert/__init__.py":
        '"""Stand-in: the voxeliser. The parity test replaces ``mesh_to_flexible_dual_grid`` with one returning its\n'
        'dual grid (the voxeliser\'s own parity is tested elsewhere)."""\n'
        + _RAISES.format(name="mesh_to_flexible_dual_grid", what="o_voxel's voxeliser")
        + _RAISES.format(name="flexible_dual_grid_to_mesh", what="o_voxel's mesh extraction"),
    "flex_gemm/__init__.py": '"""Stand-in for FlexGEMM (CUDA)."""\nfrom . import ops\n',
    "flex_gemm/ops/__init__.py": "from . import grid_sample, spconv\n",
    "flex_gemm/ops/spconv.py": _FLEX_GEMM_SPCONV,
    "flex_gemm/ops/grid_sample.py": '"""Stand-in: the texture bake\'s trilinear sampling (not run)."""\n'
        + _RAISES.format(name="grid_sample_3d", what="FlexGEMM's grid_sample_3d"),
    "cumesh/__init__.py": '"""Stand-in for CuMesh (CUDA): UV unwrapping is not run."""\n',
    "nvdiffrast/__init__.py": '"""Stand-in for nvdiffrast (CUDA)."""\n',
    "nvdiffrast/torch.py": '"""Stand-in: rasterisation for the bake is not run."""\n',
    "cv2.py": '"""Stand-in for OpenCV: the texture\'s inpainting is not run."""\n',
    "easydict/__init__.py":
        '"""Stand-in for easydict: ``EasyDict``, a dict whose keys are attributes (the samplers\' return)."""\n\n\n'
        'class EasyDict(dict):\n    def __getattr__(self, name):\n        try:\n            return self[name]\n'
        '        except KeyError as error:\n            raise AttributeError(name) from error\n\n'
        '    def __setattr__(self, name, value):\n        self[name] = value\n',
}
"""Small files written in place of what the path imports but does not run (or needs CUDA for)."""


def read_source(source: Path, commit: str, path: str) -> bytes:
    """``path`` of TRELLIS.2 at ``commit`` from a git repository, or from a checkout folder without git."""
    if (source / "HEAD").is_file() or (source / ".git").exists():
        return subprocess.run(["git", "-C", str(source), "show", f"{commit}:{path}"], check=True,
                              capture_output=True).stdout
    return (source / path).read_bytes()


def resolved_commit(source: Path, commit: str) -> str:
    if (source / "HEAD").is_file() or (source / ".git").exists():
        return subprocess.run(["git", "-C", str(source), "rev-parse", commit], check=True, capture_output=True,
                              text=True).stdout.strip()
    return f"{commit} (not checked: a folder without git)"


def assemble(source: Path, out: Path, commit: str = COMMIT) -> Path:
    """Write ``FILES`` (from ``source`` at ``commit``) and ``STAND_INS`` into ``out``, with a README listing both."""
    out.mkdir(parents=True, exist_ok=True)
    for path in FILES:
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read_source(source, commit, path))
    for path, text in STAND_INS.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    full = resolved_commit(source, commit)
    lines = ["# TRELLIS.2's texturing code for Pixal3D's parity test\n",
             f"Assembled by scripts/assemble_trellis2_reference.py from {source} at {full}.\n",
             "## TRELLIS.2's files (unchanged)\n", *[f"- {p}" for p in FILES],
             "\n## Stand-ins (written by the script)\n", *[f"- {p}" for p in STAND_INS], ""]
    (out / "README.md").write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write (outside this repository)")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                        help=f"TRELLIS.2: a git repository (bare or not) or a checkout folder "
                             f"(default {DEFAULT_SOURCE})")
    parser.add_argument("--commit", default=COMMIT, help=f"the commit to read from a git source (default {COMMIT})")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    if args.out.resolve().is_relative_to(repo):
        parser.error(f"--out {args.out} is inside this repository; reference code lives outside it")
    if not args.source.exists():
        parser.error(f"--source {args.source} does not exist: give a clone or checkout of microsoft/TRELLIS.2")
    print(assemble(args.source, args.out, args.commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
