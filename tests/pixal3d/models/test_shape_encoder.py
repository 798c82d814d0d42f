"""TRELLIS.2's shape encoder (pixal3d/models/shape_encoder.py): its structure at the released size (meta device),
its space-to-channel block against a plain re-statement of TRELLIS.2's rule, and the children masks that guide the
texture decoder back to exactly the encoded voxels."""
from __future__ import annotations

import pytest
import torch

from pixal3d.mesh.fields import DualGridFields
from pixal3d.models import build_model
from pixal3d.models.shape_encoder import FlexiDualGridVaeEncoder, SparseResBlockS2C3d
from pixal3d.nn.sparse_ops import subdivide
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.tiny_weights import SHAPE_ENCODER, checkpoint_state
from tests.support.header_hub import SHAPE_ENCODER_RELEASED as RELEASED


def _expected_parameters(channels, blocks) -> int:
    """The parameter count TRELLIS.2's encoder definition gives, written out from its layers."""
    def convnext(c):
        return (27 * c * c + c) + 2 * c + (c * 4 * c + 4 * c) + (4 * c * c + c)

    def s2c(cin, cout):
        return 2 * cin + (27 * cin * (cout // 8) + cout // 8) + (27 * cout * cout + cout)

    total = 6 * channels[0] + channels[0] + channels[-1] * 64 + 64
    for i, (c, n) in enumerate(zip(channels, blocks)):
        total += n * convnext(c)
        if i < len(channels) - 1:
            total += s2c(c, channels[i + 1])
    return total


def test_the_released_encoder_builds_on_meta_with_trellis2s_layers():
    model = build_model(RELEASED, device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert count == _expected_parameters([64, 128, 256, 512, 1024], [0, 4, 8, 16, 4])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["input_layer.weight"] == (64, 6) and shapes["to_latent.weight"] == (64, 1024)
    assert shapes["blocks.0.0.conv1.weight"] == (16, 3, 3, 3, 64)  # the first S2C: 64 -> 128/8 on the 1024 grid
    assert shapes["blocks.1.4.conv2.weight"] == (256, 3, 3, 3, 256)
    assert "blocks.0.0.norm2.weight" not in shapes  # norm2 has no affine parameters, as TRELLIS.2's
    from pipelines.mesh_encode import HEAD_RADII

    assert {k: model.head_radius(k) for k in HEAD_RADII} == HEAD_RADII  # what the plan sizes tiles with
    halves = {str(p.dtype) for name, p in model.named_parameters() if name.startswith("blocks.") and "norm" not in name}
    assert halves == {"torch.float16"} and model.input_layer.weight.dtype == torch.float32


def _voxels(n: int, grid: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coords = torch.unique(torch.randint(0, grid, (n, 3), generator=g, dtype=torch.int32), dim=0)
    return torch.cat([torch.zeros_like(coords[:, :1]), coords], dim=1)


def test_space_to_channel_block_is_trellis2s_rule():
    torch.manual_seed(0)
    block = SparseResBlockS2C3d(8, 16)
    voxels = _voxels(300, 12, 1)
    x = SparseTensor(torch.randn(len(voxels), 8), voxels)
    out, mask = block(x)
    # TRELLIS.2: conv1 on the children, the children's channels packed into their parent by child index
    # (x bit 0, y bit 1, z bit 2), zeros for absent ones; skip = the packed input averaged in groups of 8*8/16
    h = block.conv1(x.replace(torch.nn.functional.silu(block.norm1(x.feats)))).feats
    parents = {}
    for row, c in enumerate(x.coords.tolist()):
        key = (c[0], c[1] // 2, c[2] // 2, c[3] // 2)
        child = c[1] % 2 + 2 * (c[2] % 2) + 4 * (c[3] % 2)
        parents.setdefault(key, {})[child] = row
    keys = sorted(parents)
    assert out.coords.tolist() == [list(k) for k in keys]
    packed_h = torch.zeros(len(keys), 8, 2)
    packed_x = torch.zeros(len(keys), 8, 8)
    for i, key in enumerate(keys):
        for child, row in parents[key].items():
            packed_h[i, child], packed_x[i, child] = h[row], x.feats[row]
            assert mask[i, child]
        assert int(mask[i].sum()) == len(parents[key])
    ph = SparseTensor(packed_h.reshape(len(keys), 16), out.coords)
    expected = block.conv2(ph.replace(torch.nn.functional.silu(block.norm2(ph.feats)))).feats
    expected = expected + packed_x.reshape(len(keys), 16, 4).mean(dim=-1)
    assert torch.equal(out.feats, expected)


def _tiny_encoder() -> FlexiDualGridVaeEncoder:
    _, spec, _ = SHAPE_ENCODER
    model = build_model(spec, device="cpu")
    model.load_state_dict(checkpoint_state("shape_encoder", spec))
    return model.eval()


def test_guides_decode_back_to_exactly_the_encoded_voxels_and_a_foreign_latent_is_refused():
    model = _tiny_encoder()
    coords = _voxels(4000, 40, 2)[:, 1:].contiguous()  # within x, y, z < 40: coarse cells < 10
    g = torch.Generator().manual_seed(3)
    fields = DualGridFields(coords, torch.rand(len(coords), 3, generator=g), torch.rand(len(coords), 3, generator=g)
                            > 0.5, torch.ones(len(coords)), 48)
    encoded = model.encode(fields)
    assert encoded.latent.feats.shape[1] == 8 and int(encoded.latent.coords[:, 1:].max()) < 12
    level = encoded.latent.coords
    for guide in encoded.guide_logits():
        level, _ = subdivide(level, guide.feats > 0)
    assert sorted(map(tuple, level[:, 1:].tolist())) == sorted(map(tuple, coords.tolist()))
    again = model.encode(fields)
    assert torch.equal(again.latent.feats, encoded.latent.feats)
    stray = torch.tensor([[0, 11, 11, 11]], dtype=torch.int32)  # a coarse voxel none of the encoded voxels is under
    coarse = torch.cat([encoded.latent.coords, stray])
    encoded.latent = SparseTensor(torch.zeros(len(coarse), 8), coarse)
    with pytest.raises(ValueError, match="not the encoder's parents"):
        encoded.guide_logits()


def test_guides_from_the_voxels_are_the_encoders_and_drop_what_no_voxel_is_under():
    from pixal3d.models.shape_encoder import guide_to_voxels

    model = _tiny_encoder()
    coords = _voxels(3000, 48, 4)[:, 1:].contiguous()
    fields = DualGridFields(coords, torch.rand(len(coords), 3), torch.rand(len(coords), 3) > 0.5,
                            torch.ones(len(coords)), 48)
    encoded = model.encode(fields)
    ours = guide_to_voxels(encoded.latent.coords, coords, 2)
    for a, b in zip(ours, encoded.guide_logits()):
        assert torch.equal(a.feats, b.feats) and torch.equal(a.coords, b.coords)
    # fewer voxels: the children with none under them are dropped, and only the given voxels come out
    half = coords[coords[:, 0] < 24].contiguous()
    level = encoded.latent.coords
    for guide in guide_to_voxels(level, half, 2):
        level, _ = subdivide(level, guide.feats > 0)
    assert sorted(map(tuple, level[:, 1:].tolist())) == sorted(map(tuple, half.tolist()))


def _half_torso(model: FlexiDualGridVaeEncoder) -> FlexiDualGridVaeEncoder:
    """The released placement (half-precision torso; bf16 here: CPU fp16 GEMMs are slow), whose kernels give each
    row's result whatever rows share the call: what makes tiles exact (pixal3d/models/decoder_tiling.py)."""
    from pixal3d.nn.sparse_conv import SparseConv3d

    for module in model.blocks.modules():
        if isinstance(module, (SparseConv3d, torch.nn.Linear)):
            module.to(torch.bfloat16)
    model.dtype = torch.bfloat16
    return model


@pytest.mark.parametrize("levels, tile_voxels", [(1, 500), (2, 900)])
def test_the_tiled_encoder_is_the_whole_one_bit_for_bit(levels, tile_voxels, monkeypatch):
    import pixal3d.models.decoder_tiling as tiling
    from pixal3d.models.shape_encoder import EncodeTiles

    model = _half_torso(_tiny_encoder())
    g = torch.Generator().manual_seed(9)
    xyz = torch.stack(torch.meshgrid(*[torch.arange(48)] * 3, indexing="ij"), -1).reshape(-1, 3)
    shell = ((xyz.float() + 0.5 - 24).norm(dim=1) - 17).abs() < 1.2  # a sphere's band of voxels, as a mesh gives
    coords = xyz[shell].int()
    fields = DualGridFields(coords, torch.rand(len(coords), 3, generator=g), torch.rand(len(coords), 3, generator=g)
                            > 0.5, torch.ones(len(coords)), 48)
    whole = model.encode(fields).latent
    boxes = []
    split = tiling.split_boxes
    monkeypatch.setattr(tiling, "split_boxes", lambda *a: boxes.extend(split(*a)) or boxes)
    tiled = model.encode_tiled(fields, EncodeTiles(levels=levels, tile_voxels=tile_voxels, mlp_rows=97))
    assert len(boxes) > 2  # several tiles ran, their blocks' MLPs over 97-row chunks
    assert torch.equal(tiled.coords, whole.coords) and torch.equal(tiled.feats, whole.feats)
    short = model.encode_tiled(fields, EncodeTiles(levels=levels, tile_voxels=tile_voxels,
                                                   radius=model.head_radius(levels) - 1))
    assert not torch.equal(short.feats, whole.feats)  # control: a halo one voxel short is not exact
