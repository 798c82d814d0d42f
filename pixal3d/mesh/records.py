"""What an export produced (the GLB's bytes, the mesh, the per-step report), apart from the export code: the
stage records (``pipelines.state_codec``) and results read and write them without importing the mesh machinery,
which ``--plan`` never runs."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pixal3d.files import write_bytes_atomic

if TYPE_CHECKING:  # the mesh's type only; trimesh itself is imported where a mesh is built (glb.py)
    import trimesh


@dataclass
class StepReport:
    """Wall time and peak RSS (bytes) of one export step, plus what it produced."""

    name: str
    seconds: float
    peak_rss: int
    detail: dict = field(default_factory=dict)


@dataclass
class ExportReport:
    """What the export did: per-step rows, the output mesh size, texture coverage, GLB size (``path``:
    where ``export_glb`` wrote it; empty for an in-memory export)."""

    steps: list[StepReport]
    path: str = ""
    vertices: int = 0
    faces: int = 0
    texture_size: int = 0
    coverage: float = 0.0
    file_bytes: int = 0
    quality: dict = field(default_factory=dict)

    @property
    def peak_rss(self) -> int:
        """Highest per-step peak RSS (bytes)."""
        return max((s.peak_rss for s in self.steps), default=0)

    @property
    def seconds(self) -> float:
        """Total wall time of the steps."""
        return sum(s.seconds for s in self.steps)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self) | {"peak_rss": self.peak_rss, "seconds": self.seconds}

    def table(self) -> str:
        """A plain-text table: step, seconds, peak RSS (GiB), detail."""
        rows = [f"{'step':<10} {'seconds':>8} {'peak GiB':>9}  detail"]
        for s in self.steps:
            detail = ", ".join(f"{k}={v}" for k, v in s.detail.items())
            rows.append(f"{s.name:<10} {s.seconds:>8.2f} {s.peak_rss / 2**30:>9.2f}  {detail}")
        rows.append(f"{'total':<10} {self.seconds:>8.2f} {self.peak_rss / 2**30:>9.2f}")
        return "\n".join(rows)


@dataclass
class ExportedMesh:
    """The textured mesh (trimesh, GLB frame), its GLB file's bytes, the export report, and ``extras``: other
    files of the same mesh by suffix (a printable mesh's ``.stl`` and ``.3mf``), written beside the GLB."""

    mesh: trimesh.Trimesh
    glb: bytes
    report: ExportReport
    extras: dict[str, bytes] = field(default_factory=dict)

    def extra_paths(self, path: str | Path) -> dict[Path, bytes]:
        """Where ``extras`` go beside the GLB at ``path`` (same stem)."""
        return {Path(path).with_suffix(suffix): data for suffix, data in self.extras.items()}

    def fingerprint_parts(self) -> dict[str, bytes]:
        """The GLB bytes identify the export bit for bit (``pixal3d.staging.fingerprint``)."""
        return {"glb": self.glb}

    def save(self, path: str | Path) -> Path:
        """Write the GLB to ``path`` atomically (folders created), its extras beside it first; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for extra, data in self.extra_paths(path).items():
            write_bytes_atomic(extra, data)
        write_bytes_atomic(path, self.glb)
        return path
