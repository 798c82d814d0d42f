"""The side-by-side benchmark's report writer and ComfyUI path check, on fake results (no ComfyUI code needed)."""
import importlib.util
import json

import pytest

from scripts import bench_export_comfy as bench

META = {"voxels": 1000, "resolution": 64, "target": 500, "surface_vertices": 1000, "surface_faces": 2000,
        "surface_seconds": 0.1, "samples": 100, "comfy_call": bench.COMFY_CALL, "machine": "test"}


def _run(side, **extra):
    return {"side": side, "pair": 0, "wall_seconds": 3.0, "returncode": 0, "timed_out": False,
            "tree_peak_rss": 3 * 2**30, "children_max_rss": 2**30,
            "steps": {"remesh": {"seconds": 1.25, "peak_rss": 2**30, "faces": 4000},
                      "simplify": {"seconds": 0.5, "peak_rss": 2**29, "faces": 500}},
            "quality": {"faces": 500, "boundary_edges": 0, "non_manifold_edges": 2, "components": 1,
                        "hausdorff_vox": 1.5, "chamfer_vox": 0.75, "samples": 100}} | extra


def test_the_report_has_the_command_a_row_per_run_and_the_raw_numbers_beside_it(tmp_path):
    out = tmp_path / "b.md"
    runs = [_run("ours", result="/tmp/x.npz"), _run("comfy")]
    bench.write_report(out, "python scripts/bench_export_comfy.py --x 1", META, runs)
    text = out.read_text()
    assert "python scripts/bench_export_comfy.py --x 1" in text.splitlines()[3]
    assert "| 1 | ours | 1.2 | 0.5 | 1.8 | 1.00 | 0.50 | 1.00 | 3.00 | 4,000 | 500 | 1.500 | 0.750 | 0 | 2 | 1 |" in text
    assert "| 1 | comfy |" in text and "did not finish" not in text
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["side"] for r in data["runs"]] == ["ours", "comfy"]
    assert "result" not in data["runs"][0]
    assert data["meta"]["target"] == 500


def test_a_run_that_timed_out_is_reported_with_how_far_it_got(tmp_path):
    out = tmp_path / "b.md"
    killed = {"side": "comfy", "pair": 0, "wall_seconds": 60.0, "returncode": -9, "timed_out": True,
              "tree_peak_rss": 2**31, "log_tail": "Remesh DC:  57%|#####  | 4/7"}
    bench.write_report(out, "cmd", META, [_run("ours"), killed])
    text = out.read_text()
    assert "| 1 | comfy | – | – | – |" in text
    assert "timed out after 60 s" in text and "Remesh DC:  57%" in text


def test_the_comfy_directory_must_hold_both_files_and_gets_stand_ins_without_comfy(tmp_path):
    with pytest.raises(SystemExit, match="missing"):
        bench.comfy_path(tmp_path, tmp_path / "scratch")
    for name in bench.COMFY_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    scratch = tmp_path / "scratch"
    assert bench.comfy_path(tmp_path, scratch) == [str(tmp_path), str(scratch)]
    assert {p.name for p in (scratch / "comfy").iterdir()} == {
        "__init__.py", "quant_ops.py", "utils.py", "model_management.py"}
    spec = importlib.util.spec_from_file_location("standin_utils", scratch / "comfy" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    bar = utils.ProgressBar(10)
    bar.update(3)
    bar.update_absolute(7, 20)
    assert (bar.current, bar.total) == (7, 20)
    (tmp_path / "comfy").mkdir()
    assert bench.comfy_path(tmp_path, scratch) == [str(tmp_path)]
