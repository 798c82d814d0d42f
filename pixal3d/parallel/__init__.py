"""Multi-device flow sampling over ``torch.distributed``: CFG-parallel (exact) and PipeFusion (approximate).

Two techniques for the four flow transformers, applied from outside the unchanged models:

* **CFG-parallel** (``mode="cfg"``, 2 ranks): the positive and the negative pass of every guided step
  run at once on two device groups; the negative group sends its velocity to the owner rank, which
  mixes. Bitwise the single-process result.
* **PipeFusion** (``mode="pipefusion"``, N ranks; arXiv 2405.14430): pipeline rank k holds a contiguous
  range of each flow's blocks (``load_flow_shard``: ≈ 1/N of the weights), the token sequence streams
  through the ring in M contiguous patches, and a patch attends to the fresh K/V of the patches already
  recomputed in this step and to the previous step's K/V for the rest. The first W steps run
  synchronously over the whole sequence (exact). Approximate for W < steps and M > 1; exact otherwise.
  The result depends on (M, W) only, never on N: ``emulate_pipefusion`` computes it in one process.
* ``mode="both"``: 2 × N ranks, one PipeFusion ring per CFG branch.

Wiring (the cascade does this in ``pipelines/parallel.py``, the process roles in ``pipelines/launch.py``)::

    settings = ParallelSettings(mode="pipefusion", pp=2, patches=4, warmup=1)  # from the CLI / config
    runtime = init_parallel(settings, device=device)   # once per process under torchrun; raises
                                                       # ParallelConfigError (same text on every rank)
    topo = runtime.topology                            # .rank, .stage, .pp_degree, .cfg_index, .is_owner
    loader = functools.partial(load_flow_shard, stem, topo.stage, topo.pp_degree, device=device)
    shard = loader()                                   # an nn.Module: the registry loads/releases it
    latent = parallel_sample(shard, noise, cond=cond, neg_cond=neg_cond, concat_cond=concat_cond,
                             sampler=stage_config.sampler, runtime=runtime)

Contract of ``parallel_sample``:

* every rank calls it once per flow stage, in the same order, with its own shard of that stage's
  model; only rank 0's ``noise``/``cond``/``neg_cond``/``concat_cond`` are read (they, and the sparse
  coords, are broadcast: other ranks pass None), and every rank returns the final latent (on its
  device). So ranks ≠ 0 run a loop over the flow stages: load shard → ``parallel_sample(shard, None,
  cond=None, neg_cond=None, ...)`` → release; the other stages (preprocess, camera, decoders, export)
  run on rank 0 alone. Every rank must use the same config (checked: a mismatch is a
  ``ParallelConfigError`` naming both).
* ``runtime=None`` (``--parallel none``) is today's code path exactly: ``sample_flow_euler``.
* Per request, nothing persists: K/V buffers live in the request's state; a new request starts empty.
* ``runtime.last_stats``: bytes and messages this rank sent, its K/V buffer bytes, tokens, steps.
* Failure: if any rank raises, every rank raises within seconds, the failing rank its own error
  (with a note naming its rank) and the others ``PeerFailedError("rank r stopped: rank k failed:
  <Type>: <message>")``; a rank that dies is named by the first peer that loses it; a rank that hangs
  is reported after ``settings.timeout_s``. A rank that fails *between* flow stages calls
  ``runtime.fail(err)``: posted where the others wait next, so they stop the same way. The command
  prints a settings error once (rank 0) and every other error on the rank that has it; every rank
  exits non-zero.
* Between flow stages the ranks talk through ``session``: rank 0 announces each image (and the end),
  every rank reports its peak memory per image (``exchange``).

Launch: ``torchrun --nproc-per-node 2 ...`` on one machine (NCCL on CUDA, gloo on CPU/MPS);
``torchrun --nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT --nproc-per-node 1 ...``
on two machines (gloo over Ethernet or a Thunderbolt bridge).

Modules, one technique each: ``settings`` (what the user asks, validated), ``topology`` (ranks from
torchrun's environment), ``runtime`` (process groups), ``shard`` (layer sharding), ``sequence`` (token
order, patches, slices of positions and conditions), ``schedule`` (the per-step plan), ``stale_kv``
(PipeFusion attention), ``stepper`` (the sampler's update per piece / whole latent), ``comm``
(point-to-point links, broadcasts), ``failure`` (every rank stops, naming the failed one),
``pipeline`` (``parallel_sample``), ``session`` (the job's messages between flow stages),
``emulator`` (the single-process oracle).
"""
from .emulator import emulate_pipefusion
from .failure import LinkError, PeerFailedError
from .pipeline import parallel_sample
from .runtime import ParallelRuntime, init_parallel
from .settings import ParallelConfigError, ParallelSettings
from .shard import block_ranges, build_flow_shard, load_flow_shard, parameter_bytes

__all__ = ["LinkError", "ParallelConfigError", "ParallelRuntime", "ParallelSettings", "PeerFailedError",
           "block_ranges", "build_flow_shard", "emulate_pipefusion", "init_parallel", "load_flow_shard",
           "parallel_sample", "parameter_bytes"]
