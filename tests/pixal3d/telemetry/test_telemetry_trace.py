"""Trace reading, stage windows (the release-window rule), per-stage rows, reports, plots and CLI."""
import json

import pytest

from pixal3d.telemetry import __main__ as cli
from pixal3d.telemetry.report import comparison_json, comparison_table, stage_table
from pixal3d.telemetry.trace import read_trace, summarize

GIB = 2**30


def sample(t, process, **extra):
    return {"type": "sample", "t": t, "process": process, **extra}


def event(t, kind, model=None, stage=None, nbytes=0, seconds=0.0):
    record = {"type": "event", "t": t, "kind": kind, "bytes": nbytes, "seconds": seconds}
    if model:
        record["model"] = model
    if stage:
        record["stage"] = stage
    return record


def staged_trace():
    """setup; structure loads A (3 GiB); entering shape releases A over 1 s, then shape loads B."""
    return [
        {"type": "start", "time": 1000.0, "interval": 0.25, "mode": "staged"},
        sample(0.0, 1 * GIB, swap_used=10),
        event(0.5, "stage", stage="structure"),
        event(1.5, "load", "A", "structure", 3 * GIB, 1.0),
        sample(2.0, 4 * GIB, swap_used=20),
        # releasing A began at 3.0 and finished at 4.0; the stage event follows it
        sample(3.5, 4 * GIB, swap_used=20),  # previous stage's weights still resident
        event(4.0, "release", "A", "structure", 3 * GIB, 1.0),
        event(4.0, "stage", stage="shape"),
        sample(4.2, 1 * GIB),
        event(5.0, "load", "B", "shape", 2 * GIB, 0.5),
        sample(5.5, 3 * GIB, swap_used=12),
        {"type": "sample", "t": 6.0, "process": 3 * GIB},
        {"type": "end", "t": 6.0},
    ]


def rows_by_stage(summary):
    return {row.stage: row for row in summary.rows}


def test_stage_windows_start_after_the_release_that_entering_them_triggers():
    summary = summarize(staged_trace())
    rows = rows_by_stage(summary)
    assert list(rows) == ["setup", "structure", "shape"]
    # the 3.5 s sample (4 GiB, A still resident) belongs to no stage
    assert rows["shape"].peak_process == 3 * GIB
    assert rows["shape"].start == 4.0 and rows["shape"].seconds == pytest.approx(2.0)
    assert rows["structure"].peak_process == 4 * GIB
    assert rows["structure"].seconds == pytest.approx(2.5)  # 0.5 .. 3.0, the release start
    assert rows["structure"].samples == 1 and rows["shape"].samples == 3
    assert summary.peak_process == 4 * GIB


def test_control_without_the_release_the_sample_belongs_to_the_stage():
    records = [r for r in staged_trace() if r.get("kind") != "release"]
    assert rows_by_stage(summarize(records))["structure"].peak_process == 4 * GIB
    moved = [dict(r, t=4.1) if r.get("t") == 3.5 else r for r in staged_trace()]
    assert rows_by_stage(summarize(moved))["shape"].peak_process == 4 * GIB


def test_loads_and_totals_per_stage():
    summary = summarize(staged_trace())
    rows = rows_by_stage(summary)
    assert (rows["structure"].loaded_bytes, rows["structure"].load_seconds) == (3 * GIB, 1.0)
    assert (rows["shape"].loaded_bytes, rows["shape"].loads) == (2 * GIB, 1)
    assert rows["setup"].seconds == 0.5 and rows["setup"].peak_process == GIB
    assert summary.loads == {"count": 2, "bytes": 5 * GIB, "seconds": 1.5}
    assert summary.releases == {"count": 1, "bytes": 3 * GIB}
    assert summary.swap == {"start": 10, "peak": 20, "end": 12}
    assert summary.complete and summary.duration == 6.0


def test_mid_stage_release_stays_in_its_stage():
    records = staged_trace()
    records.insert(10, event(4.6, "release", "C", "shape", GIB, 0.1))  # after a load: not a transition
    rows = rows_by_stage(summarize(records))
    assert rows["shape"].releases == 1 and rows["shape"].start == 4.0


def test_exact_peaks_are_charged_to_the_window_they_began_in():
    records = staged_trace()
    # read at the release event: covers structure's tail, so it is structure's peak
    records.insert(6, {"type": "peak", "t": 4.0, "since": 0.5, "process_peak": 9 * GIB})
    # read at the stage event after the release: covers only the transition
    records.insert(8, {"type": "peak", "t": 4.0, "since": 4.0 - 1e-9, "process_peak": 8 * GIB})
    records.insert(-1, {"type": "peak", "t": 6.0, "since": 4.0, "process_peak": 5 * GIB,
                        "device_peak": 2 * GIB})
    rows = rows_by_stage(summarize(records))
    assert rows["structure"].peak_process == 9 * GIB and rows["structure"].exact_peak
    assert rows["shape"].peak_process == 5 * GIB and rows["shape"].peak_device == 2 * GIB


def test_reentering_the_current_stage_keeps_one_window():
    records = staged_trace()
    records.insert(9, event(4.5, "stage", stage="shape"))
    assert [row.stage for row in summarize(records).rows] == ["setup", "structure", "shape"]


def test_marks_open_windows_and_outside_stage_loads_are_listed():
    records = staged_trace()[:-1] + [event(6.0, "outside_stage", "B", "export"),
                                      event(6.0, "mark", stage="export"),
                                      sample(6.5, GIB), {"type": "end", "t": 7.0}]
    summary = summarize(records)
    assert summary.rows[-1].stage == "export" and summary.rows[-1].seconds == 1.0
    assert summary.outside_stage == ["B"]


def test_empty_setup_window_is_dropped():
    records = [{"type": "start", "time": 0}, event(0.0, "stage", stage="one"), sample(0.1, 5),
               {"type": "end", "t": 0.2}]
    assert [row.stage for row in summarize(records).rows] == ["one"]


def test_read_trace_skips_a_half_written_last_line_and_rejects_a_broken_middle(tmp_path):
    good = [json.dumps(r) for r in staged_trace()[:4]]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(good) + '\n{"type":"sam')
    assert len(read_trace(path)) == 4
    path.write_text("\n".join([good[0], "{oops", *good[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_trace(path)


def test_stage_table_lists_every_stage_and_flags_an_unfinished_trace():
    text = stage_table(summarize(staged_trace()[:-1]))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["stage", "peak", "process"]
    assert [line.split()[0] for line in lines[2:6]] == ["setup", "structure", "shape", "total"]
    assert "4.00 GiB" in lines[3] and "3.00 GiB" in lines[3]  # peak and bytes loaded
    assert "no 'end' record" in text


def test_comparison_table_and_json_put_both_runs_side_by_side():
    eager = summarize([dict(r, process=r["process"] * 2) if r.get("type") == "sample" else r
                       for r in staged_trace()])
    staged = summarize(staged_trace())
    table = comparison_table(eager, staged, ("eager", "staged"))
    shape = next(line for line in table.splitlines() if line.startswith("shape"))
    assert shape.split()[1:5] == ["6.00", "GiB", "3.00", "GiB"]
    data = comparison_json(eager, staged, ("eager", "staged"))
    assert [s["stage"] for s in data["stages"]] == ["setup", "structure", "shape"]
    assert data["stages"][2]["staged"]["peak_process"] == 3 * GIB
    assert data["eager"]["peak_process"] == 8 * GIB


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_report_cli_prints_table_writes_json_and_plot(tmp_path, capsys):
    trace = write_trace(tmp_path / "staged.jsonl", staged_trace())
    assert cli.main(["report", str(trace), "-o", str(tmp_path / "fig.png"),
                     "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "structure" in out and "shape" in out
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "fig.png").stat().st_size > 5000
    assert json.loads((tmp_path / "t.json").read_text())["rows"][1]["stage"] == "structure"


def test_report_cli_compares_two_traces_in_one_table_and_figure(tmp_path, capsys):
    first = write_trace(tmp_path / "eager.jsonl", staged_trace())
    second = write_trace(tmp_path / "staged.jsonl", staged_trace())
    assert cli.main(["report", str(first), str(second), "-o", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert "peak eager" in out and "peak staged" in out
    assert (tmp_path / "cmp.png").stat().st_size > 5000


def test_report_cli_rejects_a_damaged_trace(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"type":"start"}\n{oops\n{"type":"end"}\n')
    assert cli.main(["report", str(path)]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err


# -- issue 16: the report command on empty, damaged and mistyped traces, and its output paths -------------
def _one_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("content, words", [
    ("", "no records"),
    ("\n\n", "no records"),
    ("this is not a trace\n", "not a JSON trace record"),
    ('[1, 2, 3]\n{"type":"end","t":1}\n', ":1 is not a JSON object"),
    ('{"type":"start","time":0}\n{"type":"sample","t":"soon","process":1}\n{"type":"end","t":1}\n', "'t'"),
    ('{"type":"start","time":0}\n{"type":"sample","t":1,"process":"lots"}\n{"type":"end","t":1}\n', "'process'"),
    ('{"type":"start","time":0}\n{"type":"event","t":1,"kind":"load","bytes":"3"}\n', "'bytes'"),
    ('{"type":"start","time":0}\n{"type":7,"t":1}\n', "'type'"),
])
def test_report_cli_refuses_an_empty_damaged_or_mistyped_trace_in_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    plot = tmp_path / "fig.png"
    assert cli.main(["report", str(path), "-o", str(plot)]) == 1
    line = _one_error(capsys)
    assert "t.jsonl" in line and words in line, line
    assert not plot.exists()


def test_report_cli_refuses_a_folder_or_an_unknown_format_for_the_plot_before_reading(tmp_path, capsys):
    trace = write_trace(tmp_path / "staged.jsonl", staged_trace())
    folder = tmp_path / "plots"
    folder.mkdir()
    assert cli.main(["report", str(trace), "-o", str(folder)]) == 2
    assert "is a folder" in _one_error(capsys) and list(folder.iterdir()) == []
    assert cli.main(["report", str(trace), "-o", str(tmp_path / "x.txt")]) == 2
    assert ".png" in _one_error(capsys) and not (tmp_path / "x.txt").exists()


def test_report_cli_creates_the_folders_of_json_and_plot_and_prints_what_it_wrote(tmp_path, capsys):
    trace = write_trace(tmp_path / "staged.jsonl", staged_trace())
    data, plot = tmp_path / "missing" / "x.json", tmp_path / "deep" / "er" / "fig.svg"
    assert cli.main(["report", str(trace), "--json", str(data), "-o", str(plot)]) == 0
    assert json.loads(data.read_text())["rows"][1]["stage"] == "structure"
    assert plot.read_text().lstrip().startswith("<?xml") and f"plot: {plot}" in capsys.readouterr().out


def test_report_cli_an_unwritable_json_path_is_one_line(tmp_path, capsys):
    trace = write_trace(tmp_path / "staged.jsonl", staged_trace())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli.main(["report", str(trace), "--json", str(blocker / "x.json")]) == 1
    assert str(blocker) in _one_error(capsys)


def test_a_trace_without_samples_plots_without_a_legend_or_a_warning(tmp_path):
    """A run that ended before the meter's first sample (a tiny job) has nothing to label: the plot has no legend and
    matplotlib says nothing (it warned "No artists with labels found" in the app's log). Control: a trace with
    samples gets its legend."""
    import warnings

    pytest.importorskip("matplotlib")
    from pixal3d.telemetry.plot import trace_figure

    bare = [{"type": "start", "time": 1000.0, "interval": 0.25, "mode": "staged"},
            event(0.1, "stage", stage="structure"), {"type": "end", "t": 0.2}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = trace_figure([("bare", bare)])
    assert figure.axes[0].get_legend() is None
    assert trace_figure([("staged", staged_trace())]).axes[0].get_legend() is not None
