"""Memory telemetry: per-platform readers, the background meter, JSONL traces, reports and plots.

Pipeline-agnostic: it imports nothing else from pixal3d and takes registry events duck-typed."""
from .meter import MemoryMeter, event_dict
from .readers import MemoryProbe, ProcessMemory, SystemMemory, system_memory
from .report import comparison_json, comparison_table, stage_table
from .trace import StageRow, Summary, read_trace, summarize
from .units import format_bytes, parse_duration, parse_size

__all__ = [
    "MemoryMeter", "MemoryProbe", "ProcessMemory", "StageRow", "Summary", "SystemMemory",
    "comparison_json", "comparison_table", "event_dict", "format_bytes", "parse_duration",
    "parse_size", "read_trace", "stage_table", "summarize", "system_memory",
]
