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
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .image import ImageInput
from .kind import ANY_FILE, InputKind, UploadField

MESH_POSES = ("aligned", "estimate", "normalize")
MESH_UPLOADS = (".glb", ".obj", ".ply")
"""What an uploaded mesh may be, by its file name (one file: a glTF's buffers would be other files)."""
MESH_FOLDER = "mesh"
"""Where ``receive`` writes the uploaded mesh in a job's folder, under its own file name (the client's word for it)."""
MESH_ASK = "send the mesh to texture (GLB, OBJ or PLY) in the multipart field 'mesh', with the image in 'image'"
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
    upload = (*ImageInput.upload,
              UploadField("mesh", "mesh to texture (GLB, OBJ or PLY)", accepts=ANY_FILE, ask=MESH_ASK,
                          missing="no mesh: upload the mesh to texture (GLB, OBJ or PLY)"))
    upload_title = ("# Pixal3D, staged: texture a mesh\nOne image and a mesh in, that mesh textured from the image "
                    "(GLB) out.")
    upload_prompt = "upload an image and the mesh to texture, then press Generate"
    request_help = ("send multipart/form-data with the image in field 'image', the mesh to texture (GLB, OBJ or PLY) in "
                    "field 'mesh' (and JSON in 'settings', e.g. {\"mesh_pose\": \"aligned\"})")

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

    def refuse_upload(self, config: Any, other: InputKind | None) -> str:
        return InputKind.refuse_upload(self, config, other)

    def receive(self, parts: Mapping[str, Any], folder: Path, options: Mapping[str, Any]) -> Any:
        """The image as an image's upload (``ImageInput.receive``), and the mesh written in ``folder`` as
        ``mesh/<its file name>`` (a GLB, OBJ or PLY by that name), read and checked as the run will read it
        (``read_run_mesh`` at the job's ``mesh_pose``: ``MeshError``, one line, in an upload's words); returns the
        image (the mesh is the job's: ``received``)."""
        from pixal3d.files import write_bytes_atomic
        from pixal3d.mesh.user_mesh import MeshError

        image = super().receive(parts, folder, options)
        [mesh] = parts["mesh"]
        name = Path(mesh.filename.replace("\\", "/")).name
        suffix = Path(name).suffix.lower()
        if suffix not in MESH_UPLOADS:
            raise MeshError(f"the uploaded mesh {name[:60]!r} is not named as a GLB, OBJ or PLY file "
                            f"({', '.join(MESH_UPLOADS)}); send one of those")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._ -]{0,99}", name):
            name = f"mesh{suffix}"  # kept as sent only when it is a plain file name
        path = folder / MESH_FOLDER / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, mesh.read())
        try:
            read_run_mesh(path, options.get("mesh_pose"))
        except MeshError as err:
            raise MeshError(_upload_words(str(err))) from None
        return image

    def received(self, folder: Path) -> dict[str, Any]:
        """``Job.mesh``: the one file ``receive`` wrote under ``folder/mesh/``."""
        from pixal3d.mesh.user_mesh import MeshError

        found = sorted((folder / MESH_FOLDER).glob("*")) if (folder / MESH_FOLDER).is_dir() else []
        if len(found) != 1:
            raise MeshError(f"the job's mesh is missing from its upload ({len(found)} files in {MESH_FOLDER}/); "
                            f"submit the job again")
        return {"mesh": found[0]}

    def batch_key(self, folder: Path) -> dict[str, str]:
        """The mesh file's sha256 and its name: a batch textures one mesh file (the first job's), so only jobs with
        the same mesh share one (the name too: the run's records and messages name the file)."""
        mesh = self.received(folder)["mesh"]
        return {"mesh": hashlib.sha256(mesh.read_bytes()).hexdigest(), "mesh_name": mesh.name}

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


def _upload_words(text: str) -> str:
    """A ``MeshError`` in the words of an upload rather than of the command (its settings, not its flags)."""
    text = re.sub(r"^--mesh ", "the uploaded mesh ", text)
    return text.replace("--mesh-pose ", "mesh_pose ").replace("--shape-only", "shape_only")


MESH = MeshInput()
