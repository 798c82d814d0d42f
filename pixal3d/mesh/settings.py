"""The export's settings, apart from the export itself: the config (``pixal3d.config``) reads and checks them
without importing the mesh code behind them (numpy's and scipy's sparse graphs, the baker, the GLB writer), which
``--plan`` never runs."""
from __future__ import annotations

from dataclasses import dataclass

ALPHA_MODES = ("OPAQUE", "BLEND", "auto")
TEXTURE_FORMATS = ("png", "webp")
PROJECTIONS = ("tangent", "exact")


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
