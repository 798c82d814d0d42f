"""A process's part in a job: the one value ``Pixal3D`` consults where parallelism could change what it does.

It is asked at five points, and nowhere else:

    plan      this rank's device, its stages and their state, the sizes the plan counts (a pipeline rank's shards)
              and its share of the machine, the lines the plan says about the job (``sized``)
    loaders   the models as this rank holds them (``loaders``: a pipeline rank's shards)
    hooks     the executor's hooks (``hooks``: rank 0's ``Leader``) and what a result reports (``report``)
    sampler   the runtime the flow stages sample with (``runtime``: ``RunState.parallel``)
    drive     how items reach the executor (``drive``: a data group's claims; ``follow``: a follower's
              announcements)

``Rank()``, one process alone, is the identity at every point: what a single run has always done. The parallel ranks are
``pipelines.parallel.PipelineRank`` (CFG / PipeFusion: rank 0 leads, the others follow) and
``pipelines.data_parallel.DataGroup`` (``--parallel data``: whole images, a share of them); ``pipelines.launch``
builds the one its process role needs, and ``pipelines.parallel.rank_of`` turns the library's ``parallel=``
argument into one. A planned rank (``RunPlan.role``) is joined once (``join``) when the pipeline is built; the
joined value carries the job's runtime and state until ``close``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from pixal3d.config import CascadeConfig
from pixal3d.pipeline_json import ResolvedWeights, planned_sizes
from pixal3d.staging import Machine, Stage
from pixal3d.staging.executor import Executor, Hook, Item

from .state import PROVIDED, RunState

Loader = Callable[[], nn.Module]


@dataclass(frozen=True)
class Sized:
    """What the plan's step 4 found for a rank: the rank (with what sizing decided: a pipeline split), its share of
    the machine, every model's bytes as this rank holds it, notes (models of unknown size, the job's layout) and
    reasons (the machine shared)."""

    rank: Rank
    machine: Machine
    sizes: dict[str, int]
    notes: list[str]
    reasons: list[str]


class Rank:
    """The base of every rank, and one process alone (``Rank()``): every point the identity."""

    follower = False   # this rank only joins rank 0's flow stages: ``Pixal3D.follow``, never ``run``
    number = 0         # its rank in the job's messages
    streams = True     # whole models may stream their blocks under this rank's plan (not a pipeline rank's shards)
    runtime: Any = None  # what the flow stages sample with (``RunState.parallel``); None: the plain sampler
    share: Any = None    # a data group's part of the job's images (``pipelines.data_parallel.DataJob``)
    speaks = True        # this process says what every rank would say alike (the plan, skipped inputs), holds the
                         # locks against other runs and writes the summary: rank 0 of the job
    shares_flows = False  # other ranks join this one's flow stages: its batches run image by image

    # -- the plan --------------------------------------------------------------------------------
    def place(self, device: Any) -> Any:
        """This rank's device, given the one asked for."""
        return device

    def stages(self, stages: Sequence[Stage]) -> tuple[Stage, ...]:
        """The stages this rank runs."""
        return tuple(stages)

    def state(self) -> tuple[tuple[str, ...], type]:
        """What this rank's runs provide before the first stage, and their state type."""
        return PROVIDED, RunState

    def sized(self, config: CascadeConfig, stages: Sequence[Stage], models: Sequence[str], machine: Machine) -> Sized:
        """The plan's step 4: every model's bytes from its header, the machine as this rank has it."""
        sizes, notes = planned_sizes(config.weights, models=list(models), config_file=config.source or None)
        return Sized(self, machine, sizes, notes, [])

    def check_weights(self, weights: ResolvedWeights, stages: Sequence[Stage]) -> None:
        """Refuse weights this rank cannot run (before any is read)."""

    # -- once the pipeline is built --------------------------------------------------------------
    def join(self) -> Rank:
        """This rank joined to its job (the pipeline keeps the value until ``close``)."""
        return self

    def loaders(self, loaders: Mapping[str, Loader], weights: ResolvedWeights,
                stages: Sequence[Stage]) -> dict[str, Loader]:
        """The models as this rank holds them."""
        return dict(loaders)

    def hooks(self, stages: Sequence[Stage]) -> list[Hook]:
        """The executor's hooks this rank adds."""
        return []

    def check_batch(self, order: str, work_dir: Any) -> None:
        """Refuse a batch this rank cannot run (``ValueError``)."""

    def drive(self, executor: Executor, items: Sequence[Item], order: str, work: Any) -> Iterator[Item]:
        """``items`` through ``executor`` in ``order`` (``work``: the batch's work directory, or None)."""
        return executor.drive(items, order)

    def report(self, item: Item, rows: Sequence[Any]) -> dict[str, Any] | None:
        """run.json's ``parallel`` entry for ``item`` (its meter's rows), or None."""
        return None

    @property
    def stopped(self) -> str | None:
        """Why this job can run no more images, or None while it can."""
        return None

    def follow(self, runner: Any, relay: Any) -> int:
        """A follower's loop over rank 0's images (``Pixal3D.follow``)."""
        raise RuntimeError("rank 0 leads the parallel job (or there is none): call run(image) for each image "
                           "and close() at the end; follow() is for the other ranks")

    def fail_and_close(self, err: BaseException) -> None:
        """A pipeline that could not be built once this rank joined its job: the other ranks stop too."""

    def abort(self, err: BaseException) -> None:
        """Stop the job because of ``err`` (the other ranks stop too)."""

    def close(self, release: Callable[[], None] = lambda: None) -> None:
        """The end of this rank's part of the job; ``release()`` lets the pipeline's models go (in the order the
        job needs: a leader tells its followers first)."""
        release()

    def describe(self) -> str:
        return "one process"
