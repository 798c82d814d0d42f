"""``python -m pixal3d.telemetry report TRACE [TRACE2] [-o fig.png] [--json out.json]``.

An error is one line on stderr: exit 2 for an output path that cannot be right (a folder, a plot format
matplotlib is not asked to write), checked before anything is read; exit 1 for a trace that cannot be
read or summarised (empty, damaged, mistyped) or an output that cannot be written. Folders of the
outputs are created; what is printed is what was written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .plot import plot_traces
from .report import comparison_json, comparison_table, stage_table
from .trace import read_trace, summarize

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pixal3d.telemetry",
                                     description="Memory traces written by the memory meter.")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="per-stage table of one trace, or two compared")
    report.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                        help="a JSONL trace; give two to compare them (e.g. eager then staged)")
    report.add_argument("-o", "--output", type=Path,
                        help=f"also plot memory over time to this file ({', '.join(PLOT_SUFFIXES)})")
    report.add_argument("--json", type=Path, help="also write the table as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the per-stage table (two traces: one comparison table); optionally plot and save JSON."""
    parser = _parser()
    args = parser.parse_args(argv)
    if len(args.traces) > 2:
        parser.error(f"report takes one or two traces, got {len(args.traces)}")
    problem = _output_problem(args.output, args.json)
    if problem is not None:
        return _fail(problem, 2)
    try:
        records = [read_trace(path) for path in args.traces]
    except (OSError, ValueError) as error:
        return _fail(str(error), 1)
    summaries = [summarize(r) for r in records]
    labels = [path.stem for path in args.traces]
    if len(labels) == 2 and labels[0] == labels[1]:
        labels = [str(path) for path in args.traces]
    if len(summaries) == 1:
        print(stage_table(summaries[0]))
        data = summaries[0].to_dict()
    else:
        pair = (labels[0], labels[1])
        print(comparison_table(summaries[0], summaries[1], pair))
        data = comparison_json(summaries[0], summaries[1], pair)
    try:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        if args.output is not None:
            print(f"plot: {plot_traces(list(zip(labels, records)), args.output)}")
    except OSError as error:
        return _fail(f"cannot write {error.filename or args.output}: {error.strerror or error}", 1)
    return 0


def _output_problem(plot: Path | None, data: Path | None) -> str | None:
    for option, path, example in (("-o", plot, "memory.png"), ("--json", data, "memory.json")):
        if path is not None and path.is_dir():
            return f"{option} {path} is a folder; name a file (e.g. {path / example})"
    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        return f"-o {plot}: the plot is written as {', '.join(PLOT_SUFFIXES)}; name a file with one of these endings"
    return None


def _fail(message: str, code: int) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
