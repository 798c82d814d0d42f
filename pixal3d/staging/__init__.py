"""Stage-aware model memory for any pipeline: stages that declare their models, a runner, a registry that
loads lazily and releases per stage, RNG preservation, shared instances, and the memory policy.

Pipeline-agnostic: nothing here imports the rest of pixal3d. A pipeline author needs:

- ``Stage`` and ``StageRunner`` (``runner.py``): declare stages, enter and run one, get ``StageRecord``s;
- ``Executor`` (``executor.py``): every run's loop over items × stages, with a ``Store`` and ``Hook``s;
- ``Policy``, ``MemoryPlan``, ``detect_machine``, ``resolve_policy``, ``format_plan`` (``policy.py``):
  choose where idle models live from the plan and the machine;
- ``StagedModels`` (``registry.py``) when driving stages by hand; ``preserved_rng`` around code that
  may draw from the global generators;
- ``WeightStream`` / ``stream_model`` (``stream.py``): a model's blocks copied to the device one at a time (the
  ``stream`` policy), ``StreamLayout`` to plan it from a header;
- ``Event`` / ``EventLog`` to watch loads and releases; ``fingerprints`` to compare runs bit for bit.
"""
from .events import Event, EventLog, EventSink
from .executor import Executor, Hook, Item, Store
from .fingerprint import fingerprints
from .policy import (
    Machine,
    MemoryPlan,
    Placement,
    Policy,
    PolicyError,
    detect_machine,
    format_plan,
    placement,
    resolve_policy,
)
from .registry import OutsideStageError, StagedModels
from .release import ReleasedModuleError, release
from .rng import preserved_rng
from .runner import Stage, StageGraphError, StageRecord, StageRunner, check_stages
from .safetensors_header import (
    SafetensorsHeader,
    SafetensorsHeaderError,
    read_safetensors_header,
)
from .stream import StreamLayout, WeightStream, measure_copy_bandwidth, stream_model

__all__ = [
    "Event", "EventLog", "EventSink", "Executor", "Hook", "Item", "Machine", "MemoryPlan", "OutsideStageError",
    "Placement", "Policy", "PolicyError", "ReleasedModuleError", "SafetensorsHeader", "SafetensorsHeaderError",
    "Stage", "StageGraphError", "StageRecord", "StageRunner", "Store", "StagedModels", "StreamLayout",
    "WeightStream", "check_stages", "detect_machine", "fingerprints", "format_plan", "measure_copy_bandwidth",
    "placement", "preserved_rng", "read_safetensors_header", "release", "resolve_policy", "stream_model",
]
