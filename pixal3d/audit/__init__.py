"""Op audits that run on a CPU-only machine: which ATen ops a run sends to an accelerator, and
whether the Apple (MPS) backend has them. Pipeline-agnostic: nothing here imports the rest of pixal3d.
"""
from .dispatch_table import DispatchTable, Kernel, installed_table
from .mps import AuditRow, MpsAudit, MpsUnsupportedError, mps_audit
from .standin import (
    STANDIN,
    OpCall,
    StandInMode,
    StandInTensor,
    standin_mode,
    to_standin,
)

__all__ = [
    "STANDIN",
    "AuditRow",
    "DispatchTable",
    "Kernel",
    "MpsAudit",
    "MpsUnsupportedError",
    "OpCall",
    "StandInMode",
    "StandInTensor",
    "installed_table",
    "mps_audit",
    "standin_mode",
    "to_standin",
]
