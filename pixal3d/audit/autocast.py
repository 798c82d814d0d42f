"""Float16 autocast where a device has none (the stand-in ``meta:1``, plain ``meta``), for the audits.

MoGe-2 runs under float16 autocast on mps (``camera.moge_precision: auto``), so its convolutions and matrix
products take float16 there. torch has no autocast for ``meta``: under ``standin_autocast()`` those ops get
autocast's casts instead, so the audits see the dtypes a Mac run gives them. It covers the ops MoGe-2 calls
(torch's CUDA/MPS autocast lists: convolutions, linears, matrix products and attention to float16; norms,
softmax and normalize to float32); every other op takes its inputs as they come, as under autocast.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

HALF_OPS = frozenset({F.conv2d, F.conv_transpose2d, F.linear, torch.matmul, torch.Tensor.__matmul__, torch.bmm,
                      torch.addmm, torch.baddbmm, F.scaled_dot_product_attention})
FLOAT_OPS = frozenset({F.layer_norm, F.group_norm, F.softmax, torch.softmax, torch.Tensor.softmax, F.normalize})


class StandInAutocast(TorchFunctionMode):
    """Casts the floating inputs of ``HALF_OPS`` to float16 and of ``FLOAT_OPS`` to float32."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        dtype = torch.float16 if func in HALF_OPS else torch.float32 if func in FLOAT_OPS else None
        if dtype is not None:
            def cast(x: Any) -> Any:
                return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            args, kwargs = tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def standin_autocast() -> StandInAutocast:
    """The mode, as a context manager: ``with standin_autocast(): model(x)``."""
    return StandInAutocast()


def under_autocast(model: nn.Module) -> nn.Module:
    """``model`` (changed in place) whose ``forward`` runs under ``standin_autocast()``: MoGe-2's ``infer`` calls its
    forward where it would enter float16 autocast."""
    forward = model.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with standin_autocast():
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    return model
