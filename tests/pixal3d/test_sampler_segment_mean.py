"""The sampler's per-sample mean without torch.segment_reduce (no MPS kernel): bitwise segment_reduce on the CPU
for fp32 values (what the sampler gives it), and accumulated in fp32 for half-precision values, where
segment_reduce (and an index_add into a half accumulator) stop adding long before a sample's ~20k rows."""
import itertools

import pytest
import torch

from pixal3d.samplers import packed_std, segment_mean


def random_layout(gen: torch.Generator, samples: int, max_rows: int) -> list[int]:
    return torch.randint(1, max_rows + 1, (samples,), generator=gen).tolist()


def layouts() -> list[list[int]]:
    """Single-sample and many-sample packings, 1-row samples, long samples where the order matters."""
    gen = torch.Generator().manual_seed(0)
    fixed = [[1], [7], [4096], [50_000], [1, 1, 1], [1, 5000], [5000, 1], [3, 200, 17, 1, 9000]]
    return fixed + [random_layout(gen, int(torch.randint(1, 48, (1,), generator=gen)), 800) for _ in range(24)]


def values_for(lengths: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values spread over magnitudes, so a different summation order changes the last bits."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return (torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)).to(dtype)


def reference_mean(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.segment_reduce(values, "mean", lengths=torch.tensor(lengths))


def ours(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return segment_mean(values, sample, torch.tensor(lengths))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


def test_segment_mean_is_bitwise_segment_reduce_on_every_layout():
    for i, lengths in enumerate(layouts()):
        values = values_for(lengths, torch.float32, seed=i)
        assert same_bits(ours(values, lengths), reference_mean(values, lengths)), lengths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_values_are_summed_in_fp32(dtype):
    """The fp32 sums of the half values, cast back: segment_reduce of the upcast values, bitwise."""
    for i, lengths in enumerate(layouts()):
        values = values_for(lengths, dtype, seed=i)
        expected = reference_mean(values.float(), lengths).to(dtype)
        assert same_bits(ours(values, lengths), expected), (dtype, lengths)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_control_a_half_precision_accumulator_loses_a_long_sample(dtype):
    """Why: 20,000 ones summed in half precision stop growing (bf16 at 256, fp16 at 2048), so segment_reduce's
    mean, and that of an index_add into a half accumulator (as segment_mean did before), is far from 1."""
    ones = torch.ones(20_000, dtype=dtype)
    assert ours(ones, [20_000]).item() == 1.0
    assert reference_mean(ones, [20_000]).item() < 0.2
    half_sum = torch.zeros(1, dtype=dtype).index_add_(0, torch.zeros(20_000, dtype=torch.long), ones)
    assert (half_sum / 20_000).item() < 0.2


def test_control_a_pairwise_sum_is_not_bitwise_segment_reduce():
    """The check above can fail: torch.sum's blocked/pairwise order gives different bits on long segments."""
    differing = 0
    for i, lengths in enumerate(layouts()):
        values = values_for(lengths, torch.float32, seed=i)
        pairwise = torch.stack([part.sum() for part in values.split(lengths)]) / torch.tensor(lengths).float()
        differing += not same_bits(pairwise, reference_mean(values, lengths))
    assert differing >= 5


def test_packed_std_is_bitwise_the_segment_reduce_formula():
    for i, lengths in enumerate(layouts()[:20]):
        gen = torch.Generator().manual_seed(100 + i)
        feats = torch.randn(sum(lengths), 8, generator=gen) * 3 + 1
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        layout = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        counts = torch.tensor(lengths)
        mean = torch.segment_reduce(feats.mean(dim=1, keepdim=True), "mean", lengths=counts)
        mean_sq = torch.segment_reduce((feats ** 2).mean(dim=1, keepdim=True), "mean", lengths=counts)
        expected = (mean_sq - mean ** 2).sqrt()
        got = packed_std(feats, layout)
        assert got.shape == (len(lengths), 1)
        assert same_bits(got, expected), lengths
