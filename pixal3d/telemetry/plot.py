"""Plots of memory over time with stage bands and load/release marks (matplotlib, Agg): a PNG file
(``plot_traces``) or a figure object (``trace_figure``, e.g. for a web page that redraws it while the
trace grows). Figures are built without pyplot, so threads can draw at the same time."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .trace import LOAD_KINDS, summarize

_GIB = 2**30
_BAND_COLOURS = ("#dbe9f6", "#f6e7d8")


def draw_trace(axes: Any, records: list[dict[str, Any]], title: str) -> None:
    """Draw one trace (complete or still growing) on ``axes``: a band per stage window, process,
    device and swap memory in GiB, exact peaks as dashed levels, loads and releases as lines."""
    summary = summarize(records)
    for index, row in enumerate(summary.rows):
        axes.axvspan(row.start, row.start + row.seconds, color=_BAND_COLOURS[index % 2], lw=0)
        axes.text(row.start + row.seconds / 2, 1.0, row.stage, transform=axes.get_xaxis_transform(),
                  ha="center", va="bottom", fontsize=7, rotation=30)
    samples = [r for r in records if r.get("type") == "sample"]
    for key, label, colour in (("process", "process", "#1f4e79"), ("device", "device", "#2e7d32"),
                               ("swap_used", "swap used", "#b71c1c")):
        points = [(s["t"], s[key] / _GIB) for s in samples if key in s]
        if points and (key != "swap_used" or any(value for _, value in points)):
            axes.plot(*zip(*points), label=label, color=colour, lw=1.2)
    peaks = [r for r in records if r.get("type") == "peak" and "process_peak" in r]
    if peaks:  # an exact peak holds over [since, t]: draw it as a level over that span
        axes.hlines([r["process_peak"] / _GIB for r in peaks], [r.get("since", r["t"]) for r in peaks],
                    [r["t"] for r in peaks], colors="#1f4e79", linestyles="dashed", lw=0.8,
                    label="exact peak")
    for event in (r for r in records if r.get("type") == "event"):
        if event.get("kind") in LOAD_KINDS:
            axes.axvline(event["t"], color="#2e7d32", lw=0.6, ls="--")
        elif event.get("kind") == "release":
            axes.axvline(event["t"], color="#b71c1c", lw=0.6, ls=":")
    axes.set_ylabel("GiB")
    axes.set_ylim(bottom=0)
    axes.set_title(title, fontsize=9, pad=28)
    if axes.get_legend_handles_labels()[0]:  # a trace without samples (a run that ended at once) has no lines
        axes.legend(loc="upper left", fontsize=7)


def trace_figure(traces: list[tuple[str, list[dict[str, Any]]]], *, width: float = 11.0,
                 panel_height: float = 3.6) -> Any:
    """A matplotlib ``Figure`` with one panel per trace (label, records) on a shared time and memory
    scale; green dashed lines are loads, red dotted lines releases."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, panel_height * len(traces)))
    panels = figure.subplots(len(traces), 1, sharex=True, sharey=True, squeeze=False)
    for axes, (label, records) in zip(panels[:, 0], traces):
        draw_trace(axes, records, label)
    panels[-1, 0].set_xlabel("seconds since start")
    figure.tight_layout()
    return figure


def plot_traces(traces: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
    """``trace_figure(traces)`` written to ``path`` (PNG)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace_figure(traces).savefig(path, dpi=110)
    return path
