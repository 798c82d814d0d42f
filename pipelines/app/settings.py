"""What a visitor chooses for one job, and the cascade config it gives.

Seed and field of view are arguments of ``Pixal3D.run``; the texture size and the face budget are
``export`` settings, so they make a new config (and with it a new plan, since the export stage's working
set depends on them); the memory policy and the memory budget are the plan's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pixal3d.config import CascadeConfig, ConfigError, SettingError
from pixal3d.memory_budget import parse_budget
from pixal3d.staging import Policy

from ..state import check_fov, check_seed

TEXTURE_SIZES = (256, 512, 1024, 2048, 4096)
OR_AUTOMATIC = {"fov": ", or automatic", "memory_budget": ", or auto"}  # what the page offers besides a value


@dataclass(frozen=True)
class JobSettings:
    """One job's choices. ``fov`` None: automatic (the config's field of view, else MoGe-2); ``texture_size`` and
    ``face_budget`` None: the config's; ``memory_budget``: a size such as ``8G``, ``auto`` (the memory available
    now less the plan's headroom) or None (no budget), as ``Pixal3D.plan`` takes it."""

    seed: int = 42
    fov: float | None = None
    policy: str = "auto"
    texture_size: int | None = None
    face_budget: int | None = None
    memory_budget: str | None = None

    def __post_init__(self) -> None:
        try:  # the library's own checks of each (a SettingError naming it)
            check_seed(self.seed)
            check_fov(self.fov)
            if self.memory_budget not in (None, "auto"):
                parse_budget(self.memory_budget)
        except SettingError as err:
            raise ConfigError(f"{err}{OR_AUTOMATIC.get(err.setting, '')}") from None
        if self.policy not in {p.value for p in Policy}:
            raise ConfigError(f"memory policy {self.policy!r} is not one of {[p.value for p in Policy]}")


def job_config(config: CascadeConfig, settings: JobSettings) -> CascadeConfig:
    """``config`` with the job's export settings (texture size, face budget); the rest unchanged."""
    changes = {}
    if settings.texture_size is not None:
        changes["texture_size"] = settings.texture_size
    if settings.face_budget is not None:
        changes["decimation_target"] = settings.face_budget
    if not changes:
        return config
    try:
        export = dataclasses.replace(config.export, **changes)
    except (TypeError, ValueError) as err:  # ExportSettings checks its own ranges
        raise ConfigError(f"export settings: {err}") from None
    return config.with_overrides(export=export)
