"""Accelerator memory from torch's allocators: CUDA (with exact resettable peaks) and MPS.

torch is imported only when a CUDA or MPS device is metered, so the guard stays light."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class DeviceReader:
    """Reads one accelerator's memory; ``api`` (torch.cuda / torch.mps) is injectable for tests."""

    def __init__(self, device: Any, api: Any = None):
        self.kind = getattr(device, "type", str(device).split(":")[0])
        self.device = device
        if api is None and self.kind in ("cuda", "mps"):
            import torch

            api = torch.cuda if self.kind == "cuda" else torch.mps
        self.api = api if self.kind in ("cuda", "mps") else None

    def sample(self) -> dict[str, int]:
        """Current counters: CUDA allocated/reserved/free/total, MPS allocated/driver."""
        if self.api is None:
            return {}
        values: dict[str, int] = {}
        try:
            if self.kind == "cuda":
                values["device"] = int(self.api.memory_allocated(self.device))
                values["device_reserved"] = int(self.api.memory_reserved(self.device))
                free, total = self.api.mem_get_info(self.device)
                values["device_free"], values["device_total"] = int(free), int(total)
            else:
                values["device"] = int(self.api.current_allocated_memory())
                values["device_driver"] = int(self.api.driver_allocated_memory())
        except (RuntimeError, AttributeError) as error:
            logger.debug("cannot read %s memory: %s", self.kind, error)
        return values

    def peak_and_reset(self) -> int | None:
        """CUDA's exact peak allocation since the last reset, then reset; None elsewhere (MPS has
        no peak counter, so its peak is the sampled maximum)."""
        if self.kind != "cuda" or self.api is None:
            return None
        try:
            peak = int(self.api.max_memory_allocated(self.device))
            self.api.reset_peak_memory_stats(self.device)
        except (RuntimeError, AttributeError) as error:
            logger.debug("cannot read the CUDA peak: %s", error)
            return None
        return peak
