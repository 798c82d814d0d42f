"""Two pipelines with different memory budgets, run at the same time in two threads of one process: each
stage's kernels use the chunk sizes its own plan fitted it to (``pixal3d.nn.limits``, a ContextVar), never
the other pipeline's. Control: the same check fails when the chunk sizes live in module globals (as they did)."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import defaultdict

import torch

from pipelines import Pixal3D, flow_stage
from pipelines.structure import StructureStage
from pixal3d.models import naf
from pixal3d.nn import attention, limits
from tests.support.cascade_fixtures import EXAMPLE, tiny, tiny_cache  # noqa: F401

MIB = 2**20
BUDGETS = {"small": 700 * MIB, "large": 760 * MIB}  # both make shape_512 chunk its kernels, differently


class _FixedStructure(StructureStage):
    """A structure stage without models (the tiny structure stage alone needs more than these budgets)."""

    needs = ()

    def working_set(self) -> int:
        return 0

    def run(self, state, models) -> None:
        state.ss_noise = state.ss_latent = torch.zeros(1)
        state.coords_lr = torch.tensor([[0, x, y, z] for x in (3, 4) for y in (3, 4) for z in (3, 4)],
                                       dtype=torch.int32)


def _run_two_budgets_at_once(config, monkeypatch, scores, naf_limits) -> tuple[dict, dict]:
    """Each pipeline's fitted chunks and what its thread's kernels read: ``scores()`` / ``naf_limits()`` are the
    readers the kernels are given. The first chunked attention call of each run waits for the other run's (and
    reads again), so the two bounded stages overlap whatever the scheduling."""
    plans = {name: Pixal3D.plan(config, policy="staged", device="cpu", memory_budget=budget, until="shape_512",
                                replace={"structure": _FixedStructure.from_config(config)})
             for name, budget in BUDGETS.items()}
    fitted = {name: plan.choices()["shape_512"]["chunks"] for name, plan in plans.items()}
    default = dataclasses.asdict(limits.KernelLimits())
    seen, waited, errors = defaultdict(set), set(), []
    both_inside = threading.Barrier(2, timeout=120)

    def recorded_scores() -> int:
        value, name = scores(), threading.current_thread().name
        if value != default["attention_scores"] and name not in waited:
            waited.add(name)
            both_inside.wait()
            value = scores()
        seen[name].add(("attention_scores", value))
        return value

    def recorded_naf():
        value = naf_limits()
        seen[threading.current_thread().name].add(("naf_elements", value.naf_elements))
        return value

    monkeypatch.setattr(attention, "score_budget", recorded_scores)
    monkeypatch.setattr(naf, "current_limits", recorded_naf)

    def run(name: str) -> None:
        try:
            with Pixal3D.from_plan(plans[name]) as pipe:
                pipe.run(EXAMPLE)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(f"{name}: {type(err).__name__}: {err}")
            both_inside.abort()

    threads = [threading.Thread(target=run, args=(name,), name=name) for name in BUDGETS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return fitted, seen


def _foreign(fitted: dict, seen: dict) -> list[str]:
    """What each run's kernels read that its own plan did not fit it to (the defaults outside bounded stages
    are allowed), and any fitted limit a run never read."""
    default = dataclasses.asdict(limits.KernelLimits())
    problems = []
    for name, chunks in fitted.items():
        allowed = {(k, v) for k, v in chunks.items()} | {(k, v) for k, v in default.items()}
        problems += [f"{name} read {key} = {value}" for key, value in sorted(seen[name] - allowed)]
        problems += [f"{name} never read its {key} = {value}" for key, value in chunks.items()
                     if (key, value) not in seen[name]]
    return problems


def test_two_pipelines_with_different_budgets_in_two_threads_each_use_their_own_chunks(tiny, monkeypatch):
    fitted, seen = _run_two_budgets_at_once(tiny, monkeypatch, attention.score_budget, naf.current_limits)
    assert fitted["small"] != fitted["large"]
    assert _foreign(fitted, seen) == []


def test_control_chunk_sizes_in_module_globals_leak_between_the_two_pipelines(tiny, monkeypatch):
    shared = {"limits": limits.KernelLimits()}

    @contextlib.contextmanager
    def global_limits(**changes):  # what memory_budget.chunk_sizes did: overwrite a module global for the block
        saved = shared["limits"]
        shared["limits"] = dataclasses.replace(saved, **changes)
        try:
            yield
        finally:
            shared["limits"] = saved
    monkeypatch.setattr(flow_stage, "kernel_limits", global_limits)
    fitted, seen = _run_two_budgets_at_once(tiny, monkeypatch, lambda: shared["limits"].attention_scores,
                                            lambda: shared["limits"])
    problems = _foreign(fitted, seen)
    assert problems and any("read attention_scores" in p for p in problems), problems
