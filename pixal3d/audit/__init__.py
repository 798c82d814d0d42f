"""Op audits that run on a CPU-only machine: which ATen ops a run sends to an accelerator, whether the
Apple (MPS) backend has them (``mps``), and whether their tensors at real sizes stay within the MPS
kernels' limits (``sizes``, ``limits``). Pipeline-agnostic: nothing here imports the rest of pixal3d.
"""
from .dispatch_table import DispatchTable, Kernel, installed_table
from .limits import MPS_LIMITS, Limit
from .mps import AuditRow, MpsAudit, MpsUnsupportedError, mps_audit
from .sizes import MpsLimitError, SizeAudit, SizeOracle, real_size_audit
from .standin import (
    STANDIN,
    OpCall,
    StandInMode,
    StandInTensor,
    standin_mode,
    to_standin,
)

__all__ = [
    "MPS_LIMITS",
    "STANDIN",
    "AuditRow",
    "DispatchTable",
    "Kernel",
    "Limit",
    "MpsAudit",
    "MpsLimitError",
    "MpsUnsupportedError",
    "OpCall",
    "SizeAudit",
    "SizeOracle",
    "StandInMode",
    "StandInTensor",
    "installed_table",
    "mps_audit",
    "real_size_audit",
    "standin_mode",
    "to_standin",
]
