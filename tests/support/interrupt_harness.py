"""Interrupt a batch at chosen points, for tests/pipelines/test_interrupt.py: SIGKILL, SIGINT or SIGTERM delivered to a
run of ``Pixal3D.run_batch`` or of the command, as a stage starts, mid-sampler, between a stage's two record
files, or halfway through writing a GLB.

    python -m tests.support.interrupt_harness plan.json report.json

This process imports everything once; each step of the plan runs in a fork of it (a fresh process as far as
the run is concerned, without paying for the imports again). The parent never runs a torch op before forking,
so no thread pool is copied into a child. Each child logs the (image, stage) pairs it starts to a file before
running them, so a kill loses nothing of the log; the parent notes which stage records exist before each step.

plan:   {"config", "images": [paths], "work_dir", "out", "steps": [{"run": "library" | "cli", "argv": [...],
         "at": {"event": "stage" | "step" | "record" | "glb", "stage", "image"}, "signal": "SIGKILL" | ...}]}
report: one entry per step: {"status": exit code, or minus the signal that ended it, "started": [[image, stage]],
         "records_before", "records_after": [[image, stage]], "temporary_files", "outputs": [names], "stderr": text}
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import traceback
from pathlib import Path

from pipelines import Pixal3D, cli, flow_stage, work_dir
from pixal3d.staging import executor


def _records(work: Path) -> list[list[str]]:
    if not work.is_dir():
        return []
    return sorted([p.parent.name, p.stem] for p in work.glob("*/*.json"))


def _temporary(*folders: Path) -> list[str]:
    return sorted(str(p) for folder in folders if folder.is_dir() for p in folder.rglob(".*.tmp"))


def _instrument(step: dict, log_fd: int) -> None:
    """Log every started (image, stage); deliver the step's signal at its point."""
    at = step.get("at") or {}
    number = getattr(signal, step.get("signal", "SIGKILL"))
    current = {"image": None, "stage": None}

    def hit(event: str) -> bool:
        return (at.get("event") == event and current["image"] == at.get("image")
                and current["stage"] == at.get("stage"))

    class Log(executor.Hook):
        """Told by the executor as each (image, stage) starts: logs it, and delivers a stage-start signal."""

        def before(self, item, k):
            current.update(image=item.name, stage=item.at)
            os.write(log_fd, f"{item.name} {item.at}\n".encode())
            if hit("stage"):
                os.kill(os.getpid(), number)

    original_init = executor.Executor.__init__

    def with_log(self, *args, hooks=(), **kwargs):
        original_init(self, *args, hooks=(*hooks, Log()), **kwargs)
    executor.Executor.__init__ = with_log

    original_sample = flow_stage.sample_flow_euler

    def sample(*args, callback=None, **kwargs):
        def after_step(info):
            if callback is not None:
                callback(info)
            if hit("step"):
                os.kill(os.getpid(), number)
        return original_sample(*args, callback=after_step, **kwargs)
    flow_stage.sample_flow_euler = sample

    original_record = work_dir.write_json_atomic

    def record(path, data):
        if hit("record") and Path(path).suffix == ".json" and Path(path).stem == at.get("stage"):
            os.kill(os.getpid(), number)  # the stage's safetensors is in place, its record is not
        return original_record(path, data)
    work_dir.write_json_atomic = record

    original_write = pathlib.Path.write_bytes

    def write_bytes(self, data):
        if at.get("event") == "glb" and self.name.startswith(f".{at.get('image')}.glb.") and self.suffix == ".tmp":
            with open(self, "wb") as f:
                f.write(data[:len(data) // 2])
            os.kill(os.getpid(), number)  # Python raises the signal's exception here, halfway through
        return original_write(self, data)
    pathlib.Path.write_bytes = write_bytes


def _child(plan: dict, step: dict) -> int:
    if step["run"] == "cli":
        return cli.main(step["argv"])
    out = Path(plan["out"])
    with Pixal3D.from_config(plan["config"], policy="staged", device="cpu") as pipe:
        for item in pipe.run_batch(plan["images"], work_dir=plan["work_dir"]):
            item.result.save(out / f"{item.name}.glb")
    return 0


def main(plan_path: str, report_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    work, out = Path(plan["work_dir"]), Path(plan["out"])
    report = []
    for index, step in enumerate(plan["steps"]):
        log = Path(report_path).with_name(f"started.{index}.log")
        err = Path(report_path).with_name(f"stderr.{index}.txt")
        entry = {"step": step, "records_before": _records(work)}
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                error_fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(error_fd, 2)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                _instrument(step, os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND))
                code = _child(plan, step)
            except BaseException:  # noqa: BLE001 -- the child reports whatever ended it and exits
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        entry["status"] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        entry["started"] = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
        entry["temporary_files"] = _temporary(work, out)
        entry["records_after"] = _records(work)
        entry["outputs"] = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        entry["stderr"] = err.read_text() if err.exists() else ""
        report.append(entry)
    Path(report_path).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
