"""Batches (pipelines/batch.py): stage by stage across images with one model load per batch, every image's
fingerprints those of a one-by-one run, states kept on disk between stages, resume from a work directory, a
changed seed recomputing only what it decides, a bad image costing only itself."""
from __future__ import annotations

import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipelines import Pixal3D
from pipelines import work_dir as work_dir_module
from pipelines.batch import image_items
from pixal3d.config import SettingError
from pixal3d.staging import EventLog
from tests.support.batch_fixtures import batch_images, fast_config, singles  # noqa: F401
from tests.support.cascade_fixtures import tiny_cache  # noqa: F401


def _loads(log: EventLog) -> list[list[str]]:
    return [[e.kind, e.model, e.stage] for e in log.events if e.kind in ("load", "reload")]


def test_a_stage_ordered_batch_of_three_equals_three_single_runs_and_loads_each_model_once(
        fast_config, batch_images, singles):
    log = EventLog()
    reports = []
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu") as pipe:
        items = list(pipe.run_batch(batch_images, events=log, callback=reports.append))
    assert [item.name for item in items] == ["a", "b", "c"] and all(item.ok for item in items)
    assert {item.name: item.result.fingerprints() for item in items} == singles["prints"]
    # Each model is loaded as often for the batch as for one image (naf and the shape decoder serve two stages
    # with others between them, so a staged run loads them twice; DINOv3 runs once, in the features stage), not
    # three times as often.
    assert _loads(log) == singles["loads"]
    counts = Counter(model for _, model, _ in _loads(log))
    assert counts == {"moge": 1, "dinov3": 1, "naf": 2, "shape_slat_decoder": 2, "sparse_structure_flow_model": 1,
                      "sparse_structure_decoder": 1, "shape_slat_flow_model_512": 1, "shape_slat_flow_model_1024": 1,
                      "tex_slat_flow_model_1024": 1, "tex_slat_decoder": 1}
    started = [(r["stage"], r["image"]) for r in reports if r["kind"] == "stage"]
    assert started[:4] == [("preprocess", "a"), ("preprocess", "b"), ("preprocess", "c"), ("camera", "a")]
    assert {r["image"] for r in reports if r["kind"] == "step"} == {"a", "b", "c"}


def test_controls_image_order_loads_per_image_and_one_shared_generator_changes_the_noise(
        fast_config, batch_images, singles):
    images = batch_images[:2]
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until="structure") as pipe:
        log = EventLog()
        by_image = list(pipe.run_batch(images, order="image", events=log))
        assert len(_loads(log)) == 2 * 4  # MoGe-2 and the three structure models, loaded again for every image
        shared = torch.Generator().manual_seed(42)
        new_state = pipe.new_state

        def one_generator(*args, **kwargs):
            state = new_state(*args, **kwargs)
            state.generator = shared
            return state
        pipe.new_state = one_generator
        mixed = list(pipe.run_batch(images, order="stage"))
    expected = [singles["prints"][p.stem]["structure"] for p in images]
    assert [item.result.fingerprints()["structure"] for item in by_image] == expected
    assert [item.result.fingerprints()["structure"] for item in mixed][1:] != expected[1:]


def test_states_kept_on_disk_between_stages_give_the_same_fingerprints(fast_config, batch_images, singles,
                                                                       monkeypatch, tmp_path):
    reads = Counter()
    load = work_dir_module.WorkDir.load

    spilled = set()

    def counted(self, image, key, device):
        reads[key.stage] += 1
        spilled.add(str(self.root))
        return load(self, image, key, device)
    monkeypatch.setattr(work_dir_module.WorkDir, "load", counted)
    leftover = tmp_path / "batch-spill" / f"{_dead_pid()}-abc"  # a killed batch's folder: removed
    leftover.mkdir(parents=True)
    stages = ("preprocess", "camera", "features", "structure", "shape_512", "upsample")
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until=stages[-1]) as pipe:
        monkeypatch.setenv("PIXAL3D_CACHE", str(tmp_path))  # the spill folder is under the cache
        items = list(pipe.run_batch(batch_images[:2], state_budget=0))
    expected = {p.stem: {k: v for k, v in singles["prints"][p.stem].items() if k in stages} for p in batch_images[:2]}
    assert {i.name: i.result.fingerprints() for i in items} == expected
    # before every stage after the first, each image's state came back from disk: every earlier stage read
    # (the decoders' outputs come back from disk in tests/pipelines/test_interrupt.py, the codec is in test_state_codec.py)
    assert reads["preprocess"] == 2 * 5 and reads["shape_512"] == 2 * 1
    assert spilled and all(tmp_path / "batch-spill" in Path(p).parents for p in spilled)  # on disk, not in /tmp
    assert list((tmp_path / "batch-spill").iterdir()) == []  # this batch's folder is gone, and the leftover


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_work_dir_resumes_finished_images_without_recomputing_and_a_new_seed_recomputes_from_structure(
        fast_config, batch_images, singles, tmp_path, caplog):
    work = tmp_path / "work"
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu") as pipe:
        first = list(pipe.run_batch(batch_images[:1], work_dir=work))
        log = EventLog()
        again = list(pipe.run_batch(batch_images[:1], work_dir=work, events=log))
        assert log.events == [] and again[0].resumed == tuple(s.name for s in pipe.stages)
    assert again[0].result.fingerprints() == first[0].result.fingerprints() == singles["prints"]["a"]
    assert again[0].result.mesh.glb == first[0].result.mesh.glb
    # A shorter cascade keys its stages as the full one does: the records of the full run serve it.
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until="shape_512") as pipe:
        with caplog.at_level(logging.WARNING, logger="pipelines.batch"):
            reseeded = list(pipe.run_batch(batch_images[:1], work_dir=work, seed=7))
        fresh = pipe.run(batch_images[0], seed=7).fingerprints()
    assert reseeded[0].resumed == ("preprocess", "camera", "features")  # DINOv3's features kept: no reload
    assert [r.message for r in caplog.records] == [
        (f"work dir {work}: a: the stored records from structure on were made with seed 42 (now 7); "
         f"recomputing from structure")]
    assert reseeded[0].result.fingerprints() == fresh
    assert fresh["structure"] != singles["prints"]["a"]["structure"]  # control: the seed changes the noise


def test_a_bad_image_in_a_batch_fails_alone_before_any_weight_is_read(fast_config, batch_images, singles, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    opaque = tmp_path / "opaque.png"
    Image.open(batch_images[0]).convert("RGB").save(opaque)  # no alpha, and the tiny config has no remover
    log = EventLog()
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until="structure") as pipe:
        items = iter(pipe.run_batch([batch_images[0], bad, opaque, batch_images[1]], events=log))
        first, second = next(items), next(items)
        assert log.events == []  # both refused before the first stage
        items = [first, second, *items]
    assert [(i.name, i.ok, i.stage) for i in items] == [("bad", False, None), ("opaque", False, None),
                                                        ("a", True, None), ("b", True, None)]
    assert "bad.png is not an image Pillow can read" in items[0].message and items[0].failure.kind == "input"
    assert "alpha" in items[1].message
    assert items[2].result.fingerprints()["structure"] == singles["prints"]["a"]["structure"]


def test_an_error_of_one_image_during_a_stage_skips_only_that_image(fast_config, batch_images, singles,
                                                                    monkeypatch):
    from pipelines.structure import EmptyStructureError, StructureStage

    run, calls = StructureStage.run, []

    def empty_the_second_time(self, state, models):
        calls.append(1)
        if len(calls) == 2:
            raise EmptyStructureError("the sparse structure is empty (no voxel occupied); try another seed or image")
        run(self, state, models)
    monkeypatch.setattr(StructureStage, "run", empty_the_second_time)
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until="shape_512") as pipe:
        items = list(pipe.run_batch(batch_images))  # stage by stage: a, b, c through structure, then shape_512
    assert [(i.name, i.ok, i.stage) for i in items] == [("b", False, "structure"), ("a", True, None),
                                                        ("c", True, None)]
    assert "sparse structure is empty" in items[0].message and items[0].failure.kind == "input"
    for item in items[1:]:
        assert item.result.fingerprints()["shape_512"] == singles["prints"][item.name]["shape_512"]


@pytest.mark.parametrize("seed", [b"x", "abc", "7", bytearray(b"\x01"), 1.0, True, [1, "2"]])
def test_a_seed_that_is_not_an_int_or_a_list_of_ints_is_refused_naming_it(seed):
    """Issue 44 item 9: bytes and str are sequences, and were taken as lists of seeds (``b'x'`` ran seed 120,
    ``'abc'`` said "3 seeds for 1 images"); the library refuses them as the command and the server do."""
    with pytest.raises(SettingError, match=r"seed .* is not an integer in \["):
        image_items(["a.png"] * (2 if isinstance(seed, list) else 1), seed=seed, default_seed=0)


def test_a_field_of_view_given_as_a_string_is_refused_not_split():
    with pytest.raises(SettingError, match="field of view"):
        image_items(["a.png"], seed=None, fov="49", default_seed=0)


def test_names_and_seeds_must_match_the_images(fast_config, batch_images):
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu", until="camera") as pipe:
        with pytest.raises(ValueError, match="2 seeds for 3 images"):
            pipe.run_batch(batch_images, seed=[1, 2])
        with pytest.raises(ValueError, match=r"several images are named \['x'\]"):
            pipe.run_batch(batch_images[:2], names=["x", "x"])
