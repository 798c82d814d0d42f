"""Issue 38: one home for what a kind of device means (``pixal3d/devices.py``): the attention route and its array
limit, MoGe-2's float16 default, the MPS allocator limit, the distributed backend, a rank's device, which devices
exist. The answers are those the ``device.type`` branches gave, for each kind; no such branch is left outside
``pixal3d/devices.py`` (and ``pixal3d.staging``, which imports nothing from the rest of the package)."""
from __future__ import annotations

import ast
import shutil

import pytest
import torch

from pipelines.camera import moge_fp16
from pixal3d import devices
from pixal3d.devices import DeviceError, check_device, default_device, kind, rank_device
from pixal3d.nn.attention import auto_query_chunk, device_array_bytes, resolve_route
from tests.support.cascade_fixtures import REPO

ALLOWED = {
    "pipelines/loaders.py": "copied weights: whether the bytes are the process's own (a CPU tensor), not a kind's fact",
    "pipelines/state_codec.py": "where one stored tensor lives (the CPU or the run's device)",
    "pixal3d/telemetry/device.py": "which torch API reads a device's memory counters: pixal3d.telemetry, like "
                                   "pixal3d.staging, imports nothing from the rest of the package",
}
"""Modules whose device-kind comparison is about where a tensor is, or that must not import ``pixal3d.devices``."""
BACKENDS = {"nccl", "gloo"}
DEVICE_PROBES = {"is_available", "is_initialized", "device_count"}
"""``torch.cuda.is_available()`` and its kin: which devices exist, or hold a context, is ``devices.py``'s to say."""


@pytest.mark.parametrize("name, route, array, half, backend, limit", [
    ("cpu", "sdpa", None, False, "gloo", False),
    ("cuda", "sdpa", None, True, "nccl", False),
    ("mps", "fp32_chunked", 2**32, True, "gloo", True),
    ("meta", "sdpa", None, True, "gloo", False),
])
def test_each_kind_answers_as_its_branch_did(name, route, array, half, backend, limit):
    device = torch.device(name)
    assert resolve_route("auto", device) == route and resolve_route("sdpa", device) == "sdpa"
    assert device_array_bytes(device) == array and kind(device).array_bytes == array
    assert moge_fp16("auto", device) is half and moge_fp16("float16", device) and not moge_fp16("float32", device)
    assert kind(device).backend == backend and kind(device).memory_limit is limit


def test_attention_chunks_its_queries_except_where_fused_kernels_stream_them():
    q = torch.zeros(1, 1, 4096, 8)
    assert auto_query_chunk(q, torch.zeros(1, 1, 2**20, 8)) is not None  # the CPU: chunked
    assert kind("cuda").fused_attention and not kind("cpu").fused_attention and not kind("mps").fused_attention


def test_which_devices_exist_and_which_one_a_process_or_a_rank_takes():
    assert check_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(DeviceError, match="there is one cpu device, 'cpu'"):
        check_device(torch.device("cpu", 1))
    with pytest.raises(DeviceError, match="only cpu, cuda, mps are supported"):
        check_device(torch.device("meta"))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="asks for CUDA, which this torch build or machine does not have"):
            check_device(torch.device("cuda"))
        assert default_device() == default_device(("cuda", "cpu"), 3) == torch.device("cpu") or \
            torch.backends.mps.is_available()
    assert rank_device(torch.device("cuda"), 2) == torch.device("cuda", 2)  # one GPU per rank
    assert rank_device(torch.device("cuda", 0), 2) == torch.device("cuda", 0)  # given: kept
    assert rank_device(torch.device("cpu"), 2) == torch.device("cpu")  # shared by the machine's ranks


def device_type_branches(root) -> list[str]:
    """``path:line`` of every branch on a kind of device outside ``pixal3d/devices.py``, ``pixal3d/staging/`` and
    ``pixal3d/audit/`` (the stand-in device's own code): a comparison of anything (``device.type``, a variable
    holding it, a backend) with a device type's or a distributed backend's name, a ``startswith`` of one, and a
    probe of which devices exist (``torch.cuda.is_available()``)."""
    names = set(devices.KINDS) | {"meta"} | BACKENDS
    found = []
    for package in ("pixal3d", "pipelines"):
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative == "pixal3d/devices.py" or relative.startswith(("pixal3d/staging/", "pixal3d/audit/")) or \
                    relative in ALLOWED:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if _branches_on_a_kind(node, names):
                    found.append(f"{relative}:{node.lineno}")
    return found


def _branches_on_a_kind(node: ast.AST, names: set[str]) -> bool:
    values: list[ast.expr] = []
    if isinstance(node, ast.Compare):
        for side in (node.left, *node.comparators):
            values += side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "startswith":
            values = list(node.args)
        elif node.func.attr in DEVICE_PROBES:  # torch.cuda.is_available(), torch.backends.mps.is_available(), ...
            return any(f".{name}." in ast.unparse(node.func) for name in devices.KINDS)
    return any(isinstance(v, ast.Constant) and v.value in names for v in values)


def test_no_device_type_branch_is_left_outside_the_devices_module():
    assert device_type_branches(REPO) == []


def test_control_a_device_type_branch_added_back_is_found(tmp_path):
    for package in ("pixal3d", "pipelines"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    camera = tmp_path / "pipelines" / "camera.py"
    camera.write_text(camera.read_text() + "\n\ndef _late(device):\n    return device.type in ('mps', 'cuda')\n")
    telemetry = tmp_path / "pixal3d" / "telemetry" / "meter.py"  # the forms the old test missed (issue 47)
    telemetry.write_text(telemetry.read_text() + "\n\ndef _late(kind):\n    return kind == 'cuda'\n")
    runtime = tmp_path / "pixal3d" / "parallel" / "runtime.py"
    runtime.write_text(runtime.read_text() + "\n\ndef _late(backend):\n    return backend == 'nccl'\n")
    mesh = tmp_path / "pixal3d" / "mesh" / "isolated.py"
    mesh.write_text(mesh.read_text() + "\n\ndef _late():\n    return torch.cuda.is_available()\n")
    found = device_type_branches(tmp_path)
    assert sorted(f.split(":")[0] for f in found) == ["pipelines/camera.py", "pixal3d/mesh/isolated.py",
                                                      "pixal3d/parallel/runtime.py", "pixal3d/telemetry/meter.py"]
