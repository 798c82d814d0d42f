"""The four flow transformers: checkpoint key contract on meta, dtype placement, strict loading,
dense/sparse agreement and determinism at tiny sizes."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pixal3d.models import CheckpointError, build_model, load_model, save_model
from pixal3d.models.slat_flow import SLatFlowModel
from pixal3d.models.sparse_structure_flow import SparseStructureFlowModel
from pixal3d.nn.rope import grid_positions
from pixal3d.nn.sparse_tensor import SparseTensor

MANIFEST = Path(__file__).resolve().parents[3] / "assets" / "checkpoints.json"  # copy of shared/reference/
FLOW_ENTRIES = ["sparse_structure_flow_model", "shape_slat_flow_model_512", "shape_slat_flow_model_1024",
                "tex_slat_flow_model_1024"]

TINY = {"model_channels": 32, "cond_channels": 16, "num_blocks": 2, "num_heads": 2, "mlp_ratio": 2.0,
        "pe_mode": "rope", "share_mod": True, "qk_rms_norm": True, "qk_rms_norm_cross": True,
        "image_attn_mode": "proj"}


def manifest():
    path = MANIFEST.resolve()
    return json.loads(path.read_text())["models"]


@pytest.mark.parametrize("entry", FLOW_ENTRIES)
def test_real_config_matches_checkpoint_manifest(entry):
    spec = manifest()[entry]
    model = build_model({"name": spec["class"], "args": spec["args"]}, device="meta")
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    assert shapes == spec["tensors"]
    assert sum(p.numel() for p in model.parameters()) == spec["params"]


def test_real_config_dtype_placement():
    spec = manifest()["shape_slat_flow_model_1024"]
    model = build_model({"name": spec["class"], "args": spec["args"]}, device="meta")
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    fp32 = [n for n, d in dtypes.items() if d == torch.float32]
    bf16 = [n for n, d in dtypes.items() if d == torch.bfloat16]
    assert len(fp32) + len(bf16) == len(dtypes)
    for name in fp32:
        assert (not name.startswith("blocks.") or name.endswith(("modulation", "gamma"))
                or ".norm2." in name), name
    for name in bf16:
        assert name.startswith("blocks.") and name.endswith((".weight", ".bias")) and ".norm2." not in name, name
    assert dtypes["input_layer.weight"] == dtypes["out_layer.weight"] == dtypes["t_embedder.mlp.0.weight"] \
        == dtypes["adaLN_modulation.1.weight"] == torch.float32
    assert dtypes["blocks.29.mlp.mlp.0.weight"] == dtypes["blocks.0.cross_attn.proj_linear.weight"] == torch.bfloat16


def test_elastic_name_builds_the_same_network_and_ignores_training_args():
    args = dict(resolution=4, in_channels=8, out_channels=8, proj_in_channels=12, dtype="float32", **TINY,
                initialization="scaled", use_checkpoint=True)
    a = build_model({"name": "ElasticSLatFlowModel", "args": args})
    b = build_model({"name": "SLatFlowModel", "args": args})
    assert type(a) is type(b) is SLatFlowModel
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}


def test_unknown_and_missing_arguments_are_errors():
    args = dict(resolution=4, in_channels=8, out_channels=8, dtype="float32", **TINY)
    with pytest.raises(CheckpointError, match="unknown argument"):
        build_model({"name": "SparseStructureFlowModel", "args": {**args, "num_experts": 4}})
    del args["num_blocks"]
    with pytest.raises(CheckpointError, match="missing required argument.*num_blocks"):
        build_model({"name": "SparseStructureFlowModel", "args": args})


def test_unsupported_modes_are_clear_errors():
    args = dict(resolution=4, in_channels=8, out_channels=8, dtype="float32", **TINY)
    with pytest.raises(ValueError, match="pe_mode 'ape'"):
        SparseStructureFlowModel(**{**args, "pe_mode": "ape"})
    with pytest.raises(ValueError, match="dtype 'float64'"):
        SparseStructureFlowModel(**{**args, "dtype": "float64"})


def tiny_spec(name, **overrides):
    args = dict(resolution=4, in_channels=8, out_channels=8, dtype="bfloat16", **TINY)
    args.update(overrides)
    return {"name": name, "args": args}


def randomize(model, seed=0):
    """Give every parameter random values (meta-free CPU model), so tests see non-trivial weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def test_save_and_strict_load_roundtrip(tmp_path):
    spec = tiny_spec("SLatFlowModel", in_channels=16, out_channels=8, proj_in_channels=12)
    model = randomize(build_model(spec, device="cpu"))
    save_model(model, spec, tmp_path / "flow", dtype=torch.bfloat16)
    loaded = load_model(tmp_path / "flow")
    assert loaded.blocks[0].mlp.mlp[0].weight.dtype == torch.bfloat16
    assert loaded.blocks[0].modulation.dtype == torch.float32
    assert loaded.input_layer.weight.dtype == torch.float32
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).to(tensor.dtype)), name


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_load_rejects_missing_or_extra_key(tmp_path, change):
    spec = tiny_spec("SparseStructureFlowModel")
    model = build_model(spec, device="cpu")
    save_model(model, spec, tmp_path / "ss")
    state = load_file(str(tmp_path / "ss.safetensors"))
    if change == "missing":
        del state["blocks.1.cross_attn.proj_linear.weight"]
        key = "blocks.1.cross_attn.proj_linear.weight"
    else:
        state["rope_phases"] = torch.zeros(64, 8)
        key = "rope_phases"
    save_file(state, str(tmp_path / "ss.safetensors"))
    with pytest.raises(CheckpointError, match=change if change == "missing" else "unexpected") as err:
        load_model(tmp_path / "ss")
    assert key in str(err.value) and "ss.safetensors" in str(err.value)


def dense_inputs(batch=1, seed=1, proj_channels=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 8, 4, 4, 4, generator=g)
    cond = {"global": torch.randn(batch, 5, 16, generator=g), "proj": torch.randn(batch, 64, proj_channels, generator=g)}
    return x, torch.full((batch,), 700.0), cond


def test_dense_forward_shape_and_dtype():
    model = randomize(build_model(tiny_spec("SparseStructureFlowModel"), device="cpu"))
    x, t, cond = dense_inputs(batch=2)
    out = model(x, t, cond)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"cond\['proj'\] must be"):
        model(x, t, {**cond, "proj": cond["proj"][:, :10]})


def test_sparse_model_on_full_grid_equals_dense_model():
    """One sample whose sparse voxels are every grid point, in x-slowest order, sees exactly the dense model."""
    dense = randomize(build_model(tiny_spec("SparseStructureFlowModel", dtype="float32"), device="cpu"))
    sparse = build_model(tiny_spec("SLatFlowModel", dtype="float32"), device="cpu")
    sparse.load_state_dict(dense.state_dict())
    x, t, cond = dense_inputs(batch=1)
    coords = torch.cat([torch.zeros(64, 1, dtype=torch.int32), grid_positions(4).int()], dim=1)
    xs = SparseTensor(x.reshape(8, 64).T.contiguous(), coords)
    proj = xs.replace(cond["proj"][0])
    with torch.no_grad():
        out_dense = dense(x, t, cond)
        out_sparse = sparse(xs, t, {"global": cond["global"], "proj": proj})
    torch.testing.assert_close(out_sparse.feats, out_dense.reshape(8, 64).T, atol=1e-5, rtol=1e-5)
    # control: a different voxel order (z slowest) is a different input and changes the output
    flipped = SparseTensor(xs.feats, torch.cat([coords[:, :1], coords[:, 1:].flip(1)], dim=1))
    with torch.no_grad():
        out_flipped = sparse(flipped, t, {"global": cond["global"], "proj": flipped.replace(proj.feats)})
    assert not torch.allclose(out_flipped.feats, out_sparse.feats, atol=1e-3)


def sparse_inputs(counts=(20, 13), seed=2, channels=8, proj_channels=12):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b, n in enumerate(counts):
        flat = torch.randperm(512, generator=g)[:n].sort().values
        xyz = torch.stack([flat // 64, flat // 8 % 8, flat % 8], dim=1)
        rows.append(torch.cat([torch.full((n, 1), b), xyz], dim=1))
    coords = torch.cat(rows).int()
    x = SparseTensor(torch.randn(coords.shape[0], channels, generator=g), coords)
    cond = {"global": torch.randn(len(counts), 5, 16, generator=g),
            "proj": x.replace(torch.randn(coords.shape[0], proj_channels, generator=g))}
    return x, torch.tensor([900.0, 300.0][:len(counts)]), cond


def test_sparse_batch_of_two_equals_each_sample_alone():
    model = randomize(build_model(tiny_spec("SLatFlowModel", resolution=8, dtype="float32", in_channels=16,
                                            proj_in_channels=12), device="cpu"))
    x, t, cond = sparse_inputs()
    shape_latent = x.replace(torch.randn(x.feats.shape[0], 8, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        both = model(x, t, cond, concat_cond=shape_latent)
        for b, rows in enumerate(x.layout):
            coords = x.coords[rows].clone()
            coords[:, 0] = 0
            xb = SparseTensor(x.feats[rows], coords)
            alone = model(xb, t[b:b + 1], {"global": cond["global"][b:b + 1], "proj": xb.replace(cond["proj"].feats[rows])},
                          concat_cond=xb.replace(shape_latent.feats[rows]))
            torch.testing.assert_close(both.feats[rows], alone.feats, atol=1e-5, rtol=1e-5)
    assert "rope_phases:16:(1.0, 10000.0)" in x.cache  # phases cached on the coordinate set
    with pytest.raises(ValueError, match="forget concat_cond"):
        model(x, t, cond)


def test_forward_is_deterministic_in_bf16():
    model = randomize(build_model(tiny_spec("SLatFlowModel", resolution=8, proj_in_channels=12), device="cpu"))
    x, t, cond = sparse_inputs(counts=(25,))
    with torch.no_grad():
        a, b = model(x, t[:1], cond).feats, model(x, t[:1], cond).feats
        c = model(x, t[:1] + 1, cond).feats
    assert a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # control: a different time changes the bytes
