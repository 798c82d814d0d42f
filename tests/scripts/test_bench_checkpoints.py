"""The benchmark's random-checkpoint writer: headers match the manifest, bytes are reproducible."""
import json
import math

import pytest
import torch
from safetensors import safe_open

from scripts import write_random_checkpoints as wrc

TINY_MANIFEST = {
    "models": {
        "tiny_flow": {
            "file": "ckpts/tiny_flow_bf16", "class": "TinyFlow", "dtype": "BF16",
            "args": {"model_channels": 8, "num_blocks": 2},
            "tensors": {"blocks.0.attn.to_qkv.weight": [24, 8], "blocks.0.attn.to_qkv.bias": [24],
                        "blocks.0.norm1.weight": [8], "blocks.0.norm1.bias": [8],
                        "blocks.0.attn.q_rms_norm.gamma": [2, 4], "modulation": [48]},
        },
        "tiny_dec": {
            "file": "ckpts/tiny_dec_fp16", "class": "TinyDecoder", "dtype": "F16",
            "args": {"channels": [4, 2]},
            "tensors": {"conv.weight": [4, 2, 3, 3, 3], "conv.bias": [4], "big": [3, 1000]},
        },
    }
}


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "checkpoints.json"
    path.write_text(json.dumps(TINY_MANIFEST))
    return path


def _write(cache, manifest):
    return wrc.write_all(cache, manifest, only=["tiny_flow", "tiny_dec"])


def test_written_headers_match_the_manifest_exactly(tmp_path, manifest):
    stems = _write(tmp_path / "cache", manifest)
    for key, entry in TINY_MANIFEST["models"].items():
        stem = stems[key]
        assert stem == tmp_path / "cache" / entry["file"]
        with safe_open(str(stem.with_name(stem.name + ".safetensors")), framework="pt") as f:
            assert set(f.keys()) == set(entry["tensors"])
            for name, shape in entry["tensors"].items():
                tensor = f.get_tensor(name)
                assert list(tensor.shape) == shape
                assert tensor.dtype == {"BF16": torch.bfloat16, "F16": torch.float16}[entry["dtype"]]
                assert torch.isfinite(tensor.float()).all()
        assert json.loads(stem.with_name(stem.name + ".json").read_text()) == {
            "name": entry["class"], "args": entry["args"]}


def test_values_follow_the_fan_in_rule(tmp_path, manifest):
    stem = _write(tmp_path / "cache", manifest)["tiny_flow"]
    with safe_open(str(stem.with_name(stem.name + ".safetensors")), framework="pt") as f:
        qkv = f.get_tensor("blocks.0.attn.to_qkv.weight").float()
        assert qkv.abs().max() <= math.sqrt(3 / 8) * 1.01 and qkv.std() > 0.2  # ±sqrt(3/fan_in), bf16-rounded
        assert torch.equal(f.get_tensor("blocks.0.norm1.weight").float(), torch.ones(8))
        assert torch.equal(f.get_tensor("blocks.0.norm1.bias").float(), torch.zeros(8))
        assert torch.equal(f.get_tensor("blocks.0.attn.q_rms_norm.gamma").float(), torch.ones(2, 4))
        assert 0 < f.get_tensor("modulation").float().abs().max() <= 0.02


def test_same_bytes_twice_and_different_files_differ(tmp_path, manifest):
    first = _write(tmp_path / "a", manifest)
    second = _write(tmp_path / "b", manifest)
    for key in first:
        a = first[key].with_name(first[key].name + ".safetensors").read_bytes()
        b = second[key].with_name(second[key].name + ".safetensors").read_bytes()
        assert a == b
    # control: the same tensor name in another file gets another stream, so equality above is not vacuous
    spec = wrc.TensorSpec("w", (64,), "F32")
    assert wrc.tensor_bytes("ckpts/x", spec, 0, 64) != wrc.tensor_bytes("ckpts/y", spec, 0, 64)


def test_streams_are_counter_based_so_chunks_concatenate(monkeypatch):
    spec = wrc.TensorSpec("w", (10, 300), "BF16")
    whole = wrc.tensor_bytes("f", spec, 0, 3000)
    parts = wrc.tensor_bytes("f", spec, 0, 1234) + wrc.tensor_bytes("f", spec, 1234, 3000 - 1234)
    assert whole == parts


def test_an_existing_identical_file_is_reused_and_a_damaged_one_rewritten(tmp_path, manifest):
    stem = _write(tmp_path / "cache", manifest)["tiny_dec"]
    path = stem.with_name(stem.name + ".safetensors")
    good = path.read_bytes()
    specs = wrc.manifest_specs(TINY_MANIFEST["models"]["tiny_dec"])
    assert wrc.write_safetensors(path, "ckpts/tiny_dec_fp16", specs) is False
    path.write_bytes(good[:-2] + b"\0\0")  # same size, same header: data damage is not detected...
    assert wrc.write_safetensors(path, "ckpts/tiny_dec_fp16", specs) is False
    path.write_bytes(good[:-2])  # ...but a truncated file is rewritten
    assert wrc.write_safetensors(path, "ckpts/tiny_dec_fp16", specs) is True
    assert path.read_bytes() == good


def test_real_manifest_headers_account_for_every_parameter():
    models = json.loads(wrc.DEFAULT_MANIFEST.read_text())["models"]
    for key, entry in models.items():
        specs = wrc.manifest_specs(entry)
        assert sum(s.numel for s in specs) == entry["params"], key
        header = wrc.safetensors_header(sorted(specs, key=lambda s: s.name))
        assert len(header) % 8 == 0
        parsed = json.loads(header[8:])
        assert parsed.pop("__metadata__")["format"] == "pt"
        assert max(v["data_offsets"][1] for v in parsed.values()) == entry["params"] * 2, key


def test_unknown_model_names_are_refused(tmp_path, manifest):
    with pytest.raises(SystemExit, match="not in"):
        wrc.write_all(tmp_path, manifest, only=["no_such_model"])
