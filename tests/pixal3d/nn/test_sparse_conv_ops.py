"""Channel↔space ×2 rearrangements: child-bit convention and round trips; SparseLinear."""
from __future__ import annotations

import pytest
import torch

from pixal3d.nn.sparse_ops import SparseLinear, channel_to_space, space_to_channel, subdivide
from pixal3d.nn.sparse_tensor import SparseTensor


def _parents(gen: torch.Generator, n: int = 20, grid: int = 5, batch: int = 2) -> torch.Tensor:
    cells = torch.randperm(batch * grid**3, generator=gen)[:n].sort().values
    return torch.stack([cells // grid**3, cells // grid**2 % grid, cells // grid % grid, cells % grid], 1).to(torch.int32)


def _mask(gen: torch.Generator, n: int) -> torch.Tensor:
    mask = torch.rand(n, 8, generator=gen) > 0.5
    mask[:, 0] |= ~mask.any(dim=1)  # every parent keeps at least one child
    return mask


def test_child_index_bits_are_x_then_y_then_z():
    coords = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    feats = torch.arange(8 * 2, dtype=torch.float32).reshape(1, 16)  # child k holds [2k, 2k+1]
    for k, offset in enumerate([(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]):
        mask = torch.zeros(1, 8, dtype=torch.bool)
        mask[0, k] = True
        out = channel_to_space(SparseTensor(feats, coords), mask)
        assert out.coords.tolist() == [[0, 2 + offset[0], 4 + offset[1], 6 + offset[2]]]
        assert out.feats.tolist() == [[2 * k, 2 * k + 1]]


def test_children_come_parent_major_in_ascending_child_index():
    coords = torch.tensor([[0, 0, 0, 0], [0, 5, 5, 5]], dtype=torch.int32)
    mask = torch.tensor([[False, True, False, False, True, False, False, False],
                         [True, False, False, False, False, False, False, True]])
    new, src = subdivide(coords, mask)
    assert src.tolist() == [1, 4, 8, 15]
    assert new.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1], [0, 10, 10, 10], [0, 11, 11, 11]]


def test_channel_to_space_then_space_to_channel_is_identity_on_kept_children():
    gen = torch.Generator().manual_seed(0)
    coords = _parents(gen)
    mask = _mask(gen, coords.shape[0])
    x = SparseTensor(torch.randn(coords.shape[0], 8 * 3, generator=gen), coords)
    back, back_mask = space_to_channel(channel_to_space(x, mask))
    assert torch.equal(back.coords, x.coords)
    assert torch.equal(back_mask, mask)
    kept = mask.repeat_interleave(3, dim=1)  # [N, 8·C]: channel block k belongs to child k
    assert torch.equal(back.feats[kept], x.feats[kept])
    assert (back.feats[~kept] == 0).all()


def test_space_to_channel_then_channel_to_space_is_identity():
    gen = torch.Generator().manual_seed(1)
    cells = torch.randperm(2 * 8**3, generator=gen)[:90]  # unsorted fine voxels, two samples
    fine = torch.stack([cells // 512, cells // 64 % 8, cells // 8 % 8, cells % 8], 1).to(torch.int32)
    order = torch.argsort(fine[:, 0])  # rows grouped by batch, otherwise arbitrary
    x = SparseTensor(torch.randn(90, 4, generator=gen), fine[order])
    parents, mask = space_to_channel(x)
    y = channel_to_space(parents, mask)
    as_rows = lambda t: {tuple(c): f for c, f in zip(t.coords.tolist(), t.feats.tolist())}
    assert as_rows(y) == as_rows(x)
    assert (parents.coords[1:] > parents.coords[:-1]).any(dim=1).all()  # strictly increasing => sorted, unique


def test_subdivide_rejects_a_mask_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"bool \[N, 8\]"):
        subdivide(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.bool))


def test_sparse_linear_acts_on_features_with_linear_keys():
    lin = SparseLinear(4, 3)
    x = SparseTensor(torch.randn(5, 4), torch.zeros(5, 4, dtype=torch.int32))
    out = lin(x)
    assert set(lin.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(out.feats, x.feats @ lin.weight.T + lin.bias)
    assert out.coords is x.coords and out.cache is x.cache
