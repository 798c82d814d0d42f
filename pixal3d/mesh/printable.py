"""A mesh for 3D printing: checked closed and 2-manifold, written as STL and 3MF.

The print preset contours the exterior only (``remesh`` with ``exterior_only``: one outer sheet, the inner sheet
and every shell the outside cannot reach gone), so its mesh is closed by construction; ``check_printable`` makes
sure the simplification and cleanup kept it so (no boundary edge, no edge of more than two faces, every pair of
faces across an edge wound alike, positive volume) and refuses it with the counts otherwise, instead of writing a
file a slicer would reject. STL and 3MF are in millimetres, Z up (a printer's frame), the longest side
``size_mm`` long.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cleanup import edge_statistics

# internal (x, y, z), y up → printer (x, -z, y), z up: a rotation (det +1), so the winding stays outward
INTERNAL_TO_PRINT = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])


class NotPrintableError(ValueError):
    """The print mesh is not closed and 2-manifold; the message has the counts."""


@dataclass(frozen=True)
class Printability:
    """Edge counts of a mesh and its signed volume (world units³)."""

    boundary_edges: int
    non_manifold_edges: int
    inconsistent_edges: int
    volume: float

    @property
    def closed(self) -> bool:
        """Watertight, 2-manifold, consistently wound, outward."""
        return self.boundary_edges == 0 and self.non_manifold_edges == 0 and self.inconsistent_edges == 0 \
            and self.volume > 0


def printability(vertices: np.ndarray, faces: np.ndarray) -> Printability:
    """The counts ``check_printable`` judges."""
    stats = edge_statistics(np.asarray(faces))
    v = vertices.astype(np.float64)
    a, b, c = v[faces[:, 0]], v[faces[:, 1]], v[faces[:, 2]]
    volume = float(np.einsum("ij,ij->i", a, np.cross(b, c)).sum() / 6.0)
    return Printability(stats["boundary"], stats["non_manifold"], stats["inconsistent"], volume)


def check_printable(vertices: np.ndarray, faces: np.ndarray) -> Printability:
    """``printability`` of a closed 2-manifold, or a ``NotPrintableError`` saying what is open."""
    result = printability(vertices, faces)
    if not result.closed:
        raise NotPrintableError(
            f"the print mesh is not closed: {result.boundary_edges} boundary, {result.non_manifold_edges} "
            f"non-manifold and {result.inconsistent_edges} inconsistently wound edges, volume {result.volume:.3g}; "
            "raise the face budget (--face-budget) or export without --preset print")
    return result


def print_mesh(vertices: np.ndarray, faces: np.ndarray, *, size_mm: float = 100.0):
    """A trimesh in the printer's frame, millimetres, the longest side ``size_mm``."""
    import trimesh

    v = vertices.astype(np.float64) @ INTERNAL_TO_PRINT.T
    extent = float((v.max(0) - v.min(0)).max())
    v = (v - v.min(0)) * (size_mm / max(extent, 1e-12))
    return trimesh.Trimesh(vertices=v, faces=faces, process=False)


_CONTENT_TYPES = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Default Extension="model" ContentType="application/vnd.ms-package.3dmanufacturing-3dmodel+xml"/></Types>')
_RELS = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
    '<Relationship Target="/3D/3dmodel.model" Id="rel0" '
    'Type="http://schemas.microsoft.com/3dmanufacturing/2013/01/3dmodel"/></Relationships>')


def three_mf(vertices: np.ndarray, faces: np.ndarray) -> bytes:
    """A 3MF package (3MF core specification: one object, one build item, millimetres) of a closed mesh.

    Written here rather than through trimesh, whose 3MF writer needs lxml for an XML document this small."""
    import io
    import zipfile

    verts = "".join(f'<vertex x="{x:.6f}" y="{y:.6f}" z="{z:.6f}"/>' for x, y, z in vertices.tolist())
    tris = "".join(f'<triangle v1="{a}" v2="{b}" v3="{c}"/>' for a, b, c in faces.tolist())
    model = ('<?xml version="1.0" encoding="UTF-8"?>\n'
             '<model unit="millimeter" xml:lang="en-US" '
             'xmlns="http://schemas.microsoft.com/3dmanufacturing/core/2015/02">'
             f'<resources><object id="1" type="model"><mesh><vertices>{verts}</vertices>'
             f'<triangles>{tris}</triangles></mesh></object></resources>'
             '<build><item objectid="1"/></build></model>')
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as package:
        package.writestr("[Content_Types].xml", _CONTENT_TYPES)
        package.writestr("_rels/.rels", _RELS)
        package.writestr("3D/3dmodel.model", model)
    return out.getvalue()


def print_files(vertices: np.ndarray, faces: np.ndarray, *, size_mm: float = 100.0) -> dict[str, bytes]:
    """``{".stl": ..., ".3mf": ...}``: the mesh as binary STL and as 3MF (millimetres, Z up)."""
    from trimesh.exchange.stl import export_stl

    mesh = print_mesh(vertices, faces, size_mm=size_mm)
    return {".stl": export_stl(mesh), ".3mf": three_mf(np.asarray(mesh.vertices), np.asarray(mesh.faces))}
