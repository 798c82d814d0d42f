"""pixal3d.parallel in one process: settings and topology checks, block and token splits, the step plan,
shards (real-size bytes on meta, loading only a shard's tensors, release), the stale-K/V attention rule,
and the emulator's exactness invariants against the single-process sampler."""
import functools
import json
from pathlib import Path

import pytest
import torch

from pixal3d.config import SamplerConfig
from pixal3d.models import CheckpointError, build_model, load_model
from pixal3d.nn.attention import MultiHeadSelfAttention, attention
from pixal3d.nn.rope import grid_positions, rope_phases
from pixal3d.parallel import (
    ParallelConfigError,
    ParallelSettings,
    block_ranges,
    build_flow_shard,
    emulate_pipefusion,
    load_flow_shard,
    parameter_bytes,
)
from pixal3d.parallel.schedule import plan_steps
from pixal3d.parallel.sequence import FlowSequence, split_tokens
from pixal3d.parallel.shard import RemoteBlock, shard_tensor_names
from pixal3d.parallel.stale_kv import PatchAttention, patch_attention
from pixal3d.parallel.topology import Topology
from pixal3d.samplers import sample_flow_euler
from pixal3d.staging.release import release
from tests.support.parallel_harness import SAMPLER, features, flow_inputs, write_flow

MANIFEST = Path(__file__).resolve().parents[3] / "assets" / "checkpoints.json"
FLOW_ENTRIES = ["sparse_structure_flow_model", "shape_slat_flow_model_512", "shape_slat_flow_model_1024",
                "tex_slat_flow_model_1024"]


@pytest.fixture(scope="module")
def flows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flows")
    return {kind: write_flow(folder, kind, blocks=6) for kind in ("dense", "sparse")}



# -- settings and topology ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    (dict(mode="fast"), ["'fast'", "none"]),
    (dict(mode="none", pp=2), ["pp=2", "pipefusion or both"]),
    (dict(mode="pipefusion", pp=1), ["pp >= 2", "mode=none"]),
    (dict(mode="pipefusion", pp=2, patches=0), ["M = 0", ">= 1"]),
    (dict(mode="pipefusion", pp=2, warmup=-1), ["W = -1"]),
])
def test_bad_settings_are_one_clear_error(kwargs, words):
    with pytest.raises(ParallelConfigError) as err:
        ParallelSettings(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_world_size_mismatch_names_both_sizes_and_the_launch_command():
    settings = ParallelSettings(mode="both", pp=2)
    assert (settings.cfg_degree, settings.pp_degree, settings.world_size) == (2, 2, 4)
    with pytest.raises(ParallelConfigError, match=r"needs 4 processes \(cfg 2 × pp 2\) but WORLD_SIZE is 3.*"
                                                  r"--nproc-per-node 4"):
        settings.check_world_size(3)
    with pytest.raises(ParallelConfigError, match="torchrun"):
        Topology.from_env(settings, env={})


def test_stage_checks_warmup_blocks_and_tokens():
    settings = ParallelSettings(mode="pipefusion", pp=4, patches=8, warmup=13)
    with pytest.raises(ParallelConfigError, match="W = 13 is more than the stage's 12"):
        settings.check_stage(steps=12, num_blocks=30)
    settings = ParallelSettings(mode="pipefusion", pp=4, patches=8, warmup=2)
    with pytest.raises(ParallelConfigError, match="N = 4 is more than the model's 3 blocks"):
        settings.check_stage(steps=12, num_blocks=3)
    with pytest.raises(ParallelConfigError, match="M = 8 is more than the 5 tokens"):
        settings.check_stage(steps=12, num_blocks=30, tokens=5)
    settings.check_stage(steps=2, num_blocks=4, tokens=8)  # W = steps and N = blocks are fine


def test_topology_layout_is_pipeline_innermost_with_one_link_per_direction():
    settings = ParallelSettings(mode="both", pp=2)
    topo = [Topology.from_env(settings, env={"RANK": str(r), "WORLD_SIZE": "4"}) for r in range(4)]
    assert [(t.cfg_index, t.stage) for t in topo] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [t.is_owner for t in topo] == [False, True, False, False]
    assert topo[0].group_of("pos") == 0 and topo[0].group_of("neg") == 1
    assert topo[0].links() == [("act", 0, 1), ("act", 2, 3), ("x", 1, 0), ("x", 1, 2), ("pred", 3, 1)]
    ring = Topology.from_env(ParallelSettings(mode="pipefusion", pp=2), env={"RANK": "0", "WORLD_SIZE": "2"})
    assert ring.group_of("neg") == 0 and ring.links() == [("act", 0, 1), ("x", 1, 0)]


# -- splits and plan ----------------------------------------------------------------------------
def test_block_ranges_are_contiguous_near_equal_and_cover_every_block():
    assert block_ranges(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    for n in range(1, 31):
        ranges = block_ranges(30, n)
        assert [i for r in ranges for i in r] == list(range(30))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(ParallelConfigError, match="31 pipeline ranks"):
        block_ranges(30, 31)


def test_token_patches_are_contiguous_near_equal():
    assert split_tokens(4096, 3) == (slice(0, 1366), slice(1366, 2731), slice(2731, 4096))
    assert split_tokens(5, 5) == tuple(slice(i, i + 1) for i in range(5))
    with pytest.raises(ParallelConfigError):
        split_tokens(5, 6)


def test_plan_marks_warmup_guidance_and_whole_latent_steps():
    structure = SamplerConfig(steps=12, guidance_strength=7.5, guidance_rescale=0.7, guidance_interval=(0.6, 1.0),
                              rescale_t=5.0)
    plan = plan_steps(structure, 64, patches=4, warmup=2)
    assert [s.sync for s in plan] == [True] * 2 + [False] * 10
    assert all(len(s.pieces) == (1 if s.sync else 4) for s in plan)
    guided = [s.branches == ("pos", "neg") for s in plan]
    assert sum(guided) == 10 and guided == sorted(guided, reverse=True)  # 22 forwards, negative stops
    assert [s.whole_latent for s in plan] == guided  # rescale 0.7 needs the whole x0 in guided steps
    assert all(s.sync for s in plan_steps(structure, 64, patches=1, warmup=0))  # M = 1: nothing stale
    texture = SamplerConfig(steps=12, guidance_strength=1.0, guidance_rescale=0.0, guidance_interval=(0.6, 0.9),
                            rescale_t=3.0)
    assert all(s.branches == ("pos",) and not s.whole_latent for s in plan_steps(texture, 64, 4, 1))


# -- shards ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", FLOW_ENTRIES)
def test_real_size_shard_bytes_are_their_blocks_plus_small_shared_layers(entry):
    """Test 6: per-rank parameter bytes ≤ 1/N of the blocks (⌈30/N⌉ blocks when N does not divide 30)
    plus the shared layers, at the published configs, on meta."""
    spec = json.loads(MANIFEST.read_text())["models"][entry]
    spec = {"name": spec["class"], "args": spec["args"]}
    whole = build_model(spec, device="meta")
    block = [parameter_bytes(b) for b in whole.blocks]
    shared = parameter_bytes(whole.t_embedder) + parameter_bytes(whole.adaLN_modulation)
    first, last = parameter_bytes(whole.input_layer), parameter_bytes(whole.out_layer)
    assert parameter_bytes(whole) == sum(block) + shared + first + last
    assert (shared + first + last) / parameter_bytes(whole) < 0.03  # "small": under 3 % of the model
    for n in (2, 3, 4):
        total = 0
        for k, blocks in enumerate(block_ranges(30, n)):
            shard = build_flow_shard(spec, k, n)
            got = parameter_bytes(shard)
            own = sum(block[i] for i in blocks)
            assert got == own + shared + (first if k == 0 else 0) + (last if k == n - 1 else 0)
            assert own <= -(-30 // n) * max(block)
            assert got <= sum(block) / n * (-(-30 // n) * n / 30) + shared + first + last
            total += own
        assert total == sum(block)
    if entry == "shape_slat_flow_model_1024":  # the figure the README quotes
        two = parameter_bytes(build_flow_shard(spec, 0, 2))
        assert 0.49 < two / parameter_bytes(whole) < 0.53


@pytest.mark.parametrize("entry", FLOW_ENTRIES)
def test_shard_tensor_names_from_a_header_are_the_shards_own_tensors(entry):
    """What the plan counts for a rank (names read from the checkpoint's header) is exactly what its shard
    loads, at every published config and N = 2, 3, 7; every tensor is counted on some rank, blocks on one."""
    spec = json.loads(MANIFEST.read_text())["models"][entry]
    spec = {"name": spec["class"], "args": spec["args"]}
    names = list(build_model(spec, device="meta").state_dict())
    for n in (2, 3, 7):
        picked = [shard_tensor_names(names, k, n) for k in range(n)]
        for k, part in enumerate(picked):
            assert part == set(build_flow_shard(spec, k, n).state_dict()), (entry, n, k)
        assert set().union(*picked) == set(names)
        blocks = [name for part in picked for name in part if name.startswith("blocks.")]
        assert len(blocks) == len(set(blocks))  # no block counted twice


def test_shard_loads_only_its_tensors_and_checks_the_whole_file(flows, tmp_path):
    stem = flows["sparse"]
    whole = load_model(stem)
    shard = load_flow_shard(stem, 1, 3)
    assert [i for i, b in enumerate(shard.blocks) if not isinstance(b, RemoteBlock)] == [2, 3]
    assert shard.input_layer is None and shard.out_layer is None
    keys = set(shard.state_dict())
    assert keys == {k for k in whole.state_dict() if k.startswith(("blocks.2.", "blocks.3.", "t_embedder",
                                                                    "adaLN_modulation"))}
    for key, value in shard.state_dict().items():
        assert torch.equal(value, whole.state_dict()[key])
    with pytest.raises(RuntimeError, match="block 0 lives on pipeline rank 0"):
        shard.blocks[0](None)
    freed = release(shard, name="shard")  # the staging registry's release works on a shard
    assert freed == parameter_bytes(whole) - sum(parameter_bytes(whole.blocks[i]) for i in (0, 1, 4, 5)) \
        - parameter_bytes(whole.input_layer) - parameter_bytes(whole.out_layer)
    assert all(p.is_meta for p in shard.parameters())
    # a file that does not match the whole network is refused, even where the shard's part matches
    spec = json.loads(stem.with_suffix(".json").read_text())
    spec["args"]["num_blocks"] = 5
    bad = tmp_path / "bad"
    bad.with_suffix(".json").write_text(json.dumps(spec))
    bad.with_suffix(".safetensors").symlink_to(stem.with_suffix(".safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected: blocks\.5\."):
        load_flow_shard(bad, 0, 2)


# -- stale K/V attention ------------------------------------------------------------------------------
def test_patch_attends_fresh_kv_of_its_patch_and_stale_kv_of_later_patches():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(16, 2).eval()
    phases = rope_phases(grid_positions(2), 8)  # [8, 4]
    x1, x2 = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    state = PatchAttention(8, keep_kv=True)
    block = torch.nn.Module()
    block.self_attn = attn
    with torch.no_grad(), patch_attention([block], state):
        state.point("pos", slice(0, 8), sync=True)
        assert torch.equal(attn(x1, phases), MultiHeadSelfAttention.forward(attn, x1, phases))
        state.point("pos", slice(0, 4), sync=False)
        got = attn(x2[:, :4], phases[:4])
    q2, k2, v2 = attn.project_qkv(x2, phases)
    _, k1, v1 = attn.project_qkv(x1, phases)
    keys, values = torch.cat([k2[:, :4], k1[:, 4:]], 1), torch.cat([v2[:, :4], v1[:, 4:]], 1)
    expected = attn.to_out(attention(q2[:, :4], keys, values).flatten(-2))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(got, attn.to_out(attention(q2[:, :4], k2, v2).flatten(-2)), atol=1e-4)  # control
    assert type(attn) is MultiHeadSelfAttention and "patch_state" not in vars(attn)  # restored


def test_first_streamed_step_without_warmup_attends_only_the_patches_written_so_far():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(16, 2).eval()
    x = torch.randn(1, 8, 16)
    state = PatchAttention(8, keep_kv=True)
    block = torch.nn.Module()
    block.self_attn = attn
    with torch.no_grad(), patch_attention([block], state):
        state.point("pos", slice(0, 4), sync=False)
        got = attn(x[:, :4])
        state.point("neg", slice(0, 4), sync=False)  # the other branch has its own (empty) buffer
        assert torch.equal(attn(x[:, :4]), got)
    assert torch.equal(got, MultiHeadSelfAttention.forward(attn, x[:, :4]))
    assert state.buffer_bytes() == 2 * 2 * 8 * 16 * 4


def test_sequence_slices_phases_and_proj_of_the_full_sequence(flows):
    model = load_model(flows["sparse"])
    inputs = flow_inputs("sparse", 3)
    seq = FlowSequence(model, inputs["noise"], inputs["cond"], inputs["neg_cond"], inputs["concat_cond"])
    full = model.rope_phases(inputs["noise"])
    piece = split_tokens(seq.length, 3)[1]
    context, proj, phases, layout = seq.block_inputs("pos", piece)
    assert torch.equal(phases, full[piece]) and torch.equal(proj, inputs["cond"]["proj"].feats[piece])
    assert layout == [slice(0, piece.stop - piece.start)] and context is seq.context["pos"]
    tokens = seq.tokens(seq.payload(inputs["noise"].feats, piece), piece)
    assert torch.equal(tokens, torch.cat([inputs["noise"].feats, inputs["concat_cond"].feats], -1)[piece])


# -- emulator invariants ---------------------------------------------------------------------------
def baseline(model, inputs, sampler=SAMPLER):
    flow = model if inputs["concat_cond"] is None else functools.partial(model, concat_cond=inputs["concat_cond"])
    return features(sample_flow_euler(flow, inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                                      steps=sampler.steps, guidance_strength=sampler.guidance_strength,
                                      guidance_rescale=sampler.guidance_rescale,
                                      guidance_interval=sampler.guidance_interval, rescale_t=sampler.rescale_t,
                                      progress=False))


def emulate(model, inputs, patches, warmup, **kwargs):
    return features(emulate_pipefusion(model, inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                                       concat_cond=inputs["concat_cond"], sampler=SAMPLER, patches=patches,
                                       warmup=warmup, **kwargs))


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_emulator_is_the_single_process_sampler_when_nothing_is_stale(flows, kind, one_thread):
    """W = S (all steps synchronous) and M = 1 (one patch) are bitwise the single-process result;
    control: M = 3 with W = 1 is not."""
    model = load_model(flows[kind])
    inputs = flow_inputs(kind, 5)
    reference = baseline(model, inputs)
    assert torch.equal(emulate(model, inputs, patches=3, warmup=SAMPLER.steps), reference)
    assert torch.equal(emulate(model, inputs, patches=1, warmup=0), reference)
    stale = emulate(model, inputs, patches=3, warmup=1)
    assert not torch.equal(stale, reference)
    assert 1e-4 < ((stale - reference).norm() / reference.norm()).item() < 1


def test_kv_buffers_left_from_another_request_would_change_the_result(flows, one_thread):
    """Why every request starts with empty buffers (control for the two-requests test): with W = 0 the
    first streamed step reads whatever the buffers hold."""
    model = load_model(flows["sparse"])
    first, second = flow_inputs("sparse", 1), flow_inputs("sparse", 1)
    second["noise"] = second["noise"].replace(second["noise"].feats * 0.5)
    fresh = emulate(model, second, patches=3, warmup=0)
    assert torch.equal(emulate(model, second, patches=3, warmup=0), fresh)  # deterministic
    leaky = PatchAttention(first["noise"].feats.shape[0], keep_kv=True)
    emulate(model, first, patches=3, warmup=0, state=leaky)
    assert not torch.equal(emulate(model, second, patches=3, warmup=0, state=leaky), fresh)
