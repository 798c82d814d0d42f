"""run.json: what a run was (config, seed, versions, policy) and what it produced (fingerprints,
per-stage seconds and peak memory), written beside the GLB as ``<name>.run.json``."""
from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pixal3d.config import CascadeConfig, to_dict

from .cascade import StageRecord
from .state import RunState


def versions() -> dict[str, str]:
    """Versions of Python and the libraries that decide the numbers."""
    import numpy
    import torch
    import transformers

    import pixal3d

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "transformers": transformers.__version__, "pixal3d": pixal3d.__version__,
            "platform": platform.platform()}


def run_json_path(output: Path) -> Path:
    """``out.glb`` → ``out.run.json`` (same folder)."""
    return output.with_name(output.stem + ".run.json")


def run_record(config: CascadeConfig, state: RunState, records: Sequence[StageRecord], *, policy: str,
               reasons: Sequence[str], peaks: dict[str, dict[str, int | None]], argv: Sequence[str],
               memory: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The run.json content (``memory``: the meter's per-window rows, including the ``setup`` window
    before the first stage, where an eager run loads its models)."""
    stages = []
    for record in records:
        peak = peaks.get(record.stage, {})
        stages.append({"stage": record.stage, "seconds": round(record.seconds, 4), "models": record.used,
                       "peak_process_bytes": peak.get("process"), "peak_device_bytes": peak.get("device"),
                       "fingerprints": record.fingerprints})
    return {
        "input": str(state.input_path),
        "output": str(state.output_path),
        "command": list(argv),
        "config_file": config.source,
        "config": to_dict(config),
        "seed": state.seed,
        "device": str(state.device),
        "policy": policy,
        "policy_reasons": list(reasons),
        "versions": versions(),
        "tokens": {"lr": _rows(state.coords_lr), "hr": _rows(state.coords_hr), "hr_resolution": state.hr_resolution},
        "total_seconds": round(sum(r.seconds for r in records), 4),
        "stages": stages,
        "memory": list(memory),
        "export": state.export_stats,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON under a temporary name, then rename (never a half-written file)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _rows(tensor: Any) -> int | None:
    return None if tensor is None else int(tensor.shape[0])


def command_line() -> list[str]:
    """The command as typed (for run.json)."""
    return list(sys.argv)
