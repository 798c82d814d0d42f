"""Per-stage memory tables, as text and JSON, for one trace or two traces side by side."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .trace import StageRow, Summary, peak_of
from .units import format_bytes

_HEADER = ("stage", "peak process", "peak device", "loaded", "load s", "stage s")


def _cells(row: StageRow | None) -> tuple[str, ...]:
    if row is None:
        return ("-",) * 5
    return (format_bytes(row.peak_process), format_bytes(row.peak_device),
            format_bytes(row.loaded_bytes), f"{row.load_seconds:.1f}", f"{row.seconds:.1f}")


def text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Rows under a header and a rule, the first column left-aligned and the others right-aligned: every
    per-stage table of the project (this module's, the command's and the web app's rows) is printed so."""
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _totals(summary: Summary) -> tuple[str, ...]:
    return ("total", format_bytes(summary.peak_process), format_bytes(summary.peak_device),
            format_bytes(summary.loads["bytes"]), f"{summary.loads['seconds']:.1f}",
            f"{summary.duration:.1f}")


def stage_table(summary: Summary) -> str:
    """A text table of one trace's stages, with a total line and what the run did not finish."""
    body = [(row.stage, *_cells(row)) for row in summary.rows] + [_totals(summary)]
    notes = []
    if not summary.complete:
        notes.append("the trace has no 'end' record: the run was stopped or is still going")
    if summary.outside_stage:
        notes.append("loaded outside their stage: " + ", ".join(summary.outside_stage))
    swap = summary.swap
    if swap["start"] is not None:
        notes.append(f"swap used: {format_bytes(swap['start'])} at start, "
                     f"{format_bytes(swap['peak'])} peak, {format_bytes(swap['end'])} at end")
    return "\n".join([text_table(_HEADER, body), *notes])


def _stage_order(first: list[StageRow], second: list[StageRow]) -> list[str]:
    names = [row.stage for row in first]
    names += [row.stage for row in second if row.stage not in names]
    return names


def _by_stage(rows: list[StageRow]) -> dict[str, StageRow]:
    """One row per stage name; a stage entered twice keeps its higher peak and summed times."""
    merged: dict[str, StageRow] = {}
    for row in rows:
        if row.stage not in merged:
            merged[row.stage] = StageRow(**row.to_dict())
            continue
        kept = merged[row.stage]
        kept.peak_process = peak_of(kept.peak_process, row.peak_process)
        kept.peak_device = peak_of(kept.peak_device, row.peak_device)
        kept.seconds += row.seconds
        kept.loaded_bytes += row.loaded_bytes
        kept.load_seconds += row.load_seconds
        kept.loads += row.loads
    return merged


def comparison_table(first: Summary, second: Summary, labels: tuple[str, str] = ("A", "B")) -> str:
    """Two traces as one table: peak process memory and stage time for each, stage by stage."""
    a, b = _by_stage(first.rows), _by_stage(second.rows)
    header = ("stage", f"peak {labels[0]}", f"peak {labels[1]}", f"s {labels[0]}", f"s {labels[1]}")

    def pair(row_a: StageRow | None, row_b: StageRow | None) -> tuple[str, ...]:
        return (format_bytes(row_a.peak_process if row_a else None),
                format_bytes(row_b.peak_process if row_b else None),
                f"{row_a.seconds:.1f}" if row_a else "-", f"{row_b.seconds:.1f}" if row_b else "-")

    body = [(name, *pair(a.get(name), b.get(name))) for name in _stage_order(first.rows, second.rows)]
    body.append(("total", format_bytes(first.peak_process), format_bytes(second.peak_process),
                 f"{first.duration:.1f}", f"{second.duration:.1f}"))
    return text_table(header, body)


def comparison_json(first: Summary, second: Summary,
                    labels: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    """Both summaries under their labels, plus per-stage peaks side by side."""
    a, b = _by_stage(first.rows), _by_stage(second.rows)
    stages = []
    for name in _stage_order(first.rows, second.rows):
        entry: dict[str, Any] = {"stage": name}
        for label, rows in zip(labels, (a, b)):
            row = rows.get(name)
            entry[label] = row.to_dict() if row else None
        stages.append(entry)
    return {"labels": list(labels), "stages": stages,
            labels[0]: first.to_dict(), labels[1]: second.to_dict()}
