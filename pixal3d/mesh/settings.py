"""The export's settings, apart from the export itself: the config (``pixal3d.config``) reads and checks them
without importing the mesh code behind them (numpy's and scipy's sparse graphs, the baker, the GLB writer), which
``--plan`` never runs."""
from __future__ import annotations

from dataclasses import dataclass

ALPHA_MODES = ("OPAQUE", "BLEND", "auto")
TEXTURE_FORMATS = ("png", "webp")
PROJECTIONS = ("tangent", "exact")
COMPRESSIONS = ("meshopt",)


@dataclass(frozen=True, kw_only=True)
class ExportSettings:
    """Export knobs; defaults are the release ``1024_cascade`` values where the CPU path has them.

    max_hole_perimeter / min_component_area are in world units (the object spans [-0.5, 0.5]³);
    chart_cell_edges sizes the UV clusters in mean edge lengths of the simplified mesh.
    projection: how texels reach the reference surface ("tangent", "exact", or None = not at all).
    remesh: narrow-band UDF dual contouring of the reference surface at ``remesh_resolution``³ cells
    (None: the decode resolution, as the reference's release call), ``remesh_band`` cells out (band 1,
    project 0 in that call); ``exterior_only`` keeps only the outer sheet of the thickened shell. Off
    by default here (surface-faithful, half the time); the release setting is on, and
    ``configs/1024_cascade.yaml`` turns it on (benchmarks/export_quality.md compares the branches).
    quality_samples: points per surface for the Hausdorff/Chamfer metrics (0: no quality step work).
    normal_map: bake a tangent-space normal map of the decoded surface onto the simplified mesh (glTF
    ``normalTexture``, the mesh carries the TANGENT frame it was baked in). occlusion_map: an ambient-occlusion
    map (glTF ``occlusionTexture``, in the red channel of the metallic-roughness image, which glTF leaves
    unused): ``occlusion_rays`` directions per vertex marched through the decoded voxels up to
    ``occlusion_distance`` (world units; the object spans 1).
    printable: a closed 2-manifold mesh for 3D printing (remesh with ``exterior_only`` required: one outer
    sheet, interior shells gone); the export checks it has no boundary or non-manifold edge and also writes
    it as STL and 3MF (``ExportedMesh.extras``).
    compression: None, or ``"meshopt"``: the GLB's geometry compressed with meshoptimizer
    (``EXT_meshopt_compression``, required by the file; three.js, Babylon.js and gltf-transform read it).
    workers: forked processes for the slab remesh and the tiled simplifier (None: one per core, at most 4; 1: the
    remesh's slabs one at a time, each in a forked child of its own that exits with its buffers, as the plan sets
    where two workers' memory does not fit the budget). The mesh is the same whatever it is.
    """

    decimation_target: int = 1_000_000
    texture_size: int = 4096
    remesh: bool = False
    remesh_resolution: int | None = None
    remesh_band: float = 1.0
    exterior_only: bool = False
    quality_samples: int = 100_000
    texture_format: str = "png"
    alpha_mode: str = "auto"
    max_hole_perimeter: float = 3e-2
    min_component_area: float = 1e-5
    chart_cell_edges: float = 16.0
    uv_padding: int = 2
    projection: str | None = "tangent"
    normal_map: bool = True
    occlusion_map: bool = True
    occlusion_rays: int = 16
    occlusion_distance: float = 0.05
    printable: bool = False
    compression: str | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.decimation_target < 4:
            raise ValueError(f"decimation_target must be a face count >= 4, got {self.decimation_target}")
        if not 16 <= self.texture_size <= 16384:
            raise ValueError(f"texture_size must be in [16, 16384] texels, got {self.texture_size}")
        if self.texture_format not in TEXTURE_FORMATS:
            raise ValueError(f"texture_format must be one of {TEXTURE_FORMATS}, got {self.texture_format!r}")
        if self.alpha_mode not in ALPHA_MODES:
            raise ValueError(f"alpha_mode must be one of {ALPHA_MODES}, got {self.alpha_mode!r}")
        if not 0 < self.remesh_band <= 4:
            raise ValueError(f"remesh_band must be in (0, 4] cells (the reference uses 1), got {self.remesh_band}")
        if self.remesh_resolution is not None:
            if not 16 <= self.remesh_resolution <= 2048:
                raise ValueError(f"remesh_resolution must be in [16, 2048] cells per axis (512 or 1024; None: the "
                                 f"decode resolution), got {self.remesh_resolution}")
            # the grid's own checks (even, halving evenly to <= 32 cells); imported only when a resolution is given
            from .narrow_band import RemeshGrid

            RemeshGrid(self.remesh_resolution, self.remesh_band)
        if self.exterior_only and not self.remesh:
            raise ValueError("exterior_only=True selects the remesh's outer sheet; it needs remesh=True")
        if self.quality_samples < 0:
            raise ValueError(f"quality_samples must be >= 0 (0 skips the metrics), got {self.quality_samples}")
        if self.projection not in (*PROJECTIONS, None):
            raise ValueError(f"projection must be one of {PROJECTIONS} or None, got {self.projection!r}")
        if self.chart_cell_edges <= 0 or self.uv_padding < 0:
            raise ValueError("chart_cell_edges must be > 0 and uv_padding >= 0")
        if not 1 <= self.occlusion_rays <= 256 or not 0 < self.occlusion_distance <= 1:
            raise ValueError(f"occlusion_rays must be in [1, 256] and occlusion_distance in (0, 1] (world units), got "
                             f"{self.occlusion_rays} and {self.occlusion_distance}")
        if self.printable and not (self.remesh and self.exterior_only):
            raise ValueError("printable=True needs remesh=True and exterior_only=True (one closed outer sheet); "
                             "use the print preset, which sets them")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ValueError(f"workers must be a process count >= 1 or None (one per core), got {self.workers!r}")
        if self.compression not in (*COMPRESSIONS, None):
            raise ValueError(f"compression must be one of {COMPRESSIONS} or None, got {self.compression!r}")


PRESETS: dict[str, dict[str, object]] = {
    "game": {"decimation_target": 100_000, "texture_size": 2048, "normal_map": True, "occlusion_map": True},
    "mobile": {"decimation_target": 20_000, "texture_size": 1024, "normal_map": True, "occlusion_map": True},
    "high": {"decimation_target": 1_000_000, "texture_size": 4096, "normal_map": True, "occlusion_map": True},
    "print": {"decimation_target": 500_000, "texture_size": 2048, "normal_map": False, "occlusion_map": False,
              "remesh": True, "exterior_only": True, "printable": True},
}
"""Export presets (``--preset``): the fields each sets; a setting given beside a preset wins over it. game and mobile:
real-time budgets (faces, atlas) with the maps a real-time renderer shades with; high: the release's 1M faces at
4096²; print: a closed outer shell (no inner sheet), no shading maps, also STL and 3MF."""


def preset_changes(name: str | None) -> dict[str, object]:
    """The ``ExportSettings`` fields preset ``name`` sets (``{}`` for None); a ``ValueError`` naming the presets."""
    if name is None:
        return {}
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is not one of {list(PRESETS)}")
    return dict(PRESETS[name])
