"""Workers of the cascade-level multi-process tests (tests/pipelines/test_parallel_cascade.py): the tiny cascade through
``Pixal3D`` (library) or ``pixal3d-image-to-mesh`` (command) on ranks started like torchrun starts them
(``tests.support.parallel_harness.spawn``). Module level, so that spawned children can import them.

Children fork from a server started once per test session, whose environment may predate the session's
tiny-weights cache: each worker sets ``PIXAL3D_CACHE`` (and offline mode) itself.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

import tests.support.parallel_harness  # noqa: F401  (first: its preload list is replaced by the longer one below)

# Ranks import the cascade (transformers, DINOv3, ...) in seconds; the fork server does it once when it
# starts (if an earlier test started it without them, every rank imports them itself: slower, the same).
mp.set_forkserver_preload(["torch", "pixal3d.parallel", "tests.support.parallel_harness", "pipelines",
                           "tests.support.parallel_cascade_harness"])

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"
FLOWS = ("sparse_structure_flow_model", "shape_slat_flow_model_512", "shape_slat_flow_model_1024",
         "tex_slat_flow_model_1024")


def _environment(cache: str, threads: int) -> None:
    os.environ["PIXAL3D_CACHE"] = cache
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(threads)


def library_worker(rank: int, cache: str, settings: Any, runs: list[tuple[str, int]], threads: int,
                   until: str | None) -> dict[str, Any]:
    """``Pixal3D.from_config(tiny, parallel=settings)``: rank 0 runs ``runs`` [(image, seed)], the others
    follow. Returns rank 0's fingerprints and parallel records, every rank's model loads
    ``(name, shard stage, shard stages)`` in order, and a follower's image count."""
    _environment(cache, threads)
    from pipelines import Pixal3D
    from pixal3d.parallel.shard import shard_info

    loads: list[tuple[str, int, int]] = []

    def recording(name, load):
        def loader():
            module = load()
            info = shard_info(module) if name in FLOWS else None
            loads.append((name, *((info.stage, info.stages) if info else (0, 0))))
            return module
        return loader

    with Pixal3D.from_config(TINY_CONFIG, policy="staged", device="cpu", until=until, parallel=settings,
                             wrap_loader=recording) as pipe:
        if pipe.is_follower:
            return {"images": pipe.follow(), "loads": loads}
        results = [pipe.run(image, seed=seed) for image, seed in runs]
    return {"fingerprints": [r.fingerprints() for r in results], "parallel": [r.parallel for r in results],
            "loads": loads}


def cli_worker(rank: int, cache: str, argv: list[str] | dict[int, list[str]], folder: str, threads: int,
               out_of_memory_in: str | None = None) -> int:
    """``pixal3d-image-to-mesh argv`` (``argv`` per rank when a dict) as it runs under torchrun; its
    stderr goes to ``folder/rank<r>.stderr``. Returns main()'s exit code on success; raises SystemExit
    with it otherwise (the process then exits non-zero). ``out_of_memory_in``: a stage whose run raises
    ``MemoryError`` on rank 0, as a decode too large for the machine would."""
    _environment(cache, threads)
    from pipelines import cli
    from pipelines.build import CASCADE_STAGES

    if out_of_memory_in is not None and rank == 0:
        def out_of_memory(self, state, models):
            raise MemoryError(f"injected in stage {self.name}")
        stage = next(cls for cls in CASCADE_STAGES if cls.name == out_of_memory_in)
        stage.run = out_of_memory

    args = argv[rank] if isinstance(argv, dict) else argv
    with open(Path(folder) / f"rank{rank}.stderr", "w") as stderr, contextlib.redirect_stderr(stderr):
        code = cli.main([str(a) for a in args])
    Path(folder, f"rank{rank}.code").write_text(str(code))
    if code != 0:
        raise SystemExit(code)
    return code


def data_worker(rank: int, cache: str, argv: list[str], folder: str, threads: int,
                kill_at: tuple[int, int] | None = None) -> int:
    """``cli_worker`` for ``--parallel data``, recording in ``folder``: every model load of this rank
    (``loads.rank<r>``: one name a line) and every stage it finished and recorded in the work directory
    (``stages.log``: ``rank image stage`` lines, appended by every rank). ``kill_at = (r, n)``: rank r kills
    itself with SIGKILL right after recording its n-th stage (mid-batch)."""
    import signal

    from pipelines import loaders, work_dir

    _environment(cache, threads)
    made = loaders.model_loaders

    def recording_loaders(*args, **kwargs):
        def record(name, load):
            def loader():
                with open(Path(folder) / f"loads.rank{rank}", "a") as f:
                    f.write(f"{name}\n")
                return load()
            return loader
        return {name: record(name, load) for name, load in made(*args, **kwargs).items()}

    loaders.model_loaders = recording_loaders
    saved = work_dir.StateStore.saved
    count = [0]

    def logged(self, item, k):
        saved(self, item, k)
        if self.work is not None:
            with open(Path(folder) / "stages.log", "a") as f:
                f.write(f"{rank} {item.name} {self.stages[k].name}\n")
            count[0] += 1
            if kill_at is not None and kill_at == (rank, count[0]):
                os.kill(os.getpid(), signal.SIGKILL)

    work_dir.StateStore.saved = logged
    return cli_worker(rank, cache, argv, folder, threads)


def plan_worker(rank: int, cache: str, memory: list[int], settings: Any) -> dict[str, Any]:
    """``Pixal3D.plan(tiny, parallel=settings)`` with this rank's device memory injected (``memory[rank]`` bytes
    available, as ``detect_machine`` would report it); returns the plan's notes, the gathered capacities and
    the flows' splits. The job joined while planning (``pp_split='auto'``) is closed here."""
    import dataclasses as dc

    _environment(cache, 1)
    from pipelines import Pixal3D, pipeline

    detect = pipeline.detect_machine

    def injected(device):
        return dc.replace(detect(device), device_available=memory[rank])

    pipeline.detect_machine = injected
    plan = Pixal3D.plan(TINY_CONFIG, device="cpu", parallel=settings)
    if plan.role.owns_runtime:
        plan.role.runtime.close()
    return {"notes": list(plan.notes), "capacities": plan.role.capacities, "splits": dict(plan.role.splits)}
