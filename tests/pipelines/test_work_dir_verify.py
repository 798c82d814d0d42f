"""Issue 30, item 2: a stage record is verified by the sha256 of its data file, stored in its .json, before it
is reused. Two bytes flipped inside the tensor data of ``export.safetensors`` (its header and key intact, so
only the content hash can tell): the rerun names the record in one line, drops it, recomputes the export from
the sound records before it, and writes the same GLB as the first run."""
from __future__ import annotations

import hashlib
import json
import logging
import struct

from pipelines import Pixal3D
from tests.support.batch_fixtures import batch_images, fast_config, singles  # noqa: F401
from tests.support.cascade_fixtures import tiny_cache  # noqa: F401


def file_sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _flip_two_tensor_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    start = 8 + header  # the tensor data begins after the JSON header
    middle = start + (len(data) - start) // 2
    data[middle] ^= 0xFF
    data[middle + 1] ^= 0x55
    path.write_bytes(bytes(data))


def test_a_record_damaged_inside_its_tensor_data_is_named_dropped_and_recomputed(fast_config, batch_images, singles,
                                                                                tmp_path, caplog):
    work = tmp_path / "work"
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu") as pipe:
        first = list(pipe.run_batch(batch_images[:1], work_dir=work))[0]
        stages = tuple(s.name for s in pipe.stages)
        export = work / "a" / "export.safetensors"
        stored = json.loads((work / "a" / "export.json").read_text())
        assert stored["data_sha256"] == file_sha256(export)
        _flip_two_tensor_bytes(export)
        with caplog.at_level(logging.WARNING, logger="pipelines"):
            again = list(pipe.run_batch(batch_images[:1], work_dir=work))[0]
    assert again.ok, again.message
    assert again.resumed == stages[:-1]  # every record before the export was sound and reused
    lines = [r.getMessage() for r in caplog.records if "export" in r.getMessage()]
    assert len(lines) == 1 and "export.safetensors is damaged" in lines[0] and "recomputing from export" in lines[0]
    assert again.result.mesh.glb == first.result.mesh.glb
    assert again.result.fingerprints() == first.result.fingerprints() == singles["prints"]["a"]
    assert json.loads((work / "a" / "export.json").read_text())["data_sha256"] == file_sha256(export)  # rewritten
