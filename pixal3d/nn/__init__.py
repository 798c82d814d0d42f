"""Building blocks: sparse tensors, attention, RoPE, norms, sparse convolution."""
from .sparse_tensor import SparseTensor

__all__ = ["SparseTensor"]
