"""A Hub that serves the tiny weights into the HF cache layout, for pixal3d-fetch."""
from __future__ import annotations

import types
from pathlib import Path

REV = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Repos t/p, t/d, t/m served from the tiny weights: hf_hub_download writes into the HF cache layout,
    get_hf_file_metadata lists each file's size (``wrong_size`` makes the listing disagree for one file)."""

    def __init__(self, tiny: Path, hub: Path):
        self.repos = {"t/p": tiny / "pixal3d", "t/d": tiny / "dinov3", "t/m": tiny / "moge"}
        self.hub = hub
        self.downloads: list[tuple[str, str, str]] = []
        self.wrong_size: str | None = None

    def hf_hub_url(self, repo_id: str, filename: str, *, revision: str | None = None, **_: object) -> str:
        return f"fake://{repo_id}@{revision}/{filename}"

    def get_hf_file_metadata(self, url: str, **_: object) -> types.SimpleNamespace:
        owner, rest = url.removeprefix("fake://").split("/", 1)
        name_rev, filename = rest.split("/", 1)
        repo = f"{owner}/{name_rev.split('@')[0]}"
        size = (self.repos[repo] / filename).stat().st_size
        return types.SimpleNamespace(size=size + 1 if filename == self.wrong_size else size)

    def hf_hub_download(self, *, repo_id: str, filename: str, revision: str, **_: object) -> str:
        self.downloads.append((repo_id, filename, revision))
        repo_dir = self.hub / f"models--{repo_id.replace('/', '--')}"
        target = repo_dir / "snapshots" / revision / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(revision)
        target.write_bytes((self.repos[repo_id] / filename).read_bytes())
        return str(target)
