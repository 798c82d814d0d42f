"""Presets hit their face budgets; the print preset's mesh is closed (also as STL and 3MF); compressed GLBs
pass the Khronos validator and decode back to the same mesh."""
import io
import re
import zipfile

import numpy as np
import pytest
import trimesh

from pipelines.job import DEFAULT_CONFIG, Job
from pixal3d.config import load_config
from pixal3d.mesh.export import ExportSettings, export_mesh
from pixal3d.mesh.glb_container import MESHOPT, Glb, uncompressed
from pixal3d.mesh.printable import NotPrintableError, check_printable
from pixal3d.mesh.settings import PRESETS
from pixal3d.mesh.synthetic import (
    handle_sdf,
    holey_sphere_fields,
    pbr_from_function,
    sdf_dual_grid,
    sphere_sdf,
)
from tests.support.gltf_validator import errors, validate


def _colour(p):
    out = np.concatenate([0.5 + 0.4 * np.sin(9 * p), np.full((len(p), 3), 0.5)], 1)
    out[:, 5] = 1.0
    return out


@pytest.fixture(scope="module")
def dense_sphere():
    """~250k faces: above the game (100k) and mobile (20k) budgets."""
    fields = sdf_dual_grid(sphere_sdf((0.0, 0.0, 0.0), 0.42), 200, project=False)
    return fields, pbr_from_function(fields, _colour)


@pytest.mark.parametrize("preset", ["game", "mobile"])
def test_a_presets_mesh_has_its_face_budget_within_two_percent(dense_sphere, preset):
    config = Job.build(load_config(DEFAULT_CONFIG), {"preset": preset, "texture_size": 64}).config
    settings = config.export.__class__(**{**config.export.__dict__, "quality_samples": 0, "normal_map": False,
                                          "occlusion_map": False, "remesh": False})
    exported = export_mesh(*dense_sphere, settings=settings, progress=False)
    target = PRESETS[preset]["decimation_target"]
    assert abs(exported.report.faces - target) <= 0.02 * target, (exported.report.faces, target)


def test_presets_set_their_rows_and_a_given_setting_wins():
    base = load_config(DEFAULT_CONFIG)
    for name, fields in PRESETS.items():
        export = Job.build(base, {"preset": name}).config.export
        assert all(getattr(export, k) == v for k, v in fields.items()), name
    assert Job.build(base, {"preset": "game", "face_budget": 5000}).config.export.decimation_target == 5000
    assert Job.build(base, {"preset": "print"}).config.export.printable


@pytest.fixture(scope="module")
def printed():
    fields = sdf_dual_grid(handle_sdf(), 64, project=False)  # a mug: genus one
    settings = ExportSettings(**{**PRESETS["print"], "decimation_target": 4000, "texture_size": 128,
                                 "quality_samples": 0})
    return export_mesh(fields, pbr_from_function(fields, _colour), settings=settings, progress=False)


def test_the_print_mesh_is_closed_as_stl_and_3mf(printed):
    assert set(printed.extras) == {".stl", ".3mf"}
    stl = trimesh.load(io.BytesIO(printed.extras[".stl"]), file_type="stl", process=True)
    assert stl.is_watertight and stl.is_winding_consistent and stl.volume > 0
    assert stl.euler_number == 0  # the handle survives: genus one, no inner sheet (that would add a sphere: 2)
    assert abs(stl.extents.max() - 100.0) < 1e-6  # millimetres, the longest side 100
    with zipfile.ZipFile(io.BytesIO(printed.extras[".3mf"])) as package:
        model = package.read("3D/3dmodel.model").decode()
    assert 'unit="millimeter"' in model and model.count("<triangle ") == len(stl.faces)


def test_control_an_open_decode_is_refused_as_a_print():
    from pixal3d.mesh.cleanup import remove_degenerate_faces
    from pixal3d.mesh.dual_grid import dual_grid_to_mesh

    v, f = dual_grid_to_mesh(holey_sphere_fields(64, radii_vox=(3.0,), dropout=0.0))
    with pytest.raises(NotPrintableError, match="boundary"):
        check_printable(v, remove_degenerate_faces(v, f))


@pytest.fixture(scope="module")
def glbs():
    fields = sdf_dual_grid(sphere_sdf((0.0, 0.0, 0.0), 0.3), 48)
    pbr = pbr_from_function(fields, _colour)
    base = {"decimation_target": 1500, "texture_size": 128, "quality_samples": 0}
    plain = export_mesh(fields, pbr, settings=ExportSettings(**base), progress=False)
    packed = export_mesh(fields, pbr, settings=ExportSettings(**base, compression="meshopt"), progress=False)
    return plain.glb, packed.glb


def _rotated(faces):
    faces = np.asarray(faces)
    shift = faces.argmin(1)
    return faces[np.arange(len(faces))[:, None], (shift[:, None] + np.arange(3)) % 3]


def test_compressed_glb_decodes_to_the_same_mesh(glbs):
    plain, packed = glbs
    gltf = Glb.parse(packed).gltf
    assert MESHOPT in gltf["extensionsRequired"]
    assert len(Glb.parse(packed).binary) < len(Glb.parse(plain).binary)
    a = trimesh.load(io.BytesIO(plain), file_type="glb", force="mesh", process=False)
    b = trimesh.load(io.BytesIO(uncompressed(packed)), file_type="glb", force="mesh", process=False)
    # meshopt's index codec may rotate a triangle's corners (winding kept): compare from each smallest corner
    assert np.array_equal(a.vertices, b.vertices) and np.array_equal(_rotated(a.faces), _rotated(b.faces))
    plain_glb, decoded_glb = Glb.parse(plain), Glb.parse(uncompressed(packed))
    for name, index in plain_glb.gltf["meshes"][0]["primitives"][0]["attributes"].items():  # every attribute's bytes
        views = (g.gltf["bufferViews"][g.gltf["accessors"][index]["bufferView"]] for g in (plain_glb, decoded_glb))
        assert plain_glb.view_bytes(next(views)) == decoded_glb.view_bytes(next(views)), name


def test_control_a_damaged_compressed_stream_does_not_decode_to_the_mesh(glbs):
    plain, packed = glbs
    glb = Glb.parse(packed)
    ext = glb.gltf["bufferViews"][glb.gltf["accessors"][0]["bufferView"]]["extensions"][MESHOPT]
    damaged = bytearray(glb.binary)
    start = ext["byteOffset"] + ext["byteLength"] // 2
    damaged[start : start + 64] = bytes(64)
    try:
        decoded = trimesh.load(io.BytesIO(uncompressed(Glb(glb.gltf, bytes(damaged)).pack())), file_type="glb",
                               force="mesh", process=False)
    except RuntimeError:  # the decoder noticed
        return
    original = trimesh.load(io.BytesIO(plain), file_type="glb", force="mesh", process=False)
    assert not np.array_equal(decoded.vertices, original.vertices)


@pytest.mark.parametrize("which", ["plain", "meshopt"])
def test_glbs_pass_the_khronos_validator(glbs, which):
    report = validate(glbs[0] if which == "plain" else glbs[1])
    assert report["numErrors"] == 0 and report["numWarnings"] == 0, errors(report)


def test_control_the_validator_reports_a_broken_glb(glbs):
    glb = Glb.parse(glbs[0])
    attributes = glb.gltf["meshes"][0]["primitives"][0]["attributes"]
    glb.gltf["accessors"][attributes["POSITION"]]["count"] += 10  # past the end of its bufferView
    report = validate(glb.pack())
    assert report["numErrors"] > 0 and any(re.search("ACCESSOR", m) for m in errors(report))


def test_a_printed_and_compressed_export_survives_a_work_dir_record(printed, glbs):
    """The stage record keeps the STL/3MF and a meshopt GLB, and reads the compressed GLB's mesh back."""
    import dataclasses

    import torch

    from pipelines.state_codec import decode, encode

    packed = dataclasses.replace(printed, glb=glbs[1])
    tensors, described = encode({"mesh": packed}, {"mesh": "mesh"})
    back = decode(tensors, described, torch.device("cpu"))["mesh"]
    assert back.glb == glbs[1] and back.extras == printed.extras
    assert len(back.mesh.faces) == Glb.parse(uncompressed(glbs[1])).gltf["accessors"][
        Glb.parse(glbs[1]).gltf["meshes"][0]["primitives"][0]["indices"]]["count"] // 3


def test_a_request_naming_an_unknown_preset_or_compression_is_refused_in_one_line():
    from pipelines.job import SettingsError

    config = load_config(DEFAULT_CONFIG)
    for settings, words in [({"preset": "ultra"}, "preset 'ultra' is not one of"),
                            ({"compression": "draco"}, "compression")]:
        with pytest.raises(SettingsError, match=words) as refused:
            Job.from_request(settings, config)
        assert "\n" not in str(refused.value)
    assert Job.from_request({"preset": "mobile", "compression": "meshopt"}, config).config.export.compression == "meshopt"
