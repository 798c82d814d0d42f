"""The TRELLIS.2 reference assembler: its files copied byte for byte from a git repository or a checkout, the
stand-ins written and valid Python, the folder kept out of the repository."""
import py_compile
import subprocess
from pathlib import Path

import pytest

from scripts import assemble_trellis2_reference as assembler


@pytest.fixture
def checkout(tmp_path):
    """A stand-in TRELLIS.2 checkout: each listed file holds its own path (so a mix-up shows)."""
    root = tmp_path / "TRELLIS.2"
    for path in assembler.FILES:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(f"# {path}\n")
    return root


def _check(out):
    for path in assembler.FILES:
        assert (out / path).read_text() == f"# {path}\n", path
    for path in assembler.STAND_INS:
        if path.endswith(".py"):
            py_compile.compile(str(out / path), doraise=True)
    readme = (out / "README.md").read_text()
    assert all(path in readme for path in (*assembler.FILES, *assembler.STAND_INS))


def test_a_checkout_folder_is_copied_file_for_file_with_the_stand_ins(checkout, tmp_path):
    out = assembler.assemble(checkout, tmp_path / "ref")
    _check(out)
    assert "not checked" in (out / "README.md").read_text()  # a folder without git: the commit is not known


def test_a_git_repository_is_read_at_the_commit_not_its_work_tree(checkout, tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(checkout), *args], check=True, capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "files")
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    (checkout / assembler.FILES[0]).write_text("changed after the commit\n")
    out = assembler.assemble(checkout, tmp_path / "ref", commit[:7])
    _check(out)
    assert commit in (out / "README.md").read_text()


def test_the_folder_may_not_be_inside_the_repository(checkout):
    inside = Path(assembler.__file__).resolve().parents[1] / "trellis2-reference-here"
    with pytest.raises(SystemExit):
        assembler.main(["--out", str(inside), "--source", str(checkout)])
    assert not inside.exists()
