"""The part the dense (sparse-structure) and sparse (structured-latent) flow transformers share:
constructor arguments, parameter layout and dtype placement, and the denoising trunk.

Trunk, for tokens ``h`` (fp32 in, fp32 out)::

    mod = adaLN_modulation(t_embedder(t))           # fp32, one [B, 6C] vector for every block, → dtype
    h   = input_layer(h).to(dtype)                  # fp32 layer
    h   = block(h, mod, global, proj, rope phases)  # × num_blocks, Linear weights in dtype
    out = out_layer(layer_norm(h.float()))          # non-affine LN (eps 1e-5) and output layer in fp32

Parameter names and shapes are those of the released checkpoints (``t_embedder.mlp.{0,2}``,
``adaLN_modulation.1``, ``input_layer``, ``blocks.N.*``, ``out_layer``); see
``reference/checkpoints.json``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.rope import DEFAULT_ROPE_FREQ
from ..nn.timestep import TimestepEmbedder
from ..nn.transformer import ModulatedTransformerCrossBlock

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` or ``torch.bfloat16`` → ``torch.bfloat16``; anything else is a clear error."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")


class FlowTransformer(nn.Module):
    """Base of ``SparseStructureFlowModel`` and ``SLatFlowModel`` (not registered itself)."""

    # Arguments the released json files carry that only matter for training: accepted and ignored.
    training_only_args = ("initialization", "use_checkpoint")
    # The ModuleLists whose children the stream policy copies to the device one at a time (pixal3d.staging.stream):
    # the 30 blocks, 97.5 % of the bytes; the embedders, adaLN and output layer stay.
    stream_lists = ("blocks",)
    stream_unit = r"blocks\.\d+\."  # a block's names in the checkpoint (for the plan, from its header)

    def __init__(self, resolution: int, in_channels: int, model_channels: int, cond_channels: int,
                 out_channels: int, num_blocks: int, num_heads: int | None = None, num_head_channels: int = 64,
                 mlp_ratio: float = 4.0, pe_mode: str = "rope",
                 rope_freq: tuple[float, float] = DEFAULT_ROPE_FREQ, dtype: str | torch.dtype = "float32",
                 share_mod: bool = True, qk_rms_norm: bool = False, qk_rms_norm_cross: bool = False,
                 image_attn_mode: str = "proj", proj_in_channels: int | None = None):
        super().__init__()
        if pe_mode != "rope":
            raise ValueError(f"pe_mode {pe_mode!r} is not supported; the Pixal3D flow models use 'rope'")
        if not share_mod:
            raise ValueError("share_mod=False is not supported; the Pixal3D flow models use one shared adaLN")
        if image_attn_mode != "proj":
            raise ValueError(f"image_attn_mode {image_attn_mode!r} is not supported; Pixal3D uses 'proj'")
        heads = num_heads or model_channels // num_head_channels
        if model_channels % heads or (model_channels // heads) // 2 < 3:
            raise ValueError(f"model_channels {model_channels} with {heads} heads gives no head dim usable by "
                             f"3-D RoPE (must divide evenly, head dim >= 6)")
        self.resolution = resolution
        self.in_channels, self.out_channels = in_channels, out_channels
        self.model_channels, self.cond_channels = model_channels, cond_channels
        self.proj_channels = proj_in_channels or cond_channels
        self.num_heads, self.head_dim = heads, model_channels // heads
        self.rope_freq = (float(rope_freq[0]), float(rope_freq[1]))
        self.dtype = resolve_dtype(dtype)

        fp32 = torch.float32
        self.t_embedder = TimestepEmbedder(model_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(model_channels, 6 * model_channels, dtype=fp32))
        self.input_layer = nn.Linear(in_channels, model_channels, dtype=fp32)
        self.blocks = nn.ModuleList(
            ModulatedTransformerCrossBlock(model_channels, cond_channels, self.proj_channels, heads, mlp_ratio,
                                           qk_rms_norm=qk_rms_norm, qk_rms_norm_cross=qk_rms_norm_cross,
                                           dtype=self.dtype)
            for _ in range(num_blocks))
        self.out_layer = nn.Linear(model_channels, out_channels, dtype=fp32)

    def modulation(self, t: torch.Tensor) -> torch.Tensor:
        """The shared adaLN vector of every block: ``t [B]`` (1000·t) → ``[B, 6C]`` in the block dtype."""
        return self.adaLN_modulation(self.t_embedder(t)).to(self.dtype)

    def embed(self, h: torch.Tensor) -> torch.Tensor:
        """Input tokens fp32 ``[.., Cin]`` → hidden ``[.., C]`` in the block dtype (fp32 input layer)."""
        return self.input_layer(h).to(self.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden ``[.., C]`` → output tokens fp32 ``[.., Cout]`` (non-affine LayerNorm, fp32 output layer)."""
        h = F.layer_norm(h.float(), h.shape[-1:])
        return self.out_layer(h)

    def _trunk(self, h: torch.Tensor, t: torch.Tensor, context: torch.Tensor, proj: torch.Tensor,
               phases: torch.Tensor, layout: list[slice] | None) -> torch.Tensor:
        """Tokens ``h`` fp32 (``[B, L, Cin]`` or packed ``[N, Cin]`` with ``layout``) → fp32 ``[.., Cout]``.

        Split into ``modulation``/``embed``/``head`` so that a pipeline (pixal3d.parallel) can run the same
        pieces on different ranks without a second copy of the maths."""
        mod = self.modulation(t)  # [B, 6C]
        h = self.embed(h)
        context, proj = context.to(self.dtype), proj.to(self.dtype)
        for block in self.blocks:
            h = block(h, mod, context, proj, phases, layout)
        return self.head(h)
