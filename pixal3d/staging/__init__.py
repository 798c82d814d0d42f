"""Stage-aware model memory: lazy per-stage loading, release to meta, RNG preservation, sharing, policy.

Pipeline-agnostic: nothing here imports the rest of pixal3d.
"""
from .events import EVENT_KINDS, Event, EventLog, EventSink
from .offload import model_device, park, unpark
from .policy import (
    Machine,
    MemoryPlan,
    Policy,
    PolicyError,
    StagePlan,
    choose_policy,
    detect_machine,
    format_plan,
    model_sizes,
    registry_for,
    resolve_policy,
    safetensors_nbytes,
)
from .registry import OutsideStageError, StagedModels
from .release import ReleasedModuleError, ReleaseInfo, empty_device_cache, is_released, module_nbytes, release
from .rng import preserved_rng
from .share import SharedInstances, SharedLoader

__all__ = [
    "EVENT_KINDS",
    "Event",
    "EventLog",
    "EventSink",
    "Machine",
    "MemoryPlan",
    "OutsideStageError",
    "Policy",
    "PolicyError",
    "ReleaseInfo",
    "ReleasedModuleError",
    "SharedInstances",
    "SharedLoader",
    "StagePlan",
    "StagedModels",
    "choose_policy",
    "detect_machine",
    "empty_device_cache",
    "format_plan",
    "is_released",
    "model_device",
    "model_sizes",
    "module_nbytes",
    "park",
    "preserved_rng",
    "registry_for",
    "release",
    "resolve_policy",
    "safetensors_nbytes",
    "unpark",
]
