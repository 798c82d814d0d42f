"""Flow-Euler sampler: time grids, model-call counts per stage setting, std conventions, one step against
a hand-written reference, determinism."""
import functools

import numpy as np
import pytest
import torch

from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.samplers import (
    dense_std,
    packed_std,
    rescaled_timesteps,
    sample_flow_euler,
)

R5 = [1, .98214, .96154, .9375, .90909, .875, .83333, .78125, .71429, .625, .5, .3125, 0]
R3 = [1, .97059, .9375, .9, .85714, .80769, .75, .68182, .6, .5, .375, .21429, 0]


@pytest.mark.parametrize("rescale_t, expected", [(5.0, R5), (3.0, R3)])
def test_rescaled_time_grid_matches_reference(rescale_t, expected):
    times = rescaled_timesteps(12, rescale_t)
    assert times.dtype == np.float64 and len(times) == 13
    np.testing.assert_allclose(times, expected, atol=5e-6)


def test_interval_boundaries_are_exact_in_float64():
    assert 0.6 in rescaled_timesteps(12, 3.0).tolist() and 0.9 in rescaled_timesteps(12, 3.0).tolist()


class CountingModel:
    """Velocity = x·0.1 + a per-cond offset; records (t, which cond) of every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, t, cond):
        self.calls.append((float(t[0]), cond["tag"]))
        if isinstance(x, SparseTensor):
            return x.replace(x.feats * 0.1 + cond["offset"])
        return x * 0.1 + cond["offset"]


STAGES = {  # steps, strength, rescale, interval, rescale_t, forwards
    "structure": (12, 7.5, 0.7, (0.6, 1.0), 5.0, 22),
    "shape_512": (12, 7.5, 0.5, (0.6, 1.0), 3.0, 21),
    "shape_1024": (12, 7.5, 0.5, (0.6, 1.0), 3.0, 21),
    "texture": (12, 1.0, 0.0, (0.6, 0.9), 3.0, 12),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_model_call_count_per_stage(stage):
    steps, strength, rescale, interval, rescale_t, forwards = STAGES[stage]
    model = CountingModel()
    noise = torch.randn(1, 8, 4, 4, 4) if stage == "structure" else SparseTensor(
        torch.randn(10, 4), torch.tensor([[0, i, 0, 0] for i in range(10)], dtype=torch.int32))
    sample_flow_euler(model, noise, cond={"tag": "pos", "offset": 0.5}, neg_cond={"tag": "neg", "offset": -0.5},
                      steps=steps, guidance_strength=strength, guidance_rescale=rescale,
                      guidance_interval=interval, rescale_t=rescale_t, progress=False)
    assert len(model.calls) == forwards
    if strength != 1:  # positive first, then negative, at each guided step; t passed as 1000·t
        assert model.calls[0] == (1000.0, "pos") and model.calls[1] == (1000.0, "neg")
        assert all(tag == "pos" for _, tag in model.calls[2 * (forwards - steps):])


def test_dense_std_is_bessel_corrected_per_sample():
    x = torch.randn(2, 3, 4, 4, 4)
    std = dense_std(x)
    assert std.shape == (2, 1, 1, 1, 1)
    flat = x.reshape(2, -1).double()
    expected = ((flat - flat.mean(1, keepdim=True)) ** 2).sum(1).div(flat.shape[1] - 1).sqrt()
    torch.testing.assert_close(std.flatten().double(), expected, atol=1e-6, rtol=1e-6)


def test_packed_std_is_population_per_sample():
    feats = torch.randn(30, 4)
    layout = [slice(0, 12), slice(12, 30)]
    std = packed_std(feats, layout)
    assert std.shape == (2, 1)
    for b, rows in enumerate(layout):
        flat = feats[rows].double().flatten()
        population = ((flat - flat.mean()) ** 2).mean().sqrt()
        assert abs(std[b, 0].item() - population.item()) < 1e-5
        assert abs(std[b, 0].item() - flat.std().item()) > 1e-4  # control: Bessel would differ


def reference_step(x, t, t_prev, v_pos, v_neg, strength, rescale, std, sigma_min=1e-5):
    """One guided Euler step written from the reference formulas (float64)."""
    v = strength * v_pos + (1 - strength) * v_neg
    x0_pos = (1 - sigma_min) * x - (sigma_min + (1 - sigma_min) * t) * v_pos
    x0_cfg = (1 - sigma_min) * x - (sigma_min + (1 - sigma_min) * t) * v
    x0 = rescale * x0_cfg * (std(x0_pos) / std(x0_cfg)) + (1 - rescale) * x0_cfg
    v = ((1 - sigma_min) * x - x0) / (sigma_min + (1 - sigma_min) * t)
    return x - (t - t_prev) * v


class QuadraticModel:
    """A velocity that is not a multiple of x, so rescale changes the result."""

    def __call__(self, x, t, cond):
        feats = x.feats if isinstance(x, SparseTensor) else x
        v = feats ** 2 * cond["a"] + cond["b"]
        return x.replace(v) if isinstance(x, SparseTensor) else v


def test_one_guided_step_dense_matches_reference():
    noise = torch.randn(2, 3, 2, 2, 2, dtype=torch.float64)
    cond, neg = {"a": 0.7, "b": 0.2}, {"a": -0.3, "b": 0.1}
    out = sample_flow_euler(QuadraticModel(), noise, cond=cond, neg_cond=neg, steps=1, guidance_strength=3.0,
                            guidance_rescale=0.6, guidance_interval=(0.0, 1.0), rescale_t=1.0, progress=False)
    std = lambda z: z.std(dim=[1, 2, 3, 4], keepdim=True)
    expected = reference_step(noise, 1.0, 0.0, noise ** 2 * 0.7 + 0.2, noise ** 2 * -0.3 + 0.1, 3.0, 0.6, std)
    torch.testing.assert_close(out, expected)


def test_one_guided_step_sparse_uses_population_std():
    feats = torch.randn(9, 3, dtype=torch.float64)
    coords = torch.tensor([[0 if i < 4 else 1, i, 0, 0] for i in range(9)], dtype=torch.int32)
    noise = SparseTensor(feats, coords)
    cond, neg = {"a": 0.7, "b": 0.2}, {"a": -0.3, "b": 0.1}
    out = sample_flow_euler(QuadraticModel(), noise, cond=cond, neg_cond=neg, steps=1, guidance_strength=3.0,
                            guidance_rescale=0.6, guidance_interval=(0.0, 1.0), rescale_t=1.0, progress=False)

    def population(z):
        rows = [slice(0, 4), slice(4, 9)]
        per = [((z[r] - z[r].mean()) ** 2).mean().sqrt() for r in rows]
        return torch.cat([per[0].expand(4, 1), per[1].expand(5, 1)])

    expected = reference_step(feats, 1.0, 0.0, feats ** 2 * 0.7 + 0.2, feats ** 2 * -0.3 + 0.1, 3.0, 0.6, population)
    assert isinstance(out, SparseTensor) and out.coords is coords
    torch.testing.assert_close(out.feats, expected)


def test_callback_sees_every_step_and_progress_can_be_off(capsys):
    seen = []
    noise = torch.randn(1, 2, 2, 2, 2)
    sample_flow_euler(QuadraticModel(), noise, cond={"a": 0.1, "b": 0.0}, neg_cond=None, steps=4,
                      guidance_strength=1.0, guidance_rescale=0.0, guidance_interval=(0.6, 0.9), rescale_t=3.0,
                      progress=False, callback=lambda info: seen.append(info))
    assert [s["step"] for s in seen] == [0, 1, 2, 3]
    assert seen[0]["t"] == 1.0 and seen[-1]["t_prev"] == 0.0
    assert torch.equal(seen[1]["x_t"], seen[0]["x_prev"])
    assert "flow sampling" not in capsys.readouterr().err


def test_missing_neg_cond_is_a_clear_error():
    with pytest.raises(ValueError, match="needs neg_cond"):
        sample_flow_euler(QuadraticModel(), torch.randn(1, 2), cond={"a": 1, "b": 0}, neg_cond=None, steps=2,
                          guidance_strength=7.5, guidance_rescale=0.0, guidance_interval=(0.0, 1.0), rescale_t=1.0,
                          progress=False)


def test_tiny_flow_sampling_is_deterministic():
    from pixal3d.models import build_model
    spec = {"name": "SLatFlowModel", "args": {
        "resolution": 8, "in_channels": 16, "out_channels": 8, "model_channels": 32, "cond_channels": 16,
        "num_blocks": 1, "num_heads": 2, "mlp_ratio": 2.0, "qk_rms_norm": True, "qk_rms_norm_cross": True,
        "proj_in_channels": 12, "dtype": "bfloat16"}}
    torch.manual_seed(0)
    model = build_model(spec, device="cpu").eval()
    coords = torch.tensor([[0, i % 8, i // 8, 1] for i in range(20)], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    shape = SparseTensor(torch.randn(20, 8, generator=g), coords)
    cond = {"global": torch.randn(1, 5, 16, generator=g), "proj": shape.replace(torch.randn(20, 12, generator=g))}
    neg = {"global": torch.zeros(1, 5, 16), "proj": shape.replace(torch.zeros(20, 12))}

    def run(seed):
        noise = SparseTensor(torch.randn(20, 8, generator=torch.Generator().manual_seed(seed)), coords)
        return sample_flow_euler(functools.partial(model, concat_cond=shape), noise, cond=cond, neg_cond=neg,
                                 steps=3, guidance_strength=3.0, guidance_rescale=0.5, guidance_interval=(0.6, 1.0),
                                 rescale_t=3.0, progress=False).feats

    a, b, c = run(42), run(42), run(43)
    assert a.numpy().tobytes() == b.numpy().tobytes()
    assert a.numpy().tobytes() != c.numpy().tobytes()  # control: another seed changes the bytes
