"""The web app's job, without a browser or Gradio: a tiny job streams its stage, sampler step and memory trace and
ends with a GLB, run.json and the per-stage table; bad inputs end with the library's one-line error and the worker
goes on serving; two jobs sent at once run one after the other; the pipeline is kept while the plan is the same."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from pipelines.app.job import REFUSAL, plan_or_refusal, run_job
from pipelines.inputs.image import NO_IMAGE
from pipelines.job import Job, SettingsError
from pipelines.session import Session
from pixal3d.models.preprocess import ImageError, as_image
from pixal3d.staging import PolicyError
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny, tiny_cache  # noqa: F401


def _job(config, **form):
    """The job the app's form gives for ``form`` (setting name → value) on ``config``."""
    return Job.from_form(form, config)


@pytest.fixture(scope="module")
def RESIDENT(tiny):  # noqa: N802 - the job every test here runs
    return _job(tiny, memory_policy="resident", texture_size=128, face_budget=2000)


@pytest.fixture(scope="module")
def worker(tiny):
    worker = Session("app", device="cpu")
    yield worker
    worker.close()


def _last(updates):
    assert updates and updates[-1].done and all(not u.done for u in updates[:-1])
    return updates[-1]


def test_bad_inputs_end_with_the_one_line_error_and_the_worker_serves_the_next_job(worker, RESIDENT, tmp_path):
    # 1. not an image: the error is the library's ImageError text, on one line
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    with pytest.raises(ImageError) as expected:
        as_image(text)
    bad = _last(list(run_job(worker, text, RESIDENT, outputs=tmp_path, poll=0.05)))
    assert bad.error == " ".join(str(expected.value).split()) and bad.outputs is None
    # 2. nothing uploaded
    assert _last(list(run_job(worker, None, RESIDENT, outputs=tmp_path))).error == NO_IMAGE
    # 3. an image with no object (its alpha is zero everywhere)
    empty = np.zeros((64, 64, 4), dtype=np.uint8)
    nothing = _last(list(run_job(worker, empty, RESIDENT, outputs=tmp_path, poll=0.05)))
    assert nothing.error.startswith("no object found") and "\n" not in nothing.error
    # 4. the same worker then runs a good job
    updates = list(run_job(worker, EXAMPLE, RESIDENT, outputs=tmp_path, poll=0.05))
    done = _last(updates)
    assert done.error is None, done.error
    out = done.outputs
    assert out.glb.read_bytes()[:4] == b"glTF"
    record = json.loads(out.record.read_text())
    assert record["config"]["export"]["texture_size"] == 128 and record["config"]["export"]["decimation_target"] == 2000
    assert record["app"]["settings"] == RESIDENT.settings()  # the job's every setting, under the names clients send
    assert {k: record["app"]["settings"][k] for k in ("seed", "fov", "memory_policy", "texture_size", "face_budget",
                                                      "memory_budget")} == \
        {"seed": 42, "fov": None, "memory_policy": "resident", "texture_size": 128, "face_budget": 2000,
         "memory_budget": None}
    stages = [s.name for s in worker.pipeline.stages]
    assert [row[0] for row in out.table] == [*stages, "total"]
    assert all(row[2].endswith(("MiB", "GiB")) for row in out.table[:-1]), out.table  # peak memory from the meter
    assert {row[0]: row[4] for row in out.table}["features"].startswith("dinov3")
    assert float(out.table[-1][1]) == pytest.approx(sum(float(row[1]) for row in out.table[:-1]), abs=0.05)
    # 5. while it ran: stage and sampler step in the status, the memory trace growing
    statuses = [u.status for u in updates[:-1]]
    assert any(s.startswith("stage ") for s in statuses), statuses  # which stages a poll catches depends on timing
    sizes = [len(u.records) for u in updates]
    assert sizes == sorted(sizes) and 0 < min(n for n in sizes[:-1] if n) < sizes[-1]
    assert [u.fraction for u in updates] == sorted(u.fraction for u in updates) and updates[-1].fraction == 1.0
    # 6. resident: the models stay loaded for the next job
    assert worker.pipeline.runner.registry.loaded()


def test_two_jobs_sent_at_once_run_one_after_the_other(worker, RESIDENT, tmp_path):
    results = {}

    def send(name):
        results[name] = list(run_job(worker, EXAMPLE, RESIDENT, outputs=tmp_path / name, poll=0.05))

    threads = [threading.Thread(target=send, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    spans, waited = [], []
    for updates in results.values():
        out = _last(updates).outputs
        assert out is not None, _last(updates).error
        records = [json.loads(line) for line in out.trace.read_text().splitlines()]
        start, end = records[0], records[-1]
        assert start["type"] == "start" and end["type"] == "end"
        spans.append((start["time"], start["time"] + end["t"], records))
        waited.append(any(u.status.startswith("waiting") for u in updates))
    (_, first_end, _), (second_start, _, second) = sorted(spans, key=lambda span: span[0])
    assert first_end <= second_start  # no overlap in the meter's traces
    assert sorted(waited) == [False, True]  # control: they were sent together, so one of them had to wait
    # the policy (resident) kept the models: the later job loaded none
    assert not [r for r in second if r["type"] == "event" and r["kind"] in ("load", "reload")]


def test_a_job_whose_page_went_away_stops_at_its_next_stage_and_frees_the_models(worker, RESIDENT, tmp_path):
    """Gradio closes the job's generator when the visitor leaves: the run stops at its next stage or sampler
    step instead of finishing a mesh nobody will see while the next visitor waits. Control: the same job read
    to its end runs every stage."""
    def stages_run(folder):
        trace = next(folder.rglob("*.trace.jsonl"))
        return {r["stage"] for r in map(json.loads, trace.read_text().splitlines()) if r.get("stage")}

    updates = run_job(worker, EXAMPLE, RESIDENT, outputs=tmp_path / "left", poll=0.01)
    for update in updates:
        if update.status.startswith("stage ") and " · structure" in update.status:
            break
    else:
        pytest.fail("the job ended before its structure stage was seen")
    updates.close()  # what Gradio does when the page goes away
    job = next(t for t in threading.enumerate() if t.name == "pixal3d-job-example")
    job.join(timeout=60)
    assert not job.is_alive()
    ran = stages_run(tmp_path / "left")
    assert "structure" in ran and "export" not in ran and "decode" not in ran, ran
    done = _last(list(run_job(worker, EXAMPLE, RESIDENT, outputs=tmp_path / "next", poll=0.05)))
    assert done.error is None and done.outputs.glb.read_bytes()[:4] == b"glTF"  # the next job runs at once
    assert {"structure", "decode", "export"} <= stages_run(tmp_path / "next")  # control: read to the end


def test_the_pipeline_is_kept_while_the_plan_is_the_same_and_rebuilt_when_it_changes(tiny):
    worker = Session("app", device="cpu")
    try:
        first = worker.prepare(_job(tiny, memory_policy="staged"))
        assert worker.prepare(_job(tiny, memory_policy="staged", seed=7, fov=30.0)) is first  # run arguments only
        bigger = worker.prepare(_job(tiny, memory_policy="staged", texture_size=512))
        assert bigger is not first and bigger.config.export.texture_size == 512
        assert worker.plan(_job(tiny, memory_policy="staged", texture_size=512)).memory.stages[-1].working_bytes > \
            worker.plan(_job(tiny, memory_policy="staged", texture_size=128)).memory.stages[-1].working_bytes
        assert worker.prepare(_job(tiny, memory_policy="resident", texture_size=512)).policy.value == "resident"
        # the memory budget is the plan's too: another budget, another pipeline, fitted and recorded with it
        budgeted = worker.prepare(_job(tiny, memory_policy="resident", texture_size=512, memory_budget="2G"))
        assert budgeted.run_plan.memory_budget == 2 * 2**30
        assert worker.prepare(_job(tiny, memory_policy="resident", texture_size=512, memory_budget="2G")) is budgeted
        auto = worker.prepare(_job(tiny, memory_policy="resident", texture_size=512, memory_budget="auto"))
        assert auto is not budgeted and auto.run_plan.memory_budget > 0
        assert worker.prepare(_job(tiny, memory_policy="resident", texture_size=512, memory_budget="auto")) is auto
        assert worker.prepare(_job(tiny, memory_policy="resident", texture_size=512)) is not auto  # control: none
    finally:
        worker.close()


def test_before_a_run_the_page_shows_the_plan_or_the_refusal_with_its_reason(worker, RESIDENT, tiny, tmp_path,
                                                                             monkeypatch):
    from pipelines import pipeline

    machine = pipeline.detect_machine("cpu")  # read once: the two tables compare texts, not two moments of memory
    monkeypatch.setattr(pipeline, "detect_machine", lambda device=None: machine)
    assert plan_or_refusal(worker, RESIDENT) == worker.plan(RESIDENT).table()  # the text --plan prints
    offload = _job(tiny, memory_policy="offload")  # parks models in host memory: refused where memory is unified (CPU)
    refusal = plan_or_refusal(worker, offload)
    with pytest.raises(PolicyError) as expected:
        worker.plan(offload)
    assert refusal == REFUSAL + " ".join(str(expected.value).split())
    job = _last(list(run_job(worker, EXAMPLE, offload, outputs=tmp_path, poll=0.05)))
    assert job.error == refusal.removeprefix(REFUSAL) and job.outputs is None


@pytest.mark.parametrize("settings, rule", [
    ({"seed": -1}, "seed"), ({"fov": 200.0}, "field of view.*or automatic"),
    ({"memory_policy": "fast"}, "memory policy"),
    ({"memory_budget": "lots"}, "memory budget 'lots' is not a size.*or auto"),
])
def test_settings_out_of_range_are_refused_naming_the_setting(tiny, settings, rule):
    with pytest.raises(SettingsError, match=rule):
        _job(tiny, **settings)


def test_export_settings_out_of_range_are_refused(tiny):
    with pytest.raises(SettingsError, match="texture_size"):
        _job(tiny, texture_size=8)
    with pytest.raises(SettingsError, match="decimation_target"):
        _job(tiny, face_budget=2)


def test_the_command_binds_to_loopback_and_refuses_a_bad_config_or_port_in_one_line(tmp_path, capsys):
    from pipelines.app.main import main, parse_args

    assert parse_args([]).host == "127.0.0.1"  # this machine only, unless --host says otherwise
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pixal3d-app: error: config file") and error.count("\n") == 1
    assert main(["--config", str(TINY_CONFIG), "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err


def test_the_status_names_the_stage_and_the_sampler_step_the_run_reported():
    """What a poll shows, from the run's callback reports (deterministic; the job test only sees what its polls
    happen to catch)."""
    from pipelines.app.job import _Progress

    progress = _Progress()
    assert progress.status() == "planning"
    progress({"kind": "stage", "stage": "structure", "index": 2, "stages": 9})
    progress.plan = object()
    assert progress.status() == "stage 3/9 · structure"
    progress({"kind": "step", "stage": "structure", "step": 1, "steps": 2})
    assert progress.status() == "stage 3/9 · structure · sampler step 1/2"
    assert progress.fraction() == pytest.approx((2 + 0.5) / 9)
    progress({"kind": "stage", "stage": "shape_512", "index": 3, "stages": 9})
    assert progress.status() == "stage 4/9 · shape_512"  # a new stage starts without a step
