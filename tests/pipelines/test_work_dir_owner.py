"""The run that opened an image's records last owns them (issue 44 item 2): a run paused past its job's lease
(SIGSTOP) and taken over by another writes no stage record when it wakes, neither into the records the new owner
is using nor into a folder the new owner's end removed; the new owner writes as usual. Controls: a run alone
writes, and a folder never opened (a batch's spill) is written without a token."""
from __future__ import annotations

import shutil

import pytest
import torch

from pipelines.work_dir import OWNER, RecordsTakenOver, StageKey, WorkDir
from pixal3d.staging import StageRecord

KEY = StageKey("structure", "k" * 64, {})


def _save(work: WorkDir, image: str = "a") -> None:
    work.save(image, KEY, StageRecord("structure", 0.1, []), {"x": torch.arange(4.0)}, None)


def test_a_run_alone_writes_its_records(tmp_path):
    work = WorkDir(tmp_path / "work")
    assert work.scan("a", [KEY]) == (0, None)
    _save(work)
    assert (work.folder("a") / "structure.json").exists()
    assert WorkDir(tmp_path / "work").scan("a", [KEY]) == (1, None)


def test_a_run_whose_records_another_run_opened_since_writes_none_of_them(tmp_path):
    stale, owner = WorkDir(tmp_path / "work"), WorkDir(tmp_path / "work")
    stale.scan("a", [KEY])
    owner.scan("a", [KEY])  # the job taken over: the new owner opens the records
    with pytest.raises(RecordsTakenOver, match="taken over by another run"):
        _save(stale)
    assert sorted(p.name for p in work_files(tmp_path)) == [OWNER]  # nothing of the stale run's, not even a tmp
    _save(owner)
    assert (owner.folder("a") / "structure.json").exists()


def test_a_run_whose_job_ended_elsewhere_does_not_bring_its_folder_back(tmp_path):
    stale, owner = WorkDir(tmp_path / "work"), WorkDir(tmp_path / "work")
    stale.scan("a", [KEY])
    owner.scan("a", [KEY])
    _save(owner)
    shutil.rmtree(owner.folder("a"))  # the new owner ended the job: its records go
    with pytest.raises(RecordsTakenOver):
        _save(stale)
    assert not stale.folder("a").exists()


def test_other_images_and_folders_never_opened_are_not_fenced(tmp_path):
    first, second = WorkDir(tmp_path / "work"), WorkDir(tmp_path / "work")
    first.scan("a", [KEY])
    second.scan("b", [KEY])  # a data group's other image: not a takeover of "a"
    _save(first, "a")
    _save(second, "b")
    spill = WorkDir(tmp_path / "spill")
    _save(spill, "c")  # a spill folder is written without being opened first
    assert (spill.folder("c") / "structure.json").exists()


def work_files(tmp_path):
    return list((tmp_path / "work" / "a").iterdir())
