"""TRELLIS.2's own mesh → flexible dual grid converter, compiled on the fly, as the parity oracle for
``pixal3d.mesh.voxelize``.

The C++ source is ``o-voxel/src/convert/flexible_dual_grid.cpp`` (with its ``api.h``), read from
``PIXAL3D_TRELLIS2_SOURCE`` (a TRELLIS.2 checkout, or its bare git directory) or from the project's git mirror.
It needs Eigen's headers: ``PIXAL3D_EIGEN_INCLUDE``, else ``pip install cmeel-eigen`` (headers under
``site-packages/cmeel.prefix/include/eigen3``), else ``/usr/include/eigen3``. A shim of ours includes the
source and exposes two functions: the reference's entry point unchanged, and its three accumulation passes
(intersections, faces, boundary edges) with the per-voxel means, counts and QEF matrices they leave, so a test
can compare each stage bit for bit. Nothing here is a dependency of the package.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

SOURCE_FILES = ("flexible_dual_grid.cpp", "api.h")
SOURCE_DIR = "o-voxel/src/convert"
MIRROR = Path("/work/.mirror/microsoft+TRELLIS.2/repo")
HOW_TO = (
    "set PIXAL3D_TRELLIS2_SOURCE to a TRELLIS.2 checkout (git clone https://github.com/microsoft/TRELLIS.2) "
    "and make Eigen's headers findable (pip install cmeel-eigen, or PIXAL3D_EIGEN_INCLUDE=<dir with Eigen/Dense>)"
)

SHIM = r"""
#include "flexible_dual_grid.cpp"

// The reference's three accumulation passes, as its mesh_to_flexible_dual_grid_cpu runs them, stopped
// before the solve: voxels, means, counts, flags and the 4x4 QEF of every voxel.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> accumulate_qefs(
    const torch::Tensor& vertices, const torch::Tensor& faces, const torch::Tensor& voxel_size,
    const torch::Tensor& grid_range, bool faces_on, float boundary_weight
) {
    const int F = faces.size(0);
    const float* v = vertices.data_ptr<float>();
    const int* f = faces.data_ptr<int>();
    const float* vs = voxel_size.data_ptr<float>();
    const int* gr = grid_range.data_ptr<int>();
    Eigen::Vector3f e_vs(vs[0], vs[1], vs[2]);
    Eigen::Vector3i gmin(gr[0], gr[1], gr[2]), gmax(gr[3], gr[4], gr[5]);
    std::unordered_map<VoxelCoord, size_t> table;
    std::vector<int3> voxels;
    std::vector<Eigen::Vector3f> means;
    std::vector<float> cnt;
    std::vector<bool3> flags;
    std::vector<Eigen::Matrix4f> qefs;
    std::vector<Eigen::Vector3f> tris;
    for (int i = 0; i < F * 3; ++i) tris.emplace_back(v[f[i] * 3], v[f[i] * 3 + 1], v[f[i] * 3 + 2]);
    intersect_qef(e_vs, gmin, gmax, tris, table, voxels, means, cnt, flags, qefs);
    if (faces_on) face_qef(e_vs, gmin, gmax, tris, table, qefs);
    if (boundary_weight > 0.0f) {
        std::map<std::pair<int, int>, int> count;
        for (int i = 0; i < F; ++i)
            for (int k = 0; k < 3; ++k) {
                int a = f[i * 3 + k], b = f[i * 3 + (k + 1) % 3];
                count[std::make_pair(std::min(a, b), std::max(a, b))]++;
            }
        std::vector<Eigen::Vector3f> ends;
        for (const auto& e : count)
            if (e.second == 1) {
                ends.emplace_back(v[e.first.first * 3], v[e.first.first * 3 + 1], v[e.first.first * 3 + 2]);
                ends.emplace_back(v[e.first.second * 3], v[e.first.second * 3 + 1], v[e.first.second * 3 + 2]);
            }
        boundry_qef(e_vs, gmin, gmax, ends, boundary_weight, table, qefs);
    }
    const int64_t n = voxels.size();
    auto out_q = torch::empty({n, 4, 4}, torch::kFloat32);
    auto out_m = torch::empty({n, 3}, torch::kFloat32);
    auto q = out_q.accessor<float, 3>();
    auto m = out_m.accessor<float, 2>();
    for (int64_t i = 0; i < n; ++i) {
        for (int r = 0; r < 4; ++r) for (int c = 0; c < 4; ++c) q[i][r][c] = qefs[i](r, c);
        for (int k = 0; k < 3; ++k) m[i][k] = means[i][k];
    }
    return std::make_tuple(
        torch::from_blob(voxels.data(), {n, 3}, torch::kInt32).clone(), out_m,
        torch::from_blob(cnt.data(), {n}, torch::kFloat32).clone(),
        torch::from_blob(flags.data(), {n, 3}, torch::kBool).clone(), out_q);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("mesh_to_flexible_dual_grid_cpu", &mesh_to_flexible_dual_grid_cpu, py::call_guard<py::gil_scoped_release>());
    m.def("accumulate_qefs", &accumulate_qefs, py::call_guard<py::gil_scoped_release>());
}
"""


def _read_sources() -> dict[str, bytes] | None:
    root = os.environ.get("PIXAL3D_TRELLIS2_SOURCE")
    candidates = [Path(root)] if root else [MIRROR]
    for base in candidates:
        tree = base / SOURCE_DIR
        if all((tree / name).is_file() for name in SOURCE_FILES):
            return {name: (tree / name).read_bytes() for name in SOURCE_FILES}
        if (base / "HEAD").is_file() or (base / ".git").exists():  # a git directory without a work tree
            out = {}
            for name in SOURCE_FILES:
                shown = subprocess.run(["git", "--git-dir", str(base if (base / "HEAD").is_file() else base / ".git"),
                                        "show", f"HEAD:{SOURCE_DIR}/{name}"], check=False, capture_output=True)
                if shown.returncode != 0:
                    break
                out[name] = shown.stdout
            else:
                return out
    return None


def _eigen_include() -> Path | None:
    explicit = os.environ.get("PIXAL3D_EIGEN_INCLUDE")
    options = [Path(explicit)] if explicit else []
    options += [Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix/include/eigen3", Path("/usr/include/eigen3")]
    return next((p for p in options if (p / "Eigen" / "Dense").is_file()), None)


def missing() -> str | None:
    """Why the reference cannot be built here (``None`` when it can)."""
    if _read_sources() is None:
        return f"TRELLIS.2's flexible_dual_grid.cpp not found: {HOW_TO}"
    if _eigen_include() is None:
        return f"Eigen headers not found: {HOW_TO}"
    return None


@lru_cache(maxsize=1)
def build():
    """The compiled reference module (built once per source hash, cached in the temp directory)."""
    from torch.utils.cpp_extension import load

    sources, eigen = _read_sources(), _eigen_include()
    if sources is None or eigen is None:
        raise RuntimeError(missing())
    digest = hashlib.sha256(b"".join(sources[n] for n in SOURCE_FILES) + SHIM.encode()).hexdigest()[:16]
    work = Path(tempfile.gettempdir()) / f"pixal3d-trellis2-voxelize-{digest}"
    (work / "build").mkdir(parents=True, exist_ok=True)
    for name, data in {**sources, "shim.cpp": SHIM.encode()}.items():
        if not (work / name).is_file() or (work / name).read_bytes() != data:  # unchanged files: no rebuild
            (work / name).write_bytes(data)
    # -O3 -std=c++17 as o-voxel's setup.py builds it; no -march, so no FMA contraction on x86-64.
    return load(name=f"trellis2_fdg_{digest}", sources=[str(work / "shim.cpp")],
                extra_include_paths=[str(work), str(eigen)], extra_cflags=["-O3", "-std=c++17"],
                build_directory=str(work / "build"), verbose=False)


def _grid_args(vertices: np.ndarray, resolution: int):
    """The reference wrapper's preprocessing: float32 vertices shifted by −aabb_min, voxel size 1/R in float32."""
    import torch

    v = torch.from_numpy(np.ascontiguousarray(vertices, dtype=np.float32))
    aabb = torch.tensor([[-0.5] * 3, [0.5] * 3], dtype=torch.float32)
    grid = torch.tensor([resolution] * 3, dtype=torch.int32)
    voxel_size = (aabb[1] - aabb[0]) / grid
    grid_range = torch.stack([torch.zeros_like(grid), grid], dim=0).int()
    return (v - aabb[0].reshape(1, 3)).contiguous(), voxel_size, grid_range


def reference_dual_grid(vertices: np.ndarray, faces: np.ndarray, resolution: int, *, face_weight: float = 1.0,
                        boundary_weight: float = 0.2, regularization_weight: float = 1e-2):
    """``o_voxel.convert.mesh_to_flexible_dual_grid`` with ``aabb = [-0.5, 0.5]³``: (coords int32, dual vertices
    float32 in the shifted frame [0, 1]³, intersected bool), as numpy arrays in the reference's order."""
    import torch

    v, voxel_size, grid_range = _grid_args(vertices, resolution)
    f = torch.from_numpy(np.ascontiguousarray(faces, dtype=np.int32))
    coords, dual, flags = build().mesh_to_flexible_dual_grid_cpu(
        v, f, voxel_size, grid_range, face_weight, boundary_weight, regularization_weight, False)
    return coords.numpy(), dual.numpy(), flags.numpy()


def reference_qefs(vertices: np.ndarray, faces: np.ndarray, resolution: int, *, faces_on: bool = True,
                   boundary_weight: float = 0.2):
    """The reference's per-voxel state before the solve: coords, means (sums), counts, flags, QEF [N, 4, 4]."""
    import torch

    v, voxel_size, grid_range = _grid_args(vertices, resolution)
    f = torch.from_numpy(np.ascontiguousarray(faces, dtype=np.int32))
    out = build().accumulate_qefs(v, f, voxel_size, grid_range, faces_on, boundary_weight)
    return tuple(t.numpy() for t in out)
