"""Structured-latent flow: the sparse DiT over active voxels (shape 512/1024, texture 1024), conditioned
on the global image tokens and on pixel-aligned features gathered at the same voxels (Pixal3D ``proj``).

The texture model takes the shape latent as ``concat_cond`` (channels appended to the noisy latent).
Attention is full over each sample's tokens (variable length per sample, queries chunked where the
kernel would otherwise materialise all scores). ``ElasticSLatFlowModel`` is the same network (its
extra mixin only changes training memory), so both names build this class.
"""
from __future__ import annotations

import torch

from ..nn.rope import rope_phases
from ..nn.sparse_tensor import SparseTensor
from .flow_transformer import FlowTransformer
from .loading import register_model


@register_model("SLatFlowModel", "ElasticSLatFlowModel")
class SLatFlowModel(FlowTransformer):
    """``forward(x SparseTensor [N, in_channels - Cx] f32, t [B] f32 (1000·t), cond {'global': [B, S, Cc],
    'proj': SparseTensor [N, Cp] on x's coords}, concat_cond SparseTensor [N, Cx] | None) -> SparseTensor f32``."""

    def rope_phases(self, x: SparseTensor) -> torch.Tensor:
        """RoPE phases ``[N, head_dim/2]`` of x's voxels, cached on its coordinate set."""
        key = f"rope_phases:{self.head_dim}:{self.rope_freq}"
        return x.cached(key, lambda: rope_phases(x.coords[:, 1:], self.head_dim, rope_freq=self.rope_freq))

    def forward(self, x: SparseTensor, t: torch.Tensor, cond: dict, concat_cond: SparseTensor | None = None
                ) -> SparseTensor:
        feats = x.feats
        if concat_cond is not None:
            if concat_cond.feats.shape[0] != feats.shape[0]:
                raise ValueError(f"concat_cond has {concat_cond.feats.shape[0]} rows but x has {feats.shape[0]}; "
                                 f"both must live on the same coords")
            feats = torch.cat([feats, concat_cond.feats], dim=-1)
        if feats.shape[-1] != self.in_channels:
            raise ValueError(f"x (+ concat_cond) has {feats.shape[-1]} channels; this model takes {self.in_channels}"
                             + ("" if concat_cond is not None else " (did you forget concat_cond?)"))
        proj = cond["proj"]
        proj_feats = proj.feats if isinstance(proj, SparseTensor) else proj
        if proj_feats.shape != (feats.shape[0], self.proj_channels):
            raise ValueError(f"cond['proj'] must be [{feats.shape[0]}, {self.proj_channels}] (gathered at x's coords, "
                             f"same row order); got {tuple(proj_feats.shape)}")
        layout = x.layout
        if len(layout) != t.shape[0]:
            raise ValueError(f"t has {t.shape[0]} entries but x holds {len(layout)} samples")
        out = self._trunk(feats, t, cond["global"], proj_feats, self.rope_phases(x), layout)
        return x.replace(out)
