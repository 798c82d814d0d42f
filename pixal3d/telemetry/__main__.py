"""``python -m pixal3d.telemetry report TRACE [TRACE2] [-o fig.png] [--json out.json]``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .plot import plot_traces
from .report import comparison_json, comparison_table, stage_table
from .trace import read_trace, summarize


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pixal3d.telemetry",
                                     description="Memory traces written by the memory meter.")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="per-stage table of one trace, or two compared")
    report.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                        help="a JSONL trace; give two to compare them (e.g. eager then staged)")
    report.add_argument("-o", "--output", type=Path, help="also plot memory over time to this PNG")
    report.add_argument("--json", type=Path, help="also write the table as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the per-stage table (two traces: one comparison table); optionally plot and save JSON."""
    parser = _parser()
    args = parser.parse_args(argv)
    if len(args.traces) > 2:
        parser.error(f"report takes one or two traces, got {len(args.traces)}")
    try:
        records = [read_trace(path) for path in args.traces]
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
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
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if args.output is not None:
        print(f"plot: {plot_traces(list(zip(labels, records)), args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
