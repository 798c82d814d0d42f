"""MoGe-2 and DINOv3 streamed by their ViT blocks (the ``stream`` policy, issue 48): the same bits as the whole
models, on the toy configs and at the released widths with two blocks; the blocks really stream (on ``meta`` between
uses, never more than two on the device); a block whose bytes differ by one bit changes the result (the control)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pixal3d.models.dinov3 import (
    STREAM_LISTS,
    extract_tokens,
    load_dinov3,
    load_dinov3_streamed,
    tiny_dinov3_config,
    write_tiny_dinov3,
)
from pixal3d.models.moge import (
    BACKBONES,
    ViTSize,
    build_moge,
    load_moge,
    load_moge_streamed,
)
from pixal3d.staging import WeightStream
from pixal3d.staging.stream import IN_FLIGHT, StreamedList, streamed_units
from pixal3d.tiny_weights import _write_moge
from scripts.write_random_checkpoints import DINOV3_VITL16


def _image(side: int, batch: int | None = None) -> torch.Tensor:
    shape = (3, side, side) if batch is None else (batch, 3, side, side)
    return torch.rand(shape, generator=torch.Generator().manual_seed(3))


def _count_resident(model: nn.Module) -> list[int]:
    """Resident units seen at each block's forward (hooks on the streamed lists' children)."""
    seen: list[int] = []
    units = streamed_units(model)
    for module in model.modules():
        if isinstance(module, StreamedList):
            for child in module.children():
                child.register_forward_pre_hook(lambda *_: seen.append(sum(u.resident for u in units)))
    return seen


def _flip_one_bit(model: nn.Module, index: int) -> None:
    """The control: one tensor of streamed unit ``index`` read from a source whose first element is one ulp off."""
    unit = streamed_units(model)[index]
    tensor = unit.tensors[0]
    source = tensor.source.read() if hasattr(tensor.source, "read") else tensor.source.clone()
    source.view(torch.int32).view(-1)[0] ^= 1
    unit.tensors = (dataclasses.replace(tensor, source=source), *unit.tensors[1:])


# -- MoGe-2 ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_moge_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moge")
    _write_moge(folder)
    return folder / "model.pt"


def _moge_outputs(model, image, **kwargs):
    out = model.infer(image, use_fp16=False, **kwargs)
    return out.points, out.depth, out.intrinsics, out.mask


@pytest.mark.parametrize("copy", [True, False])
def test_streamed_moge_infers_the_whole_models_bits_with_two_blocks_at_most_on_the_device(tiny_moge_file, copy):
    whole = load_moge(tiny_moge_file)
    stream = WeightStream("cpu", copy=copy)
    streamed = load_moge_streamed(tiny_moge_file, stream)
    blocks = streamed.encoder.backbone.blocks
    assert isinstance(blocks, StreamedList) and all(p.is_meta for p in blocks.parameters())
    seen = _count_resident(streamed)
    expected = _moge_outputs(whole, _image(56))
    for _ in range(2):
        got = _moge_outputs(streamed, _image(56))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert max(seen) <= IN_FLIGHT and not any(u.resident for u in streamed_units(streamed))
    assert stream.stats.units == 2 * len(blocks)
    stream.close()


def test_control_a_moge_block_one_bit_off_changes_the_points(tiny_moge_file):
    whole = load_moge(tiny_moge_file)
    stream = WeightStream("cpu")
    streamed = load_moge_streamed(tiny_moge_file, stream)
    _flip_one_bit(streamed, 1)
    assert not torch.equal(_moge_outputs(streamed, _image(56))[0], _moge_outputs(whole, _image(56))[0])
    stream.close()


def test_streamed_moge_at_the_released_width_with_two_blocks_gives_the_whole_models_bits(tmp_path, monkeypatch):
    """ViT-L/14's width and heads, the released neck and heads, two blocks (the released 24 stream the same way)."""
    import json
    from pathlib import Path

    config = json.loads((Path(__file__).resolve().parents[3] / "assets" / "moge_checkpoint.json").read_text())
    config = config["model_config"]
    config["encoder"] = {**config["encoder"], "intermediate_layers": [0, 1]}
    monkeypatch.setitem(BACKBONES, "dinov2_vitl14", ViTSize(1024, 2, 16))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_moge(config, device="cpu")
    path = tmp_path / "model.pt"
    torch.save({"model_config": config, "model": model.state_dict()}, path)
    whole = load_moge(path)
    stream = WeightStream("cpu")
    streamed = load_moge_streamed(path, stream)
    assert len(streamed_units(streamed)) == 2
    got, expected = (_moge_outputs(m, _image(112), num_tokens=64) for m in (streamed, whole))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    stream.close()


# -- DINOv3 ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dinov3(tmp_path_factory):
    return write_tiny_dinov3(tmp_path_factory.mktemp("dinov3"), config=tiny_dinov3_config(num_hidden_layers=3))


@pytest.mark.parametrize("copy", [True, False])
def test_streamed_dinov3_gives_the_whole_models_tokens_with_two_layers_at_most_on_the_device(tiny_dinov3, copy):
    whole = load_dinov3(tiny_dinov3)
    stream = WeightStream("cpu", copy=copy)
    streamed = load_dinov3_streamed(tiny_dinov3, stream)
    layers = streamed.get_submodule(STREAM_LISTS[0])
    assert isinstance(layers, StreamedList) and all(p.is_meta for p in layers.parameters())
    assert streamed.config._attn_implementation == whole.config._attn_implementation
    seen = _count_resident(streamed)
    pixels = _image(64, batch=2) * 2 - 1
    with torch.no_grad():
        expected = extract_tokens(whole, pixels)
        assert all(torch.equal(extract_tokens(streamed, pixels), expected) for _ in range(2))
        assert torch.equal(streamed(pixels).last_hidden_state, whole(pixels).last_hidden_state)  # its own forward
    assert max(seen) <= IN_FLIGHT and not any(u.resident for u in streamed_units(streamed))
    stream.close()


def test_streamed_dinov3_reads_a_file_with_the_names_saved_before_transformers_5(tiny_dinov3, tmp_path):
    """The released ``model.safetensors`` may name its layers ``layer.N.`` (transformers 5 loads them as
    ``model.layer.N.``): streamed, they load under the model's names."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "old"
    shutil.copytree(tiny_dinov3, folder)
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    assert any(k.startswith("layer.0.") for k in load_file(str(folder / "model.safetensors")))
    stream = WeightStream("cpu")
    streamed = load_dinov3_streamed(folder, stream)
    pixels = _image(64, batch=1)
    with torch.no_grad():
        assert torch.equal(extract_tokens(streamed, pixels), extract_tokens(load_dinov3(tiny_dinov3), pixels))
    stream.close()


def test_control_a_dinov3_layer_one_bit_off_changes_the_tokens(tiny_dinov3):
    whole = load_dinov3(tiny_dinov3)
    stream = WeightStream("cpu")
    streamed = load_dinov3_streamed(tiny_dinov3, stream)
    _flip_one_bit(streamed, 2)
    pixels = _image(64, batch=1)
    with torch.no_grad():
        assert not torch.equal(extract_tokens(streamed, pixels), extract_tokens(whole, pixels))
    stream.close()


def test_streamed_dinov3_at_the_released_width_with_two_layers_gives_the_whole_models_tokens(tmp_path):
    config = tiny_dinov3_config(**{**DINOV3_VITL16, "num_hidden_layers": 2})
    folder = write_tiny_dinov3(tmp_path / "vitl", config=config)
    stream = WeightStream("cpu")
    streamed = load_dinov3_streamed(folder, stream)
    pixels = _image(256, batch=1)
    with torch.no_grad():
        assert torch.equal(extract_tokens(streamed, pixels), extract_tokens(load_dinov3(folder), pixels))
    assert stream.stats.units == 2
    stream.close()


# -- MoGe-2's conv neck and heads in row bands -------------------------------------------------------

def test_the_toys_narrow_convs_run_whole_when_bands_are_asked_for(tiny_moge_file):
    """At 8-16 channels the bands changed the bits on this CPU (``conv_in_bands``): the toy's convs run whole (each
    3×3 conv called as a module, which a band never is), so its results with ``band_rows`` are the whole model's."""
    whole = load_moge(tiny_moge_file)
    convs = [m for m in whole.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    called = []
    for conv in convs:
        conv.register_forward_hook(lambda module, *_: called.append(module))
    got = _moge_outputs(whole, _image(56), band_rows=7)
    assert convs and set(map(id, called)) == set(map(id, convs))
    assert all(torch.equal(a, b) for a, b in zip(got, _moge_outputs(whole, _image(56))))


def test_a_wide_conv_in_bands_is_never_called_whole_and_gives_its_bits():
    """The released widths band: the module is not called (its bands are), and the bits are the whole conv's."""
    from pixal3d.models.moge import conv_in_bands

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        conv = nn.Conv2d(64, 32, 3, padding=1, padding_mode="replicate")
    x = torch.randn(1, 64, 200, 120, generator=torch.Generator().manual_seed(2))
    called = []
    conv.register_forward_hook(lambda *_: called.append(1))
    with torch.no_grad():
        banded = conv_in_bands(conv, x, 64)
        assert not called and torch.equal(banded, conv(x))


def _released_tail(grid: int):
    """MoGe-2's released neck and points head (random weights) and their inputs on a ``grid``² token grid."""
    import json
    from pathlib import Path

    from pixal3d.models.moge import ConvStack, normalized_view_plane_uv

    config = json.loads((Path(__file__).resolve().parents[3] / "assets" / "moge_checkpoint.json").read_text())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        neck, head = ConvStack(**config["model_config"]["neck"]), ConvStack(**config["model_config"]["points_head"])
    g = torch.Generator().manual_seed(1)
    uv = [normalized_view_plane_uv(grid * 2 ** i, grid * 2 ** i, 1.0, dtype=torch.float32, device="cpu")
          .permute(2, 0, 1)[None] for i in range(5)]
    levels = [torch.cat([torch.randn(1, 1024, grid, grid, generator=g), uv[0]], dim=1), *uv[1:]]
    return neck, head, levels


def _tail(neck, head, levels, rows):
    with torch.no_grad():
        return head(neck(levels, band_rows=rows), band_rows=rows)[-1]


@pytest.mark.parametrize("rows", [64, 100])
def test_the_released_neck_and_head_in_row_bands_give_the_whole_convs_bits(rows):
    """The released widths (1024 → 32 channels over five levels) on a 16² token grid (256² at the last level; the
    release's 60² makes 960²: the same kernels on more rows, checked with bench_stream's camera stage)."""
    neck, head, levels = _released_tail(16)
    assert torch.equal(_tail(neck, head, levels, rows), _tail(neck, head, levels, None))


def test_control_bands_padded_with_zeros_instead_of_replicated_rows_differ(monkeypatch):
    """The comparison above sees a wrong band edge: the same bands, padded with zeros at the image's edges."""
    import torch.nn.functional as F

    from pixal3d.models import moge

    neck, head, levels = _released_tail(8)
    whole = _tail(neck, head, levels, None)
    pad = F.pad
    monkeypatch.setattr(moge.F, "pad", lambda x, widths, mode="constant": pad(x, widths, mode="constant"))
    assert not torch.equal(_tail(neck, head, levels, 32), whole)


def test_the_plans_layout_of_moge_before_its_download_is_the_released_files_blocks(tmp_path):
    """Before ``model.pt`` is downloaded the plan knows only its listed size: the release's 24 blocks at its config
    and the rest of that size are the layout of the released file's tensors (``assets/moge_checkpoint.json``); on
    disk, the file's own index is read (the toy's: its blocks, none loaded)."""
    import json
    import math
    from pathlib import Path

    from pixal3d.models.moge import (
        MoGe2,
        checkpoint_tensor_bytes,
        released_tensor_bytes,
    )
    from pixal3d.staging import StreamLayout

    manifest = json.loads((Path(__file__).resolve().parents[3] / "assets" / "moge_checkpoint.json").read_text())
    released = {k: math.prod(shape) * 4 for k, shape in manifest["tensors"].items()}
    expected = StreamLayout.from_tensors(released, MoGe2.stream_unit)
    planned = StreamLayout.from_tensors(released_tensor_bytes(sum(released.values())), MoGe2.stream_unit)
    assert planned == expected and len(expected.unit_bytes) == 24 and expected.resident_bytes < 0.1e9
    _write_moge(tmp_path)
    tiny = StreamLayout.from_tensors(checkpoint_tensor_bytes(tmp_path / "model.pt"), MoGe2.stream_unit)
    assert len(tiny.unit_bytes) == 2 and tiny.resident_bytes > 0  # the toy's two blocks and the rest
