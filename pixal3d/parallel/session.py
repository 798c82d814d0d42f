"""The job's messages besides flow sampling: rank 0 leads, every other rank follows.

Under torchrun rank 0 runs a whole pipeline; the other ranks only take part in its flow stages
(``parallel_sample``). Between those, the followers need to know what comes next, and rank 0 needs
to hear from them once per image. Three messages, each one request of the job (``runtime.request``:
the same order on every rank, a failure on any rank stops every rank):

* ``announce(runtime, command)`` on rank 0 / ``receive(runtime)`` on the others: a small picklable
  command, e.g. ``{"kind": "image", "stages": [...]}`` before an image and ``{"kind": "end"}`` when
  rank 0 closes its pipeline;
* ``exchange(runtime, report)`` on every rank: each rank's report (its per-stage peak memory) on every
  rank, so rank 0 can write them all to its record.

A failure between requests (a bad image on rank 0, a shard that does not load on a follower) is
``runtime.fail(err)``: posted where the other ranks wait next, so none of them waits forever.
"""
from __future__ import annotations

from typing import Any

from .comm import Wire, broadcast_object
from .runtime import ParallelRuntime


def announce(runtime: ParallelRuntime, command: dict[str, Any]) -> None:
    """Rank 0: send ``command`` to every other rank."""
    if runtime.topology.rank != 0:
        raise RuntimeError(f"rank {runtime.topology.rank} cannot announce: only rank 0 leads the job")
    runtime.request(lambda wire: broadcast_object(command, 0, wire, f"rank 0's {command.get('kind')!r} command"))


def receive(runtime: ParallelRuntime) -> dict[str, Any]:
    """Ranks ≠ 0: wait for rank 0's next command (bounded by the job's timeout, like every wait)."""
    return runtime.request(lambda wire: broadcast_object(None, 0, wire, "rank 0's next command"))


def exchange(runtime: ParallelRuntime, report: Any) -> list[Any]:
    """Every rank: ``report`` of each rank, in rank order (small, picklable)."""
    def body(wire: Wire) -> list[Any]:
        me = runtime.topology.rank
        return [broadcast_object(report if src == me else None, src, wire, f"rank {src}'s report")
                for src in range(runtime.topology.world_size)]
    return runtime.request(body)
