"""Issue 30, item 3: the work directory's writes are reported like the outputs': a full disk while writing a
stage record is one line naming the record and exit 1 (not safetensors' traceback), a read-only work directory
is refused before any weight is read, and nothing half-written is left either way."""
from __future__ import annotations

import errno
import tempfile

import pytest

from pipelines import work_dir as work_dir_module
from pipelines.work_dir import WorkDir, WorkDirError
from tests.support.batch_fixtures import fast_config  # noqa: F401
from tests.support.cascade_fixtures import EXAMPLE, tiny_cache  # noqa: F401
from tests.support.cli import files_in, one_error_line, run_cli
from tests.support.disk import file_size_limit


def test_a_full_disk_while_writing_a_stage_record_is_one_line_exit_1_and_leaves_no_partial_record(
        fast_config, tmp_path, capsys):
    out, work = tmp_path / "out" / "example.glb", tmp_path / "work"
    with file_size_limit(64 * 1024):  # the marker fits, the preprocess record (the 518² image) does not
        code, _, err = run_cli(capsys, EXAMPLE, "--config", fast_config, "-o", out, "--work-dir", work, "--quiet")
    line = one_error_line(err)
    assert code == 1 and "File too large while writing" in line and str(work / "example" / "preprocess.safetensors") in line
    assert "Traceback" not in err and "SafetensorError" not in line
    assert files_in(out.parent) == []
    # no record, no temporary: only the marker and the token of the run that opened the image's records
    assert sorted(p.name for p in work.rglob("*")) == [".owner", "example", "pixal3d-work.json"]


def test_save_tensors_turns_safetensors_io_errors_into_the_os_error_naming_the_target(tmp_path):
    import torch

    target = tmp_path / "t.safetensors"
    with file_size_limit(1024), pytest.raises(OSError) as caught:
        work_dir_module.save_tensors({"x": torch.zeros(4096)}, tmp_path / ".t.tmp", target, metadata={})
    assert caught.value.errno == errno.EFBIG and caught.value.filename == str(target)


def test_a_read_only_work_dir_is_refused_when_opened(tmp_path, monkeypatch):
    work = tmp_path / "work"
    WorkDir(work)  # an existing work directory, marker written

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(work / ".pixal3d-write-test-x.tmp"))
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(WorkDirError, match="Read-only file system"):
        WorkDir(work)


def test_a_read_only_work_dir_is_refused_before_any_weight_is_read(fast_config, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    WorkDir(work)
    real = tempfile.NamedTemporaryFile

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and str(dir) == str(work):
            raise OSError(errno.EROFS, "Read-only file system", str(work))
        return real(*args, dir=dir, **kwargs)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    code, _, err = run_cli(capsys, EXAMPLE, "--config", fast_config, "-o", tmp_path / "o.glb", "--work-dir", work)
    line = one_error_line(err)
    assert code == 2 and str(work) in line and "Read-only file system" in line and "--work-dir" in line
