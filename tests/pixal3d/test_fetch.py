"""pixal3d-fetch: everything a config needs comes down through the Fetcher (a fake Hub and a fake HTTP server
here: no network), at the pinned revision, a partial URL download is resumed, and a file whose size is not the
one listed is refused; afterwards the config resolves offline."""
from __future__ import annotations

import email.message
import sys
import types

import pytest
import yaml

from pixal3d.config import load_config
from pixal3d.fetch import fetch_all, main
from pixal3d.hub import CorruptWeightsError
from pixal3d.pipeline_json import resolve_weights
from pixal3d.tiny_weights import TINY_VERSION
from tests.support.cascade_fixtures import TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.fetch_hub import REV, FakeHub

NAF_URL = "https://example.invalid/naf.safetensors"


class FakeServer:
    """urlopen for NAF_URL: honours a Range header (206), records the headers asked for; ``short`` sends fewer
    bytes than its Content-Length announces."""

    def __init__(self, data: bytes):
        self.data = data
        self.ranges: list[str | None] = []
        self.short = 0
        self.answer: tuple[int, str] | None = None  # an HTTP error to answer with, e.g. (404, "Not Found")

    def urlopen(self, request, timeout: float = 0):  # request: urllib's Request
        import urllib.error

        assert request.full_url == NAF_URL
        asked = request.get_header("Range")
        self.ranges.append(asked)
        if self.answer is not None:
            raise urllib.error.HTTPError(NAF_URL, self.answer[0], self.answer[1], email.message.Message(), None)
        start = int(asked.removeprefix("bytes=").rstrip("-")) if asked else 0
        body = self.data[start:]
        headers = email.message.Message()
        headers["Content-Length"] = str(len(body))
        sent = body[:len(body) - self.short] if self.short else body
        return _Response(sent, headers, 206 if asked else 200)


class _Response:
    def __init__(self, body: bytes, headers: email.message.Message, status: int):
        self.body, self.headers, self.status = body, headers, status

    def read(self, n: int) -> bytes:
        chunk, self.body = self.body[:n], self.body[n:]
        return chunk

    def __enter__(self) -> _Response:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def fake(tiny_cache, tmp_path, monkeypatch):
    """A config of three Hub repos and a URL file, an empty HF cache and pixal3d cache, the fakes installed."""
    import urllib.request

    import huggingface_hub
    from huggingface_hub import constants

    tiny = tiny_cache / "tiny" / TINY_VERSION
    hub = FakeHub(tiny, tmp_path / "hub")
    server = FakeServer((tiny / "naf" / "naf.safetensors").read_bytes())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("PIXAL3D_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("hf_hub_url", "get_hf_file_metadata", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, getattr(hub, name))
    monkeypatch.setattr(urllib.request, "urlopen", server.urlopen)
    rembg_asked: list[str] = []
    monkeypatch.setitem(sys.modules, "rembg", types.SimpleNamespace(new_session=rembg_asked.append))
    config = tmp_path / "fetch.yaml"
    config.write_text(yaml.safe_dump({"base": str(TINY_CONFIG), "weights": {
        "pixal3d": {"repo": "t/p", "revision": REV},
        "dinov3": {"repo": "t/d", "revision": REV, "files": ["config.json", "model.safetensors"]},
        "naf": {"url": NAF_URL, "filename": "naf.safetensors"},
        "moge": {"repo": "t/m", "revision": REV, "files": ["model.pt"]},
        "rembg": "birefnet-general"}}))
    return types.SimpleNamespace(hub=hub, server=server, config=config, rembg=rembg_asked, tmp=tmp_path)


def test_fetch_downloads_everything_the_config_needs_at_its_revision_then_it_resolves_offline(fake, capsys):
    with pytest.raises(Exception, match="missing weights"):  # control: nothing is there before
        resolve_weights(load_config(fake.config).weights, offline=True, need_moge=True)
    assert main(["--config", str(fake.config)]) == 0
    names = {f for _, f, _ in fake.hub.downloads}
    assert "pipeline.json" in names and "model.safetensors" in names and "model.pt" in names
    assert sum(f.startswith("ckpts/") for f in names) == 14  # the seven checkpoints pipeline.json names, 2 files each
    assert {rev for _, _, rev in fake.hub.downloads} == {REV}
    assert fake.rembg == ["birefnet-general"]
    assert "is on disk" in capsys.readouterr().out
    resolved = resolve_weights(load_config(fake.config).weights, offline=True, need_moge=True)
    assert resolved.path("naf") == fake.tmp / "cache" / "downloads" / "naf.safetensors"
    assert resolved.path("naf").read_bytes() == fake.server.data
    fake.hub.downloads.clear()
    assert main(["--config", str(fake.config), "--no-rembg"]) == 0 and fake.hub.downloads == []  # nothing twice


def test_a_partial_url_download_is_resumed_from_where_it_stopped(fake):
    part = fake.tmp / "cache" / "downloads" / "naf.safetensors.part"
    part.parent.mkdir(parents=True)
    half = len(fake.server.data) // 2
    part.write_bytes(fake.server.data[:half])
    fetch_all(fake.config, rembg=False)
    assert fake.server.ranges == [f"bytes={half}-"]
    assert (fake.tmp / "cache" / "downloads" / "naf.safetensors").read_bytes() == fake.server.data
    assert not part.exists()


def test_a_download_shorter_than_announced_is_refused_and_named(fake, capsys):
    fake.server.short = 10
    assert main(["--config", str(fake.config), "--no-rembg"]) == 1
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "error:" in line]  # one line, naming the file and what happened
    assert "naf.safetensors" in line and "but the server announced" in line and "it was removed" in line
    assert not (fake.tmp / "cache" / "downloads" / "naf.safetensors").exists()
    fake.server.short = 0  # control: the same server sending everything is accepted
    assert main(["--config", str(fake.config), "--no-rembg"]) == 0


@pytest.mark.parametrize("answer", [(404, "Not Found"), (500, "Internal Server Error")])
def test_a_server_answering_an_error_for_the_url_file_is_one_line_naming_it(fake, capsys, answer):
    fake.server.answer = answer
    assert main(["--config", str(fake.config), "--no-rembg"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"pixal3d-fetch: error: {NAF_URL} answered {answer[0]} {answer[1]} for naf.safetensors") and \
        sum("error" in line for line in err) == 1, err


def test_a_hub_file_of_another_size_than_listed_is_refused(fake):
    fake.hub.wrong_size = "model.safetensors"
    with pytest.raises(CorruptWeightsError, match=r"model\.safetensors .*bytes, but the Hub lists model\.safetensors "
                                                  r"with \d+; it was removed, run pixal3d-fetch again"):
        fetch_all(fake.config, rembg=False)
    assert not list((fake.tmp / "hub" / "models--t--d").rglob("model.safetensors"))  # not left for a run to read
    fake.hub.wrong_size = None  # control: the same file at the listed size is kept
    fake.hub.downloads.clear()
    fetch_all(fake.config, rembg=False)
    assert ("t/d", "model.safetensors", REV) in fake.hub.downloads
    resolve_weights(load_config(fake.config).weights, offline=True, need_moge=True)
