"""Worker: the app's one ``Pixal3D``, kept alive for the current plan, running one job at a time.

Two cascades at once would need twice the memory the plan promised, so jobs take a lock (the page's
queue already runs them one by one; the lock holds for any other caller too). The pipeline is kept
between jobs, so its policy decides what stays loaded: ``resident`` and ``eager`` keep their models,
``offload`` parks them in host memory, ``staged`` holds none after the export stage. A job whose plan
differs (another policy, texture size, face budget or memory budget, or ``auto`` choosing differently)
closes the pipeline and builds a new one.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pixal3d.config import CascadeConfig

from ..job import BY_NAME, Job
from ..pipeline import Pixal3D
from ..plan import RunPlan, default_device
from ..result import Result

logger = logging.getLogger(__name__)


class Worker:
    """Plans and runs jobs on ``config`` (the app's ``--config``) on ``device`` (default: CUDA, else MPS, else CPU)."""

    def __init__(self, config: CascadeConfig, *, device: str | torch.device | None = None):
        self.config = config
        self.device = torch.device(device) if device is not None else default_device()
        self._lock = threading.Lock()
        self._pipe: Pixal3D | None = None
        self._budget: str | None = None  # the memory budget asked for when the kept pipeline was built

    @property
    def pipeline(self) -> Pixal3D | None:
        """The pipeline kept from the last job (None before the first and after ``close``)."""
        return self._pipe

    @property
    def busy(self) -> bool:
        """True while a job holds the models."""
        return self._lock.locked()

    def plan(self, job: Job) -> RunPlan:
        """The memory plan and the policy for ``job`` (headers only; raises ``NotEnoughMemoryError``,
        ``PolicyError``, ``WeightsError``, ``ConfigError`` as ``Pixal3D.plan`` does)."""
        return Pixal3D.plan(job.config, policy=job.memory_policy, device=self.device, memory_budget=job.budget)

    def run(self, image: Any, job: Job, *, name: str | None = None,
            callback: Callable[[dict[str, Any]], None] | None = None, trace: Path | None = None,
            on_wait: Callable[[], None] | None = None, on_start: Callable[[RunPlan], None] | None = None) -> Result:
        """Wait for the models, plan, then run ``image`` through the cascade (see ``Pixal3D.run``).
        ``on_wait()`` is called if another job holds the models; ``on_start(plan)`` once this one does."""
        if not self._lock.acquire(blocking=False):
            if on_wait is not None:
                on_wait()
            self._lock.acquire()
        try:
            plan = self.plan(job)
            if on_start is not None:
                on_start(plan)
            pipe = self._pipeline_for(plan, job.wire_value(BY_NAME["memory_budget"]))
            return pipe.run(image, seed=job.seed, fov=job.fov, callback=callback, trace=trace, name=name,
                            trace_meta={"app": {"settings": job.settings()}})
        finally:
            self._lock.release()

    def prepare(self, job: Job) -> Pixal3D:
        """The pipeline ``job`` would run on: the kept one if its plan is the same, else a new one (the old one
        closed first). Fetches and verifies weights; loads no model."""
        with self._lock:
            return self._pipeline_for(self.plan(job), job.wire_value(BY_NAME["memory_budget"]))

    def _pipeline_for(self, plan: RunPlan, budget: str | None) -> Pixal3D:
        current = self._pipe
        if current is not None and self._budget == budget and _same_plan(current.run_plan, plan):
            return current
        if current is not None:
            logger.info("plan changed (policy %s → %s); releasing the previous pipeline's models",
                        current.policy.value, plan.policy.value)
            self._pipe = None
            current.close()
        self._pipe, self._budget = Pixal3D.from_plan(plan), budget
        return self._pipe

    def close(self) -> None:
        """Release every model (waits for a running job)."""
        with self._lock:
            if self._pipe is not None:
                self._pipe.close()
                self._pipe = None


def _same_plan(a: RunPlan, b: RunPlan) -> bool:
    """Same config, resolved policy and device, the stages fitted alike (with the same memory budget asked for,
    ``auto`` following the memory available when planned): the pipeline built for ``a`` serves ``b``."""
    return a.config == b.config and a.policy == b.policy and a.device == b.device and a.choices() == b.choices()
