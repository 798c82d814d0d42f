"""Stage outputs to safetensors and back (pipelines/state_codec.py) and the work directory's records
(pipelines/work_dir.py): bit-exact round trips, stale records named, broken ones refused, foreign folders refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh
from PIL import Image
from safetensors.torch import save_file

from pipelines import state_codec
from pipelines.work_dir import WorkDir, WorkDirError, stage_keys
from pixal3d.mesh.export import ExportedMesh, ExportReport, StepReport
from pixal3d.mesh.fields import DualGridFields, PbrVoxels
from pixal3d.models.camera import Camera
from pixal3d.models.conditioning import BackboneFeatures, ImageFeatures
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.staging import Stage, StageRecord, fingerprints


def _values() -> dict:
    g = torch.Generator().manual_seed(0)
    coords = torch.randint(0, 8, (5, 4), generator=g, dtype=torch.int32)
    coords[:, 0] = 0
    glb = trimesh.Trimesh(vertices=[[0, 0, 0], [1, 0, 0], [0, 1, 0]], faces=[[0, 1, 2]]).export(file_type="glb")
    report = ExportReport(steps=[StepReport("glb", 0.5, 123, {"bytes": len(glb)})], vertices=3, faces=1)
    return {
        "noise": torch.randn(1, 8, 4, 4, 4, generator=g),
        "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "sparse": SparseTensor(torch.randn(5, 8, generator=g), coords),
        "coords": coords,  # the same storage as sparse.coords: stored twice, read back equal
        "fields": DualGridFields(coords[:, 1:].contiguous(), torch.rand(5, 3, generator=g), torch.rand(5, 3) > 0.5,
                                 torch.rand(5, generator=g), 48),
        "pbr": PbrVoxels(coords[:, 1:].contiguous(), torch.rand(5, 6, generator=g), 48),
        "camera": Camera(fov=0.857, distance=1.0735107421875),
        "features": ImageFeatures({size: BackboneFeatures(torch.randn(1, 5 + (size // 4) ** 2, 8, generator=g),
                                                          torch.rand(1, 3, size, size, generator=g), 5)
                                   for size in (16, 32)}),
        "image": Image.fromarray(np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3), mode="RGB"),
        "mesh": ExportedMesh(mesh=trimesh.load(trimesh.util.wrap_as_stream(glb), file_type="glb", force="mesh"),
                             glb=glb, report=report),
        "resolution": 48,
        "nothing": None,
    }


def _prints(values: dict) -> dict:
    out = {}
    for name, value in values.items():
        out.update(fingerprints(value, name))
    return out


def test_every_kind_of_stage_output_round_trips_bit_for_bit(tmp_path):
    values = _values()
    expected = _prints(values)
    tensors, described = state_codec.encode(values)
    save_file(tensors, str(tmp_path / "s.safetensors"))
    from safetensors.torch import load_file
    back = state_codec.decode(load_file(str(tmp_path / "s.safetensors")), json.loads(json.dumps(described)),
                              torch.device("cpu"))
    assert _prints(back) == expected
    assert back["camera"] == values["camera"] and back["resolution"] == 48 and back["nothing"] is None
    assert back["mesh"].report.to_dict() == values["mesh"].report.to_dict()
    assert len(back["mesh"].mesh.faces) == 1
    assert isinstance(back["fields"], DualGridFields) and back["fields"].intersected.dtype == torch.bool
    assert back["features"].sizes == (16, 32) and back["features"].at(32).num_global == 5
    # control: one flipped bit in a stored tensor changes the fingerprints
    tensors["sparse.feats"] = tensors["sparse.feats"].clone()
    tensors["sparse.feats"].view(torch.int32)[0, 0] ^= 1
    changed = state_codec.decode(tensors, described, torch.device("cpu"))
    assert _prints(changed) != expected


def test_a_value_without_an_encoding_is_refused_naming_the_field():
    with pytest.raises(state_codec.StateCodecError, match="field 'odd' holds a object"):
        state_codec.encode({"odd": object()})


def test_nbytes_counts_shared_storage_once():
    t = torch.zeros(1000)
    assert state_codec.nbytes([t, t[:10], {"a": t}]) == 4000
    assert state_codec.nbytes(Image.new("RGB", (10, 20))) == 600


class _Step(Stage):
    def __init__(self, name: str, inputs: tuple[str, ...], setting: int):
        self.name, self.inputs, self.outputs, self.setting = name, inputs, ("x",), setting

    def working_set(self) -> int:
        return 0


def _keys(seed: int = 1, setting: int = 5):
    stages = [_Step("a", ("input_image",), 1), _Step("b", ("generator",), setting), _Step("c", (), 1)]
    return stage_keys(stages, {"input_image": "abc", "generator": seed}, {}, {"torch": "x"})


def _save_all(work: WorkDir, keys) -> None:
    for key in keys:
        work.save("img", key, StageRecord(key.stage, 0.1, []), {"x": torch.arange(3)}, torch.Generator())


def test_a_changed_seed_keeps_the_stages_before_the_first_that_reads_the_generator(tmp_path):
    work = WorkDir(tmp_path / "w")
    _save_all(work, _keys(seed=1))
    done, note = work.scan("img", _keys(seed=2))
    assert done == 1 and "made with seed 1 (now 2)" in note and "recomputing from b" in note
    # stale ones gone (.owner: the token of the run that opened the records, issue 44 item 2)
    assert sorted(p.name for p in work.folder("img").iterdir()) == [".owner", "a.json", "a.safetensors"]
    _save_all(work, _keys(seed=1))
    done, note = work.scan("img", _keys(setting=6))
    assert done == 1 and "other b settings" in note
    assert work.scan("img", _keys()) == (1, None)  # control: b and c were removed, a still valid


def test_a_record_whose_data_belongs_to_another_run_or_is_torn_is_not_used(tmp_path):
    work = WorkDir(tmp_path / "w")
    keys = _keys()
    _save_all(work, keys)
    assert work.scan("img", keys) == (3, None)
    folder = work.folder("img")
    (folder / ".b.safetensors.x1.tmp").write_bytes(b"half")  # a kill mid-write leaves this
    other = _keys(seed=9)
    save_file({"x": torch.arange(3)}, str(folder / "b.safetensors"), metadata={"key": other[1].digest})
    done, note = work.scan("img", keys)
    assert done == 1 and "belongs to another run" in note
    assert not list(folder.glob(".*.tmp"))
    _save_all(work, keys)
    data = (folder / "c.safetensors").read_bytes()
    (folder / "c.safetensors").write_bytes(data[:-4])
    done, note = work.scan("img", keys)
    assert done == 2 and "truncated" in note


def test_a_folder_that_is_not_a_work_dir_is_refused(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "holiday.jpg").write_bytes(b"x")
    with pytest.raises(WorkDirError, match="is not a pixal3d work directory"):
        WorkDir(tmp_path / "photos")
    WorkDir(tmp_path / "new")
    WorkDir(tmp_path / "new")  # ours: accepted again
    assert (Path(tmp_path / "new") / "pixal3d-work.json").exists()
