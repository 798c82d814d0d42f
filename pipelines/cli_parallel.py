"""``pixal3d-image-to-mesh --parallel ...`` under torchrun: every rank joins the job, rank 0 runs the command.

    torchrun --nproc-per-node 2 scripts/image_to_mesh.py input.png --parallel cfg

1. Every rank joins the job (``init_parallel``: the rendezvous) before it reads a config or a weight,
   so a failure anywhere after that point reaches every rank (``runtime.fail``) instead of leaving
   the others waiting.
2. Rank 0 runs the command exactly as one process would (``cli._main``: plan, weights, one run per
   input, the GLB, run.json, latents and trace); only it reads the inputs and writes outputs.
3. Ranks ≠ 0 plan their part (the flow stages on shards of the flow models), load only that, and
   follow rank 0 image after image (``Pixal3D.follow``) until rank 0 ends the job.

Errors: one line on stderr, as without torchrun. An error every rank sees alike (``ParallelConfigError``:
settings that do not fit the job or the config) is printed by rank 0 only; any other error is printed by
the rank that has it, and a rank stopped by another's failure says which rank failed and why. Exit codes:
2 before the first image, 1 during the run, on every rank.
"""
from __future__ import annotations

import argparse
import sys

from pixal3d.config import load_config
from pixal3d.parallel import (
    ParallelConfigError,
    ParallelRuntime,
    ParallelSettings,
    init_parallel,
)
from pixal3d.parallel.topology import Topology

from .cli import UsageError, _classify, _fail, _main, default_device, parse_device
from .errors import Failure, classify
from .parallel import rank_device
from .pipeline import Pixal3D


def run_job(args: argparse.Namespace, settings: ParallelSettings) -> int:
    """This rank's part of the parallel command; returns its exit code."""
    topology = Topology.from_env(settings)
    if args.plan:  # each rank can plan; rank 0 prints its plan, nobody joins a job
        return _main(args, settings) if topology.rank == 0 else 0
    try:
        device = rank_device(parse_device(args.device) if args.device else default_device(), topology)
        runtime = init_parallel(settings, device=device)
    except (UsageError, ParallelConfigError) as err:  # the same on every rank
        return _fail(classify(err, started=False)) if topology.rank == 0 else 2
    try:
        return _main(args, runtime) if topology.rank == 0 else _follow(args, runtime)
    except BaseException as err:  # an unforeseen error: the other ranks stop too, then the traceback
        runtime.fail(err)
        raise
    finally:
        runtime.close()


def _follow(args: argparse.Namespace, runtime: ParallelRuntime) -> int:
    """A rank ≠ 0: plan, fetch and check only the flow models' weights, then follow rank 0."""
    try:
        plan = Pixal3D.plan(load_config(args.config), policy=args.memory_policy, device=runtime.device,
                            memory_budget=args.memory_budget,
                            parallel=runtime)
        with Pixal3D.from_plan(plan) as pipe:
            pipe.follow()
    except ParallelConfigError as err:  # rank 0 says it, or names this rank when only this one has it
        started = runtime.requests > 0  # rank 0 has announced an image
        runtime.fail(err)
        return 1 if started else 2
    except BaseException as err:  # classify() decides; anything it does not know goes to run_job
        failure = _classify(err, started=runtime.requests > 0)
        if failure is None:
            raise
        return _fail_follower(failure, err, runtime)
    return 0


def _fail_follower(failure: Failure, err: BaseException, runtime: ParallelRuntime) -> int:
    runtime.fail(err)
    message = failure.message
    if not message.startswith("rank "):
        message = f"rank {runtime.topology.rank}: {message}"
    print(f"pixal3d-image-to-mesh: error: {message}", file=sys.stderr)
    return failure.exit_code
