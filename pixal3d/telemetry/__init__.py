"""Memory telemetry: per-platform readers, the background meter, JSONL traces, reports and plots.

Pipeline-agnostic: it imports nothing else from pixal3d and takes registry events duck-typed (an
object with ``to_dict()`` or a dict with ``kind``, ``model``, ``stage``, ``bytes``, ``seconds``,
``time``)::

    with MemoryMeter(out / "memory.jsonl", device=device) as meter:
        models = StagedModels(loaders, stages, events=meter.on_event)
        ...                      # each models.enter(stage) opens that stage's window
        meter.mark("export")     # a window without a registry
    print(stage_table(meter.summary()))
    rows = [row.to_dict() for row in meter.report()]

``python -m pixal3d.telemetry report TRACE [TRACE2] [-o fig.png] [--json table.json]`` prints the
per-stage table of a trace (or two traces side by side) and plots memory over time."""
from .meter import MemoryMeter, event_dict
from .readers import MemoryProbe, ProcessMemory, SystemMemory, system_memory
from .report import comparison_json, comparison_table, stage_table, text_table
from .trace import StageRow, Summary, read_trace, summarize
from .units import format_bytes, parse_duration, parse_size

__all__ = [
    "MemoryMeter", "MemoryProbe", "ProcessMemory", "StageRow", "Summary", "SystemMemory",
    "comparison_json", "comparison_table", "event_dict", "format_bytes", "parse_duration",
    "parse_size", "read_trace", "stage_table", "summarize", "system_memory", "text_table",
]
