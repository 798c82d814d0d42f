"""What the four flow stages share: drawing noise from the run's generator, conditioning, sampling.

Conditioning starts from ``state.features``, DINOv3's tokens the features stage computed and kept
(``features.py``): a flow stage runs NAF and the projection from them, so it needs only NAF and its flow model.

Noise is drawn with ``torch.randn`` from the run's CPU generator (``RunState.generator``, seeded once), then
moved to the run's device, at exactly the reference's four points (structure, shape 512, shape 1024,
texture; reference §7.1): the reference seeds the global CPU generator and draws from it, and a CPU
``torch.Generator`` seeded the same gives the same bits, on every device. Nothing else draws from it.

A flow stage is conditioned on one image (``image`` and ``camera``: the single-view cascade) or on several posed
views (``views``: ``on_views`` makes a stage of the multi-view cascade read them instead); ``stage_condition``
asks ``conditioning.condition`` or ``multiview.condition_views`` accordingly, nothing else differs.

Sampling goes through ``sample``: today's single-process sampler, or, when the run has a parallel
runtime (``RunState.parallel``, rank 0 under torchrun), ``pixal3d.parallel.parallel_sample`` with the
same inputs, which the other ranks join (``pipelines/parallel.py``).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from tqdm.auto import tqdm

from pixal3d.config import CascadeConfig, ConditionConfig, SamplerConfig, ShapeConfig
from pixal3d.memory_budget import (
    ATTENTION_SCORE_COPIES,
    FlowChunks,
    attention_score_elements,
    naf_chunk_elements,
    plan_flow_stage,
)
from pixal3d.models.conditioning import (
    ExtractorConfig,
    condition,
    naf_peak_bytes,
    negative_condition,
    select_naf_mode,
)
from pixal3d.models.multiview import condition_views
from pixal3d.nn.limits import kernel_limits
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.parallel import parallel_sample
from pixal3d.pipeline_json import Normalization
from pixal3d.samplers import sample_flow_euler

from .stage import CascadeStage, StageBudget
from .state import RunState
from .working_set import attention_route_bytes, flow_stage_bytes, hr_tokens

DEFAULT_CHUNKS = FlowChunks(attention_scores=attention_score_elements(math.inf),
                            naf_elements=naf_chunk_elements(math.inf))
"""The chunk sizes the flow stages use when memory is not short."""

CONDITION_INPUTS = ("features", "camera", "device", "generator", "progress", "callback", "parallel")
"""The ``RunState`` fields every flow stage reads besides its own."""
IMAGE_SOURCE = ("image", "camera")
VIEWS_SOURCE = ("views",)
"""What the features and flow stages read besides the features: one image and its camera, or posed views."""


def on_views(stage: CascadeStage, plan_views: int) -> CascadeStage:
    """A copy of ``stage`` (the features stage or a flow stage) reading posed views (``RunState.views``) instead of
    the image and its camera; ``plan_views``: the number of views its working set counts."""
    stage = copy.copy(stage)
    stage.inputs = (*VIEWS_SOURCE, *(f for f in stage.inputs if f not in IMAGE_SOURCE))
    stage.view_count = plan_views
    return stage


def draw_noise(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """``torch.randn(*shape)`` from the run's CPU generator (float32, on the CPU)."""
    return torch.randn(*shape, generator=generator)


def extractor(name: str, cfg: ConditionConfig, grid_resolution: int) -> ExtractorConfig:
    """The projection extractor of a stage (``grid_resolution`` when the config leaves it open)."""
    return ExtractorConfig(name, image_size=cfg.image_size, grid_resolution=cfg.grid_resolution or grid_resolution,
                           naf_size=cfg.naf_size)


def stage_condition(state: RunState, models: Any, ext: ExtractorConfig,
                    coords: torch.Tensor | None, *, naf_mode: str = "full", views: bool = False) -> dict[str, Any]:
    """``{'global', 'proj'}`` for one extractor from the run's DINOv3 features (``state.features``), kept in
    ``state.cond`` (transient: fingerprinted, cleared). ``naf_mode``: ``full`` (the reference's values) or
    ``frugal`` (less memory); ``auto`` means ``full`` here — the plan resolves it from the memory it gives the
    stage (``SparseFlowStage.fitted``). ``views``: the features are posed views' (``state.views``: every view
    projected, then averaged), not one image's seen by ``state.camera``."""
    naf = models["naf"] if ext.naf_size is not None else None
    mode = "full" if naf_mode == "auto" else naf_mode
    features = state.features.at(ext.image_size)
    if views:
        cond = condition_views(ext, features, state.views, coords, naf=naf, naf_mode=mode)
    else:
        cond = condition(ext, features, state.camera, coords, naf=naf, naf_mode=mode)
    state.cond = dict(cond)
    return cond


def sample(model: Callable[..., Any], noise: Any, cond: dict[str, Any], sampler: SamplerConfig, *,
           state: RunState, stage: str, concat_cond: SparseTensor | None = None) -> Any:
    """Run the flow-Euler sampler with the stage's parameters; the negative condition is zeros;
    ``concat_cond`` (texture: the shape latent) is passed to every model call. Each step is reported to
    ``state.callback`` as ``{"kind": "step", "stage", "step", "steps"}`` (from 1). With
    ``state.parallel`` set, every rank of the job samples together (``parallel_sample``; ``model`` is
    this rank's shard) and the result is the same latent (bit for bit under CFG-parallel)."""
    report = None
    if state.callback is not None:
        def report(info: dict[str, Any]) -> None:
            state.callback({"kind": "step", "stage": stage, "step": info["step"] + 1, "steps": sampler.steps})
    if state.parallel is not None:  # rank 0 (the one that prints) shows the steps as the sampler does
        with tqdm(total=sampler.steps, desc="flow sampling", disable=not state.progress) as bar:
            def step(info: dict[str, Any]) -> None:
                bar.update(1)
                if report is not None:
                    report(info)
            return parallel_sample(model, noise, cond=cond, neg_cond=negative_condition(cond),
                                   concat_cond=concat_cond, sampler=sampler, runtime=state.parallel, callback=step)
    if sampler.guidance_interval is None or sampler.sigma_min is None:
        raise ValueError(f"stage {stage}: the sampler's guidance_interval / sigma_min are unresolved; "
                         f"Pixal3D.plan fills them from pipeline.json (pixal3d.pipeline_json.resolve_samplers)")
    params = asdict(sampler)
    params["guidance_interval"] = tuple(params["guidance_interval"])
    flow = model if concat_cond is None else functools.partial(model, concat_cond=concat_cond)
    return sample_flow_euler(flow, noise, cond=cond, neg_cond=negative_condition(cond), progress=state.progress,
                             callback=report, **params)


def norm_tensors(norm: Normalization, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean [1, C], std [1, C])`` float32 on ``device``."""
    mean = torch.tensor(norm.mean, dtype=torch.float32, device=device)[None]
    std = torch.tensor(norm.std, dtype=torch.float32, device=device)[None]
    return mean, std


class SparseFlowStage(CascadeStage):
    """What the three sparse flow stages (shape 512, shape 1024, texture) share: NAF conditioning in the
    mode the plan resolves, chunk sizes within an explicit memory budget, the working-set estimate.

    ``naf_mode`` starts as the config's (``auto``, ``full`` or ``frugal``); ``fitted`` resolves ``auto`` to
    ``full`` (the reference's values, bit for bit; 1.66 GiB planned at 1024 px) when its peak fits the memory the
    stage is given, else ``frugal`` (~1e-7 from the reference; on the real cascade only below a 2.30 GiB budget)."""

    config: ShapeConfig
    draws = "generator"
    naf_mode: str = "auto"
    attention_route: str = "sdpa"  # the resolved attention route (the plan sets it for the run's device)
    chunks: FlowChunks | None = None
    bounded_bytes: int | None = None  # the working set an explicit budget bounds it to (chunks shrunk)

    def estimated_tokens(self) -> int:
        """The stage's typical token count, from the config (for the plan)."""
        raise NotImplementedError

    def working_set(self) -> int:
        if self.bounded_bytes is not None:
            return self.bounded_bytes
        cond = self.config.condition
        return flow_stage_bytes(self.estimated_tokens(), cond.image_size, naf_size=cond.naf_size,
                                naf_mode=self.naf_mode, views=self.view_count or 1) + self.attention_bytes()

    def attention_bytes(self) -> int:
        """What the attention route adds to the measured working set (its fp32 chunks on ``fp32_chunked``)."""
        scores = (self.chunks or DEFAULT_CHUNKS).attention_scores
        return attention_route_bytes(self.attention_route, self.estimated_tokens(), scores)

    def fitted(self, budget: StageBudget) -> SparseFlowStage:
        cond, tokens = self.config.condition, self.estimated_tokens()
        stage = copy.copy(self)
        free = budget.work_bytes
        if cond.naf_size is not None:
            full = naf_peak_bytes("full", cond.image_size, cond.naf_size, points=tokens)
            stage.naf_mode = select_naf_mode(self.naf_mode, budget_bytes=free, full_bytes=full)
        if budget.explicit:  # the route's fp32 copies are held beside the weights (the plan reserves the scores)
            held = max(0, stage.attention_bytes() - ATTENTION_SCORE_COPIES * 2 * DEFAULT_CHUNKS.attention_scores)
            chunks = plan_flow_stage(self.name, budget.total_bytes, weight_bytes=budget.weight_bytes + held,
                                     tokens=tokens, naf=cond.naf_size is not None)
            if chunks != DEFAULT_CHUNKS:  # smaller chunks keep the stage within the budget
                stage.chunks, stage.bounded_bytes = chunks, min(stage.working_set(), free)
        return stage

    def choices(self) -> dict[str, Any]:
        out: dict[str, Any] = {"naf_mode": self.naf_mode} if self.config.condition.naf_size is not None else {}
        if self.chunks is not None:
            out["chunks"] = {"attention_scores": self.chunks.attention_scores,
                             "naf_elements": self.chunks.naf_elements}
        return out

    def bounded(self) -> contextlib.AbstractContextManager[None]:
        """The chunk sizes the budget chose, for the stage's run (nothing changes without a budget): the kernels
        of this thread see them (``pixal3d.nn.limits``), another pipeline's stage running meanwhile does not."""
        if self.chunks is None:
            return contextlib.nullcontext()
        return kernel_limits(attention_scores=self.chunks.attention_scores, naf_elements=self.chunks.naf_elements)


class HrFlowStage(SparseFlowStage):
    """A flow stage on the HR tokens (shape 1024, texture): its config section, the cascade's upsampling
    factor and configured decode resolution (a run may step it down: the token budget)."""

    def __init__(self, config: ShapeConfig, upsample_times: int, hr_resolution: int):
        self.config = config
        self.upsample_times = upsample_times
        self.hr_resolution = hr_resolution
        self.naf_mode = config.condition.naf_mode

    @classmethod
    def from_config(cls, config: CascadeConfig) -> HrFlowStage:
        return cls(getattr(config, cls.section), config.upsample.times, config.upsample.hr_resolution)

    def estimated_tokens(self) -> int:
        return hr_tokens(self.hr_resolution)

    def grid(self, state: RunState) -> int:
        """The projection grid of this run: its decode resolution over the upsampling factor."""
        return state.hr_resolution // 2 ** self.upsample_times
