"""An image with a mesh to texture (``--mesh MESH``, ``Pixal3D.run(image, mesh=...)``): the texturing cascade.

TRELLIS.2's ``Trellis2TexturingPipeline`` on Pixal3D's pixel-aligned texture flow: preprocess, camera and features as
for one image, then ``mesh_encode`` (the mesh's flexible dual grid through TRELLIS.2's shape encoder) in place of
structure .. shape_1024, the cascade's texture flow on that latent, the texture decoder back to the mesh's voxels
(``mesh_decode``), and the bake onto the user's own mesh (``mesh_export``). The mesh goes with every image of a run
(one mesh, textured from each image); ``mesh_pose`` says how it sits in the image's frame (``aligned``, the default;
``estimate``: from MoGe-2's points, so not with a field of view given; ``normalize``: centred and scaled into the cube
as TRELLIS.2's ``preprocess_mesh`` does, whatever the image shows).
"""
from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .image import ImageInput

MESH_POSES = ("aligned", "estimate", "normalize")
READ_TOLERANCE = 1 / 48
"""How far past the cube an aligned mesh may reach when read: a decoded surface's half voxel at the demo's 48 grid
(the stage checks its own grid's)."""


@dataclass(frozen=True)
class MeshSource:
    """One run's input: the image (as an image kind's source) and the mesh read and checked (a ``UserMesh`` whose
    ``pose`` is the run's ``mesh_pose``)."""

    image: Any
    mesh: Any


class MeshInput(ImageInput):
    """An image (the positional input) with the run's mesh; every image of a run textures that one mesh."""

    name = "mesh"
    flag = "--mesh"
    provides = ("input_image", "input_mesh")
    options = ("fov", "mesh", "mesh_pose")
    upload_noun = "an image with a mesh"
    default_config = "1024_cascade.yaml"

    def takes(self, config: Any, given: Collection[str] = ()) -> bool:
        return config.views is None and "mesh" in given

    @property
    def arguments(self) -> tuple[str, ...]:
        return ("image", "mesh")

    def missing(self, config: Any) -> str | None:
        return "a mesh to texture needs an image: pass image= (the object as the mesh should look) with mesh="

    def stage_classes(self, config: Any) -> tuple[type, ...]:
        """preprocess, camera, features (the image's), mesh_encode, texture, mesh_decode, mesh_export."""
        from pipelines.mesh_decode import MeshDecodeStage
        from pipelines.mesh_encode import MeshEncodeStage
        from pipelines.mesh_export import MeshExportStage
        from pipelines.texture import TextureStage

        preprocess, camera, features = super().stage_classes(config)[:3]
        return (preprocess, camera, features, MeshEncodeStage, TextureStage, MeshDecodeStage, MeshExportStage)

    def adapt(self, stage: Any, config: Any) -> Any:
        """The camera stage keeps MoGe-2's object points (for ``mesh_pose: estimate``)."""
        return stage.with_points() if stage.name == "camera" else stage

    def check_options(self, config: Any, options: Mapping[str, Any]) -> None:
        super().check_options(config, options)
        pose = options.get("mesh_pose")
        if pose is not None and pose not in MESH_POSES:
            raise ValueError(f"mesh_pose {pose!r} is not one of {list(MESH_POSES)}")
        fov = options.get("fov")
        given = fov is not None and not (isinstance(fov, Sequence) and all(f is None for f in fov))
        if pose == "estimate" and (given or config.camera.fov_deg is not None):
            raise ValueError("mesh_pose 'estimate' registers MoGe-2's points of the image to the mesh, and a field of "
                             "view given skips MoGe-2: drop fov, or pass mesh_pose='aligned'")

    def refuse_option(self, config: Any, name: str) -> str:
        return f"{name} does not apply to texturing a mesh; drop it"

    def refuse_command(self, config: Any, given: Mapping[str, Sequence[Path]]) -> str | None:
        if given.get("views"):
            return "--mesh textures a mesh from one image: pass an image, not --views"
        if len(given.get("mesh") or ()) != 1:
            return "--mesh takes one mesh file (GLB, OBJ or PLY)"
        if not given.get("image"):
            return "--mesh needs an image to texture it from: pass the image before --mesh"
        return None

    def command_inputs(self, given: Mapping[str, Sequence[Path]]) -> Sequence[Path]:
        return given.get("image") or ()

    def open(self, source: Any, options: Mapping[str, Any]) -> Any:
        """The image checked from its header, and the run's mesh (read once per run, ``options['mesh']``)."""
        if isinstance(source, MeshSource):
            return source
        return MeshSource(super().open(source, options), options["mesh"])

    def checked(self, source: Any) -> Any:
        return source.image

    def digest(self, source: Any) -> str:
        h = hashlib.sha256()
        h.update(super().digest(source.image).encode())
        h.update(source.mesh.digest().encode())
        h.update(source.mesh.pose.encode())
        return h.hexdigest()

    def provided(self, digest: str | None) -> dict[str, Any]:
        return {"input_image": digest, "input_mesh": digest}

    def state(self, source: Any, *, reads_input: bool) -> dict[str, Any]:
        return {**super().state(source.image, reads_input=reads_input), "input_mesh": source.mesh}

    def label(self, source: Any) -> str:
        return super().label(source.image if isinstance(source, MeshSource) else source)

    def default_name(self, source: Any, index: int) -> str:
        return super().default_name(source.image if isinstance(source, MeshSource) else source, index)


def read_run_mesh(path: Any, pose: str | None) -> Any:
    """The run's mesh read and checked (``MeshError``: one line), carrying its pose (default ``aligned``)."""
    from pixal3d.mesh.user_mesh import check_in_cube, read_mesh

    if pose is not None and pose not in MESH_POSES:
        raise ValueError(f"mesh_pose {pose!r} is not one of {list(MESH_POSES)}")
    mesh = read_mesh(path)
    mesh.pose = pose or "aligned"
    if mesh.pose == "aligned":  # as it lies: in the cube (the stage checks again at its grid's half voxel)
        check_in_cube(mesh.vertices, mesh.source, mesh.pose, tolerance=READ_TOLERANCE)
    return mesh


MESH = MeshInput()
