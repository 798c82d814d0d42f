"""MemoryMeter: a well-formed trace, the stage-window rule, exact peaks, errors, registry events."""
import json
import threading
import time

import pytest

from pixal3d.telemetry import MemoryMeter, linux
from pixal3d.telemetry.trace import read_trace


class FakeProbe:
    """Reports ``memory`` as the process counter; peaks() returns what ``peak`` was set to."""

    def __init__(self):
        self.memory, self.peak, self.fail = 10, None, None
        self.calls = 0

    def sample(self):
        self.calls += 1
        if self.fail:
            raise OSError(self.fail)
        return {"process": self.memory, "swap_used": 0}

    def peaks(self):
        peak, self.peak = self.peak, None
        return {"process_peak": peak} if peak is not None else {}


def event(kind, stage=None, model=None, nbytes=0, seconds=0.0, at=None):
    return {"kind": kind, "model": model, "stage": stage, "bytes": nbytes, "seconds": seconds,
            "time": time.time() if at is None else at}


def wait_for_samples(probe, count):
    target = probe.calls + count
    deadline = time.monotonic() + 5
    while probe.calls < target and time.monotonic() < deadline:
        time.sleep(0.005)


def test_trace_is_well_formed_jsonl(tmp_path):
    probe = FakeProbe()
    path = tmp_path / "runs" / "trace.jsonl"
    with MemoryMeter(path, interval=0.01, probe=probe, meta={"mode": "staged"}) as meter:
        wait_for_samples(probe, 3)
        meter.on_event(event("stage", "one"))
        meter.on_event(event("load", "one", "a", 100, 0.001))
        wait_for_samples(probe, 3)
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["type"] == "start" and records[0]["mode"] == "staged"
    assert records[0]["interval"] == 0.01
    assert records[-1]["type"] == "end"
    assert {r["type"] for r in records} == {"start", "sample", "event", "end"}
    events = [r for r in records if r["type"] == "event"]
    assert [(e["kind"], e.get("model")) for e in events] == [("stage", None), ("load", "a")]
    assert all(0 <= r["t"] < 5 for r in records[1:])
    assert sum(r["type"] == "sample" for r in records) >= 6
    assert read_trace(path) == records == meter.records


def test_stage_window_starts_after_the_release_entering_it_triggers():
    probe = FakeProbe()
    with MemoryMeter(None, interval=0.01, probe=probe) as meter:
        meter.on_event(event("stage", "one"))
        meter.on_event(event("load", "one", "big", 500, 0.001))
        probe.memory = 500
        wait_for_samples(probe, 3)
        began = time.time()
        wait_for_samples(probe, 5)  # the release is running: the weights are still resident
        probe.memory = 20
        meter.on_event(event("release", "one", "big", 480, time.time() - began))
        meter.on_event(event("stage", "two"))
        wait_for_samples(probe, 5)
    rows = {row.stage: row for row in meter.report()}
    assert rows["one"].peak_process == 500
    assert rows["two"].peak_process == 20  # the samples during the release are nobody's
    gap = [r for r in meter.records if r["type"] == "sample" and rows["one"].start + rows["one"].seconds
           <= r["t"] < rows["two"].start]
    assert gap and max(r["process"] for r in gap) == 500  # control: they were recorded


def test_exact_peak_at_a_boundary_is_kept_when_no_sample_saw_it():
    probe = FakeProbe()
    with MemoryMeter(None, interval=30, probe=probe) as meter:  # no background sample in the test
        meter.on_event(event("stage", "one"))
        probe.peak = 900  # what the kernel counter saw between two samples
        meter.on_event(event("stage", "two"))
    rows = {row.stage: row for row in meter.report()}
    assert rows["one"].peak_process == 900 and rows["one"].exact_peak
    assert rows["two"].peak_process == 10


def test_read_errors_are_recorded_once_per_streak_and_sampling_goes_on():
    probe = FakeProbe()
    with MemoryMeter(None, interval=0.01, probe=probe) as meter:
        probe.fail = "counter gone"
        wait_for_samples(probe, 4)
        probe.fail = None
        wait_for_samples(probe, 2)
        probe.fail = "counter gone"
        wait_for_samples(probe, 3)
        probe.fail = None
    errors = [r["error"] for r in meter.records if r["type"] == "error"]
    assert errors == ["OSError: counter gone", "OSError: counter gone"]
    assert meter.records[-1]["type"] == "end"
    assert meter.summary().errors == errors


def test_events_as_objects_with_to_dict_and_marks():
    class Event:
        def to_dict(self):
            return event("stage", "structure")

    probe = FakeProbe()
    with MemoryMeter(None, interval=30, probe=probe) as meter:
        meter.on_event(Event())
        meter.mark("export")
        with pytest.raises(ValueError, match="no 'kind'"):
            meter.on_event({"stage": "x"})
    assert [row.stage for row in meter.stage_rows()][-2:] == ["structure", "export"]


def test_events_outside_the_meter_are_dropped():
    meter = MemoryMeter(None, probe=FakeProbe())
    meter.on_event(event("stage", "one"))
    assert meter.records == []


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval"):
        MemoryMeter(None, interval=0)


def test_real_registry_events_drive_the_windows():
    torch = pytest.importorskip("torch")
    staging = pytest.importorskip("pixal3d.staging.registry")
    probe = FakeProbe()
    with MemoryMeter(None, interval=30, probe=probe) as meter:
        models = staging.StagedModels({"a": lambda: torch.nn.Linear(64, 64), "b": lambda: torch.nn.Linear(8, 8)},
                                      {"first": ["a"], "second": ["b"]}, events=meter.on_event)
        models.enter("first")
        models["a"]
        models.enter("second")
        models["b"]
        models.close()
    rows = {row.stage: row for row in meter.report()}
    assert rows["first"].loaded_bytes == (64 * 64 + 64) * 4 and rows["first"].loads == 1
    assert rows["second"].loaded_bytes == (8 * 8 + 8) * 4
    assert rows["first"].releases == 0  # a's release on entering "second" is the transition


@pytest.mark.skipif(not linux.is_linux(), reason="exact peaks through /proc/self/clear_refs")
def test_spike_shorter_than_the_sampling_period_is_the_stage_peak():
    if not linux.reset_peak():
        pytest.skip("this kernel or sandbox does not allow resetting VmHWM")
    size = 160 * 2**20
    with MemoryMeter(None, interval=10) as meter:
        meter.on_event(event("stage", "quiet"))
        meter.on_event(event("stage", "spike"))
        spike = bytearray(b"\x01") * size  # touched pages, freed before any sample can see them
        del spike
        meter.on_event(event("stage", "after"))
    rows = {row.stage: row for row in meter.report()}
    sampled = [r["process"] for r in meter.records if r["type"] == "sample"]
    assert rows["spike"].exact_peak
    assert rows["spike"].peak_process >= max(sampled) + size * 0.9
    assert rows["quiet"].peak_process < rows["spike"].peak_process - size * 0.9
    assert threading.active_count() >= 1
