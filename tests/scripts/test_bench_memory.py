"""The memory benchmark's pure parts: synthetic coords, page touching, and the goal checks on traces."""
import torch
from torch import nn

from scripts import bench_memory as bm
from scripts import bench_memory_cuda as bmc
from scripts import bench_report as br
from tests.support.cascade_fixtures import tiny_cache  # noqa: F401

MIB = 2**20


def test_shell_coords_have_the_asked_count_in_lexicographic_order():
    coords = bm.shell_coords(32, 500)
    assert coords.shape == (500, 4) and coords.dtype == torch.int32
    assert (coords[:, 0] == 0).all() and coords[:, 1:].min() >= 0 and coords[:, 1:].max() < 32
    keys = coords[:, 1] * 32 * 32 + coords[:, 2] * 32 + coords[:, 3]
    assert torch.equal(keys, torch.sort(keys).values) and len(torch.unique(keys)) == 500
    radius = (coords[:, 1:].float() - 15.5).norm(dim=1)
    assert (radius - 12.8).abs().max() < 2.5  # a shell around 0.4 * resolution, not a solid block


def test_prefault_counts_each_storage_once():
    tied = nn.Linear(64, 64, bias=False)
    model = nn.Sequential(tied, nn.Linear(64, 64, bias=False))
    model[1].weight = tied.weight  # tied: one storage
    assert bm.prefault(model) == 64 * 64 * 4


def _trace(extra_after_load: int):
    """A trace: 1000 B baseline, a 100 MiB load at t=1, samples before and after, a release at t=3."""
    load = 100 * MIB
    return [
        {"type": "start", "time": 0.0},
        {"type": "sample", "t": 0.5, "process": 1000},
        {"type": "event", "t": 1.0, "kind": "load", "model": "m", "bytes": load, "seconds": 0.5},
        {"type": "sample", "t": 2.0, "process": 1000 + load + extra_after_load},
        {"type": "event", "t": 3.0, "kind": "release", "model": "m", "bytes": load},
        {"type": "sample", "t": 4.0, "process": 1000},
    ]


def _result(peak_extra: int):
    load = 100 * MIB
    return {"baseline": {"VmRSS": 1000},
            "loads": [{"model": "m", "bytes": load, "rss_before": 1000, "peak_during": 1000 + load + peak_extra}]}


def test_weight_timeline_follows_loads_and_releases():
    assert br.weight_timeline(_trace(0)) == [(0.0, 0), (0.5, 100 * MIB), (3.0, 0)]  # from the load's start


def test_copy_check_passes_a_zero_copy_load_and_catches_a_second_copy():
    clean = br.copy_check(_result(peak_extra=1 * MIB), _trace(extra_after_load=2 * MIB))
    assert clean["all_loads_ok"] and clean["worst_sample"]["non_weight"] == 2 * MIB
    # control: a load that briefly held a second full copy is caught, and so is a lasting copy in the samples
    copied = br.copy_check(_result(peak_extra=100 * MIB), _trace(extra_after_load=100 * MIB))
    assert not copied["all_loads_ok"]
    assert copied["loads"][0]["extra_over_bytes"] == 100 * MIB
    assert copied["worst_sample"]["non_weight"] == 100 * MIB


def _summary_rows(peaks, loads=None):
    loads = loads or {}
    return [{"stage": s, "seconds": 1.0, "peak_process": p, "peak_device": None, "loaded_bytes": 0,
             "load_seconds": 0.0, "loads": loads.get(s, 0)} for s, p in peaks.items()]


def test_goal_one_compares_stages_from_the_first_staged_load_on():
    eager = {"summary": {"rows": _summary_rows({"setup": 100, "structure": 100, "texture": 100})}}
    staged = {"summary": {"rows": _summary_rows({"setup": 90, "structure": 30, "texture": 41},
                                                {"structure": 1})}}
    first, ratios = br.staged_eager_ratios(eager, staged)
    assert first == "structure"
    assert ratios == {"structure": 0.3, "texture": 0.41}  # setup (before any load, 0.9) is not judged


def test_stage_peaks_merge_a_stage_entered_twice_without_double_counting():
    rows = _summary_rows({"a": 10, "b": 5})
    rows.append(dict(rows[0], peak_process=12, loaded_bytes=7))
    rows[0]["loaded_bytes"] = 3
    merged = br.stage_peaks({"summary": {"rows": rows}})
    assert merged["a"]["peak_process"] == 12 and merged["a"]["loaded_bytes"] == 10
    assert merged["b"]["loaded_bytes"] == 0


def test_cuda_table_subtracts_loads_from_stage_time():
    result = {"stages": [{"stage": "structure", "seconds": 5.0, "used": []}],
              "summary": {"rows": [{"stage": "structure", "seconds": 5.0, "peak_process": 1, "peak_device": 2**30,
                                    "loaded_bytes": 10, "load_seconds": 1.5, "loads": 1}],
                          "peak_device": 2**30, "loads": {"seconds": 1.5, "bytes": 10, "count": 1}},
              "seconds": 6.0}
    rows = bmc.stage_rows(result)
    assert rows["structure"]["compute_seconds"] == 3.5
    table = bmc.table_md({"staged": result})
    assert "| structure | 1.00 | – | 1.5 | 3.5 |" in table


def test_cuda_report_gives_working_set_per_token(tmp_path):
    gib = 2**30
    trace = [{"type": "start", "time": 0.0},
             {"type": "event", "t": 2.0, "kind": "load", "model": "flow", "bytes": gib, "seconds": 1.0}]
    result = {"stages": [{"stage": "shape_512", "seconds": 4.0, "used": ["flow"]}], "seconds": 5.0,
              "info": {"lr_tokens": 1024},
              "summary": {"rows": [{"stage": "shape_512", "start": 0.5, "seconds": 4.0, "peak_process": 1,
                                    "peak_device": 3 * gib, "loaded_bytes": gib, "load_seconds": 1.0, "loads": 1}],
                          "peak_device": 3 * gib, "loads": {"seconds": 1.0, "bytes": gib, "count": 1}}}
    raw = {k: {"gb_per_s": 1.0, "cached_before": 0.0} for k in ("cold", "warm")}
    md = bmc.write_cuda_report(tmp_path, {"staged": result}, {"staged": trace}, raw, bm.CUDA_WORK, "cmd", "GPU")
    assert "| shape_512 | 3.00 | 2.00 | 1.0 | 3.0 |" in md  # 3 GiB peak - 1 GiB weights = 2 GiB working set
    assert f"= {2 * gib // 1024} B/token" in md
    assert (tmp_path / "cuda_memory.json").is_file()


def test_reduced_stages_replace_the_cascades_own_by_name_and_run(tiny_cache):
    """The benchmark's reduced stages go through the same Pixal3D entry point (tiny config, tiny work)."""
    from pipelines import Pixal3D
    from pixal3d.config import load_config
    from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG

    config = load_config(TINY_CONFIG)
    work = bm.Work(lr_tokens=20, hr_tokens=30, run_ss_flow=False, ss_decoder_crop=2, upsample_tokens=2,
                   decode_tokens=3, steps=1, guidance=False, reference_condition=False)
    info, loads = {}, []
    replace = bm.reduced_stages(config, work, info)
    assert list(replace) == ["preprocess", "camera", "features", "structure", "shape_512", "upsample", "shape_1024", "texture",
                             "decode"]

    def counting(name, load):
        return lambda: loads.append(name) or load()
    with Pixal3D.from_config(config, policy="staged", device="cpu", replace=replace, until="decode",
                             wrap_loader=counting) as pipe:
        result = pipe.run(EXAMPLE)
    assert info["lr_tokens"] == 20 and info["hr_tokens"] == 30 and len(result.state.coords_hr) == 30
    assert result.state.pbr.coords.shape[0] == info["decoded_voxels"] > 0
    assert set(loads) == {m for stage in pipe.stages for m in stage.needs}  # every load went through the wrapper
    assert loads.count("dinov3") == 1  # the features stage: every size at once, then released for good
