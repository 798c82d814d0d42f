"""Weight resolution: local folders, the Hugging Face cache offline, URL files, tiny generation; missing files
and truncated/corrupt safetensors become one clear error; tiny weights are byte-for-byte deterministic."""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from pixal3d.tiny_weights import TINY_VERSION, write_tiny_weights
from pixal3d.config import WeightsConfig, WeightSource
from pixal3d.hub import CorruptWeightsError, MissingWeightsError, read_safetensors_header, verify_safetensors
from pixal3d.pipeline_json import PIPELINE_MODELS, planned_sizes, resolve_weights
from tests.support.cascade_fixtures import tiny_cache  # noqa: F401

REV = "b0cb2e1b794cab9aa0ac38a95d794a4d9337437f"


def _tiny_dir(cache: Path) -> Path:
    return cache / "tiny" / TINY_VERSION


def _local(folder: Path, **extra) -> WeightsConfig:
    return WeightsConfig(pixal3d=WeightSource(local=str(folder / "pixal3d")),
                         dinov3=WeightSource(local=str(folder / "dinov3")),
                         naf=WeightSource(local=str(folder / "naf"), files=("naf.safetensors",)), rembg=None, **extra)


@pytest.fixture
def local_copy(tiny_cache, tmp_path) -> Path:
    """A writable copy of the tiny weights (tests damage it)."""
    return Path(shutil.copytree(_tiny_dir(tiny_cache), tmp_path / "w"))


def test_local_folder_resolves_every_checkpoint_and_reads_normalization_from_pipeline_json(local_copy):
    pipeline = json.loads((local_copy / "pixal3d" / "pipeline.json").read_text())
    pipeline["args"]["shape_slat_normalization"]["mean"][0] = 1.25  # not hard-coded anywhere
    (local_copy / "pixal3d" / "pipeline.json").write_text(json.dumps(pipeline))
    resolved = resolve_weights(_local(local_copy), offline=True)
    assert sorted(resolved.checkpoints) == sorted(PIPELINE_MODELS)
    assert all(stem.with_suffix(".safetensors").is_file() for stem in resolved.checkpoints.values())
    assert resolved.shape_normalization.mean[0] == 1.25
    assert resolved.path("naf") == local_copy / "naf" / "naf.safetensors"


def test_missing_checkpoint_names_the_file_the_folder_and_what_to_do(local_copy):
    (local_copy / "pixal3d" / "ckpts" / "tex_dec_tiny.safetensors").unlink()
    with pytest.raises(MissingWeightsError) as info:
        resolve_weights(_local(local_copy), offline=True)
    message = str(info.value)
    assert "ckpts/tex_dec_tiny.safetensors" in message and str(local_copy / "pixal3d") in message
    lines = message.splitlines()  # a heading per source, each file on its own line
    assert "weights.pixal3d" in lines[1] and "    ckpts/tex_dec_tiny.safetensors" in lines


def test_hub_repo_offline_with_an_empty_cache_gives_the_download_command(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    weights = WeightsConfig(pixal3d=WeightSource(repo="TencentARC/Pixal3D", revision=REV),
                            dinov3=WeightSource(local=str(tmp_path)),
                            naf=WeightSource(local=str(tmp_path), files=("naf.safetensors",)))
    with pytest.raises(MissingWeightsError) as info:
        resolve_weights(weights)
    lines = str(info.value).splitlines()
    # pipeline.json and the 14 files it names at the pinned revision (PINNED_CHECKPOINTS), each on its own line
    assert lines[0] == "missing weights: 18 files a run needs are not on this machine"  # + DINOv3 2, NAF 1
    assert lines[1] == f"  weights.pixal3d from TencentARC/Pixal3D@{REV}:" and lines[2] == "    pipeline.json"
    assert "    ckpts/ss_flow_img_dit_1_3B_64_bf16.safetensors (named by pipeline.json at this revision)" in lines
    assert sum("named by pipeline.json" in line for line in lines) == 14
    command = next(line for line in lines if "hf download" in line)
    assert command.startswith("or this source alone (online): hf download TencentARC/Pixal3D ckpts/")
    assert command.endswith(f" pipeline.json --revision {REV}")
    assert "HF_HUB_OFFLINE is set, so only the local cache was searched" in lines
    assert lines[-1] == "fetch everything this config needs with: pixal3d-fetch --config CONFIG"


def test_an_unknown_revision_lists_pipeline_json_alone(tmp_path, monkeypatch):
    """Control for the pinned listing: at a revision PINNED_CHECKPOINTS does not know, nothing is guessed."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    weights = WeightsConfig(pixal3d=WeightSource(repo="TencentARC/Pixal3D", revision="1" * 40),
                            dinov3=WeightSource(local=str(tmp_path)),
                            naf=WeightSource(local=str(tmp_path), files=("naf.safetensors",)))
    with pytest.raises(MissingWeightsError) as info:
        resolve_weights(weights, offline=True, config_file="my.yaml")
    lines = str(info.value).splitlines()
    assert lines[0].startswith("missing weights: 4 files") and "named by pipeline.json" not in str(info.value)
    assert lines[-1] == "fetch everything this config needs with: pixal3d-fetch --config my.yaml"


def test_hub_repo_offline_uses_the_local_hugging_face_cache(local_copy, tmp_path, monkeypatch):
    """A snapshot already in the HF cache (layout models--owner--name/snapshots/<rev>/) is used offline."""
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    snapshot = hub / "models--TencentARC--Pixal3D" / "snapshots" / REV
    shutil.copytree(local_copy / "pixal3d", snapshot)
    (hub / "models--TencentARC--Pixal3D" / "refs").mkdir()
    (hub / "models--TencentARC--Pixal3D" / "refs" / "main").write_text(REV)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    weights = _local(local_copy)
    weights = WeightsConfig(pixal3d=WeightSource(repo="TencentARC/Pixal3D", revision=REV), dinov3=weights.dinov3,
                            naf=weights.naf, rembg=None)
    resolved = resolve_weights(weights, offline=True)
    assert resolved.pipeline_dir == snapshot
    (snapshot / "ckpts" / "ss_flow_tiny.json").unlink()
    with pytest.raises(MissingWeightsError, match=r"\n    ckpts/ss_flow_tiny\.json\n(.*\n)*or this source alone "
                                                  r"\(online\): hf download TencentARC/Pixal3D ckpts/ss_flow_tiny\.json "):
        resolve_weights(weights, offline=True)


def test_url_source_offline_and_checksum(tmp_path, monkeypatch, local_copy):
    monkeypatch.setenv("PIXAL3D_CACHE", str(tmp_path / "cache"))
    url = WeightSource(url="https://example.invalid/naf_release.pth", filename="naf_release.pth")
    weights = WeightsConfig(pixal3d=WeightSource(local=str(local_copy / "pixal3d")),
                            dinov3=WeightSource(local=str(local_copy / "dinov3")), naf=url, rembg=None)
    with pytest.raises(MissingWeightsError, match=r"\n    naf_release\.pth\n(.*\n)*or this file alone: curl -L -o "
                                                  r".*naf_release\.pth https://example\.invalid/"):
        resolve_weights(weights, offline=True)
    target = tmp_path / "cache" / "downloads" / "naf_release.pth"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"weights")
    assert resolve_weights(weights, offline=True).path("naf") == target
    pinned = WeightsConfig(pixal3d=weights.pixal3d, dinov3=weights.dinov3, rembg=None,
                           naf=WeightSource(url=url.url, filename=url.filename, sha256="0" * 64))
    with pytest.raises(CorruptWeightsError, match="sha256"):
        resolve_weights(pinned, offline=True)
    good = hashlib.sha256(b"weights").hexdigest()
    pinned = WeightsConfig(pixal3d=weights.pixal3d, dinov3=weights.dinov3, rembg=None,
                           naf=WeightSource(url=url.url, filename=url.filename, sha256=good))
    assert resolve_weights(pinned, offline=True).path("naf") == target


def test_truncated_safetensors_is_a_clear_error_before_loading(local_copy):
    path = local_copy / "pixal3d" / "ckpts" / "shape_dec_tiny.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CorruptWeightsError, match=r"shape_dec_tiny\.safetensors is truncated .*download it again"):
        resolve_weights(_local(local_copy), offline=True)


def test_corrupt_header_and_lfs_pointer_are_clear_errors(tmp_path, local_copy):
    good = local_copy / "pixal3d" / "ckpts" / "ss_dec_tiny.safetensors"
    assert verify_safetensors(good) > 0 and "out_layer.2.bias" in read_safetensors_header(good)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}" + b"\0" * 10)
    with pytest.raises(CorruptWeightsError, match="corrupt header"):
        verify_safetensors(garbage)
    pointer = tmp_path / "pointer.safetensors"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(CorruptWeightsError, match="git-lfs pointer"):
        verify_safetensors(pointer)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CorruptWeightsError, match="truncated or not a safetensors file"):
        verify_safetensors(huge)


def test_tiny_weights_are_the_same_bytes_every_time(tmp_path, tiny_cache):
    fresh = write_tiny_weights(tmp_path / "again")
    reference = _tiny_dir(tiny_cache)
    files = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    assert len(files) == 7 * 2 + 1 + 2 + 2 + 1 + 2  # checkpoints, pipeline.json, DINOv3, NAF, MoGe-2, shape encoder
    for rel in files:
        assert (fresh / rel).read_bytes() == (reference / rel).read_bytes(), rel


def test_generated_source_resolves_from_the_pixal3d_cache(tiny_cache):
    weights = WeightsConfig(pixal3d=WeightSource(generate="tiny"), dinov3=WeightSource(generate="tiny"),
                            naf=WeightSource(generate="tiny", files=("naf.safetensors",)), rembg=None)
    resolved = resolve_weights(weights, offline=True)
    assert resolved.pipeline_dir == _tiny_dir(tiny_cache) / "pixal3d"


def test_a_checkpoint_named_in_another_repository_is_taken_from_this_one(local_copy):
    path = local_copy / "pixal3d" / "pipeline.json"
    pipeline = json.loads(path.read_text())
    pipeline["args"]["models"]["sparse_structure_decoder"] = "microsoft/TRELLIS-image-large/ckpts/ss_dec_tiny"
    path.write_text(json.dumps(pipeline))
    resolved = resolve_weights(_local(local_copy), offline=True)
    assert resolved.checkpoints["sparse_structure_decoder"] == local_copy / "pixal3d" / "ckpts" / "ss_dec_tiny"


def test_planned_sizes_read_headers_on_disk(local_copy):
    sizes, notes = planned_sizes(_local(local_copy), models=[*PIPELINE_MODELS, "dinov3", "naf"], offline=True)
    stem = local_copy / "pixal3d" / "ckpts" / "ss_flow_tiny.safetensors"
    assert sizes["sparse_structure_flow_model"] == verify_safetensors(stem) and notes == []
    assert sizes["naf"] == (local_copy / "naf" / "naf.safetensors").stat().st_size


def test_planned_sizes_of_weights_not_downloaded_come_from_hub_headers_without_downloading(local_copy, tmp_path,
                                                                                             monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    shutil.copy(local_copy / "pixal3d" / "pipeline.json", snapshot / "pipeline.json")
    asked = []

    def snapshot_download(repo_id, revision, allow_patterns, local_files_only):
        assert allow_patterns == ["pipeline.json"]  # the plan never downloads a checkpoint
        return str(snapshot)

    class _Tensor:
        def __init__(self, start: int, end: int):
            self.data_offsets = (start, end)

    class _Meta:
        def __init__(self):
            self.tensors = {"a": _Tensor(0, 1000), "b": _Tensor(1000, 1500)}

    def parse(repo_id, filename, revision):
        asked.append((repo_id, filename, revision))
        return _Meta()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "parse_safetensors_file_metadata", parse)
    weights = WeightsConfig(pixal3d=WeightSource(repo="TencentARC/Pixal3D", revision=REV),
                            dinov3=WeightSource(local=str(local_copy / "dinov3")),
                            naf=WeightSource(local=str(local_copy / "naf"), files=("naf.safetensors",)))
    sizes, _ = planned_sizes(weights, models=PIPELINE_MODELS, offline=False)
    assert set(sizes.values()) == {1500} and len(asked) == 7
    assert ("TencentARC/Pixal3D", "ckpts/ss_flow_tiny.safetensors", REV) in asked
    assert sorted(p.name for p in snapshot.iterdir()) == ["pipeline.json"]


def test_the_plans_missing_weights_list_is_pixal3d_fetchs_list(tmp_path, monkeypatch):
    """Offline with an empty cache, planning the real 1024 cascade names every file pixal3d-fetch downloads
    (pipeline_json.missing_files: one list, one source): DINOv3's config.json, NAF's release file and MoGe-2's
    model.pt included, which the plan's own lookups (headers only) never asked for."""
    from huggingface_hub import constants

    from pipelines import Pixal3D
    from pixal3d.config import load_config, shipped_config
    from pixal3d.hub import merged_missing
    from pixal3d.pipeline_json import missing_files

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PIXAL3D_CACHE", str(tmp_path / "cache"))
    config = load_config(shipped_config("1024_cascade.yaml"))
    with pytest.raises(MissingWeightsError) as info:
        Pixal3D.plan(config, device="cpu")
    listed = {line.strip().split(" (")[0] for line in str(info.value).splitlines() if line.startswith("    ")}
    fetched = {name for entry in merged_missing(missing_files(config.weights, include_moge=True).missing)
               for name in entry.files}
    assert listed == fetched and len(listed) == 19
    assert {"config.json", "naf_release.pth", "model.pt"} <= listed
    assert str(info.value).splitlines()[0] == "missing weights: 19 files a run needs are not on this machine"
