"""Building blocks: sparse tensors, attention, RoPE, norms, sparse convolution."""
from .sparse_tensor import SparseTensor

__all__ = ["SparseTensor"]
from .sparse_conv import SparseConv3d, build_neighbor_map, neighbor_map, sparse_conv3d
from .sparse_ops import SparseLinear, channel_to_space, space_to_channel, subdivide
__all__ += ["SparseConv3d", "build_neighbor_map", "neighbor_map", "sparse_conv3d",
            "SparseLinear", "channel_to_space", "space_to_channel", "subdivide"]
from .attention import MultiHeadCrossAttention, MultiHeadSelfAttention, packed_attention
from .rope import apply_rope, grid_positions, rope_phases
from .timestep import TimestepEmbedder
from .transformer import ModulatedTransformerCrossBlock
__all__ += ["MultiHeadCrossAttention", "MultiHeadSelfAttention", "packed_attention",
            "apply_rope", "grid_positions", "rope_phases", "TimestepEmbedder", "ModulatedTransformerCrossBlock"]
