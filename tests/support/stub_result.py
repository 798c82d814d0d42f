"""A ``Result`` without running the cascade, for tests of what happens around a run (writing, locking,
signals, errors): the command's write path sees a real ``Result`` whose GLB is a few known bytes.

``patch_run(glb=...)`` replaces ``Pixal3D.run_batch`` (the command's one way to run) so that the command
plans, resolves the (tiny) weights and writes exactly as it does after a real run, in a fraction of a second. Usable from a subprocess:
``python -c "from tests.support.stub_result import patch_run; patch_run(); ..."``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pipelines import BatchItem, Pixal3D, Result
from pipelines.state import RunState
from pixal3d.mesh.export import ExportedMesh, ExportReport
from pixal3d.staging import Policy

STUB_GLB = b"glTF" + bytes(range(256)) * 64  # 16 KiB + 4: a stand-in for the GLB bytes


def stub_result(config: Any, *, input: str = "<image>", seed: int = 42, glb: bytes = STUB_GLB) -> Result:
    """A ``Result`` whose mesh holds ``glb`` (no tensors, no stages)."""
    state = RunState(input_image=None, generator=torch.Generator().manual_seed(seed), device=torch.device("cpu"),
                     shape_normalization=None, tex_normalization=None)
    state.mesh = ExportedMesh(mesh=None, glb=glb, report=ExportReport(steps=[], file_bytes=len(glb)))
    state.ss_latent = torch.zeros(1, 8, 16, 16, 16)  # 128 KiB when saved with --keep-latents
    return Result(input=input, seed=seed, config=config, device=torch.device("cpu"), policy=Policy.staged,
                  policy_reasons=("stub",), state=state, stages=[], memory=[])


def stub_run(*, glb: bytes = STUB_GLB, before: Callable[[Pixal3D, Any], None] | None = None
             ) -> Callable[..., Iterator[BatchItem]]:
    """A replacement for ``Pixal3D.run_batch`` yielding one ``stub_result`` per image (``before(self, image)`` is
    called first)."""

    def run_batch(self: Pixal3D, images: Sequence[Any], *, seed: int | Sequence[int] | None = None,
                  names: Sequence[str] | None = None, **_: Any) -> Iterator[BatchItem]:
        seeds = list(seed) if isinstance(seed, Sequence) else [self.config.seed if seed is None else seed] * len(images)
        for index, image in enumerate(images):
            if before is not None:
                before(self, image)
            name = names[index] if names is not None else f"image{index}"
            yield BatchItem(index, name, image, str(image), seed=seeds[index],
                            result=stub_result(self.config, input=str(image), seed=seeds[index], glb=glb))

    return run_batch


def patch_run(**options: Any) -> None:
    """Replace ``Pixal3D.run_batch`` for the rest of the process (subprocess tests; in-process use monkeypatch)."""
    Pixal3D.run_batch = stub_run(**options)
