"""Multi-device flow sampling over torch.distributed (documented in full below once stable)."""
from .emulator import emulate_pipefusion
from .failure import LinkError, PeerFailedError
from .pipeline import parallel_sample
from .runtime import ParallelRuntime, init_parallel
from .settings import ParallelConfigError, ParallelSettings
from .shard import block_ranges, build_flow_shard, load_flow_shard, parameter_bytes

__all__ = ["LinkError", "ParallelConfigError", "ParallelRuntime", "ParallelSettings", "PeerFailedError",
           "block_ranges", "build_flow_shard", "emulate_pipefusion", "init_parallel", "load_flow_shard",
           "parallel_sample", "parameter_bytes"]
