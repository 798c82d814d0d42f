"""Issue 30, item 4: the command answers at once. ``--help`` and ``--plan`` (weights cached) import none of the
libraries that cost seconds and that only a run needs: transformers' modeling code (DINOv3 is built at the run),
trimesh, scipy's spatial/ndimage/sparse parts and the mesh export code (pixal3d.mesh.export: the config and the
stage records need only its settings and records, pixal3d.mesh.settings/records), gradio (the web app). A fresh interpreter each, as a
user's command starts; the per-module costs are measured with ``python -X importtime`` (docs/troubleshooting.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401

HEAVY = ("transformers", "trimesh", "gradio", "scipy.spatial", "scipy.ndimage", "scipy.sparse", "pixal3d.mesh.export")

COMMAND = """
    import json, sys
    from pipelines import cli
    try:
        code = cli.main(sys.argv[1:])
    except SystemExit as stop:
        code = stop.code
    print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def _imports(*argv: str, cache) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(COMMAND), *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(cache)})
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], [EXAMPLE, "--config", TINY_CONFIG, "--plan"],
                                  [EXAMPLE, "--config", TINY_CONFIG, "--plan", "--quiet"]],
                         ids=["help", "plan", "plan-quiet"])
def test_help_and_plan_import_no_library_only_a_run_needs(argv, tiny_cache, tmp_path):
    report = _imports(*argv, "-o", tmp_path / "o.glb", cache=tiny_cache) if argv != ["--help"] else \
        _imports(*argv, cache=tiny_cache)
    assert report["code"] == 0 and report["heavy"] == [], report


def test_control_a_run_does_import_them(tiny_cache, tmp_path):
    """The check can fail: the same probe after building the pipeline (DINOv3 loaded) sees transformers."""
    probe = """
        import sys
        from pipelines import Pixal3D
        with Pixal3D.from_config(sys.argv[1], device="cpu", until="structure") as pipe:
            pipe.run(sys.argv[2])
        print("transformers" in sys.modules)
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(probe), str(TINY_CONFIG), str(EXAMPLE)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(tiny_cache)})
    assert proc.stdout.strip().splitlines()[-1] == "True", proc.stderr


TORCH_PROBE = """
    import json, sys
    from pipelines import cli
    try:
        code = cli.main(sys.argv[1:])
    except SystemExit as stop:
        code = stop.code
    print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def _torch_imported(*argv: str, cache) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(TORCH_PROBE), *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(cache)})
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--no-such-flag"]], ids=["help", "usage-error"])
def test_help_and_a_usage_error_import_no_torch(argv, tiny_cache):
    """The parser (pipelines/cli_args.py) answers before the command's body, and torch, are imported."""
    report = _torch_imported(*argv, cache=tiny_cache)
    assert report == {"code": 0 if argv == ["--help"] else 2, "torch": False}, report


def test_control_a_plan_does_import_torch(tiny_cache, tmp_path):
    """The probe can fail: past the parser, the same probe sees torch."""
    report = _torch_imported(EXAMPLE, "--config", TINY_CONFIG, "--plan", "-o", tmp_path / "o.glb", cache=tiny_cache)
    assert report == {"code": 0, "torch": True}, report


def test_the_parsers_policies_are_the_libraries():
    """cli_args writes Policy's values out (no torch for --help): they must stay the same."""
    from pipelines.cli_args import POLICIES
    from pixal3d.staging import Policy

    assert POLICIES == tuple(p.value for p in Policy)
