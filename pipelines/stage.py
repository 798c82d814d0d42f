"""CascadeStage: a ``pixal3d.staging.Stage`` of the Pixal3D cascade, built from its config section.

Each stage declares, on its class: ``name``; ``section``, the ``CascadeConfig`` field it is built from;
``needs``, the registry model names it may ask for; ``inputs`` and ``outputs``, the ``RunState`` fields
it reads and writes (``transient``: written, fingerprinted, then cleared); and ``working_set()``, its
estimated memory beyond its models' weights (``working_set.py``). A stage that samples a flow model
(``flow_stage.sample``) names it in ``flow_model``: under torchrun the other ranks load their shard of
it and join the sampling (``parallel.py``). It reads and writes ``RunState`` fields
only, gets models only from the ``models`` mapping it is handed, and never moves weights between
devices: loading, releasing and parking are the registry's job.
"""
from __future__ import annotations

from typing import Any, Self

from pixal3d.config import CascadeConfig
from pixal3d.staging import Stage


class CascadeStage(Stage):
    """Base class of the cascade's stages: set the declarations, implement ``from_config``, ``run`` and
    ``working_set``."""

    section: str | None = None
    flow_model: str | None = None  # the registry name of the flow model it samples, if any

    @classmethod
    def from_config(cls, config: CascadeConfig) -> Self:
        """The stage as ``config`` describes it (its ``section``, and any sizes it shares with others)."""
        raise NotImplementedError(f"{cls.__name__} must implement from_config(config)")

    def check_input(self, image: Any) -> None:
        """Raise ``ImageError`` if this stage cannot take ``image`` (a path, PIL image or array), before any
        weight is read. Most stages accept anything an earlier stage produces: the default does nothing."""
