"""The command run in this process, and the checks its answers share (one error line, a folder's files)."""
from __future__ import annotations

from pathlib import Path

from pipelines import cli


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("pixal3d-image-to-mesh: error: ")
    return lines[0]


def missing_weights_lines(err: str, config: Path | str) -> list[str]:
    """A missing-weights error: the error line, one line per file, and last the one command that fetches them."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("pixal3d-image-to-mesh: error: missing weights: "), err
    assert lines[-1] == f"fetch everything this config needs with: pixal3d-fetch --config {config}", err
    return lines


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []
