"""The models whose weights come from a source of their own, as one table: DINOv3, NAF, MoGe-2.

Pixal3D's own checkpoints come from ``weights.pixal3d`` through the pipeline file (``pipeline_json``); every other
model has a key of its own under ``weights:`` in a config (a ``WeightSource``: repo, local, url or generate) and a
row here saying what that source must hold, where its tensors are, and how the memory plan sizes it. Locating,
checking, sizing, digesting (``pipelines/work_dir.py``) and loading (``pipelines/loaders.py``: each row's ``load``) go
over this table, so a new model of this kind is a field in ``WeightsConfig`` and a row here, not a branch in each.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pixal3d.config import WeightsConfig, WeightSource
from pixal3d.hub import Fetcher, cache_root
from pixal3d.models.moge import (
    MOGE_FILE,
    RELEASED_REPO,
    checkpoint_bytes,
    checkpoint_tensor_bytes,
    released_tensor_bytes,
)


@dataclass(frozen=True)
class ModelSource:
    """One model with a source of its own.

    name:      the registry name, and the key under ``weights:`` (``WeightsConfig``'s field)
    files:     what a folder source holds by default (a source's own ``files:`` replace them); ``()``: the source is
               one file (a URL's download, a local file, the generated file)
    tensors:   the file in that folder the weights are read from; for a one-file source, the file itself
    on_demand: located only when a run asks for it (MoGe-2: only without a field of view), and then an error when
               the config names no source: ``absent`` is that error's text
    sized_late: the plan reads its size only once every file is known to be there (a Hub listing: one request
               more, never made when the error about missing files comes first)
    load:      ``load(path, device)``: the network, given what ``locate`` returned (the folder, or the one file)
    load_streamed: ``load_streamed(path, stream, pin)``: the network with its blocks streamed through a
               ``WeightStream`` (the ``stream`` policy); None: it loads whole only
    """

    name: str
    load: Callable[[Path, Any], Any]
    files: tuple[str, ...] = ()
    tensors: str | None = None
    on_demand: bool = False
    absent: str = ""
    sized_late: bool = False
    load_streamed: Callable[[Path, Any, bool], Any] | None = None

    @property
    def label(self) -> str:
        return f"weights.{self.name}"

    def source(self, weights: WeightsConfig) -> WeightSource | None:
        return getattr(weights, self.name)

    def locate(self, fetch: Fetcher, source: WeightSource) -> Path | None:
        """The folder (or the one file) on disk, fetched unless offline; what is missing is recorded in ``fetch``."""
        if not self.files:
            return fetch.file(source, label=self.label)
        return fetch.folder(source, list(source.files) or list(self.files), label=self.label)

    def tensor_file(self, path: Path) -> Path:
        """The file the weights are read from, given what ``locate`` returned."""
        return path / self.tensors if self.files and self.tensors else path

    def safetensors(self, path: Path) -> Path | None:
        """The safetensors file to verify and to plan from its header, or None (another format)."""
        tensors = self.tensor_file(path)
        return tensors if tensors.suffix == ".safetensors" else None

    def planned_bytes(self, fetch: Fetcher, source: WeightSource, notes: list[str]) -> int:
        """Its bytes for the memory plan without downloading it: the header (on disk or the Hub's) of a
        safetensors file, a ``.pt``'s tensor index or the Hub's listing, a one-file source's size on disk."""
        if not self.files:
            if source.url is not None:  # a URL's file: its size once downloaded, else unknown
                target = cache_root() / "downloads" / str(source.filename)
                if not target.is_file():
                    notes.append(f"{self.name}: not downloaded yet, size unknown (about 3 MB)")
                return target.stat().st_size if target.is_file() else 0
            path = fetch.file(source, label=self.label)
            return path.stat().st_size if path is not None else 0
        tensors = str(self.tensors)
        path = fetch.cached_file(source, tensors, label=self.label)
        if tensors.endswith(".safetensors"):  # on disk: its header; else the Hub's header (nothing downloaded)
            folder = None if path is None else path.parents[tensors.count("/")]  # tensors may lie in a subfolder
            return fetch.planned_bytes(source, folder, tensors, label=self.label)
        return checkpoint_bytes(path) if path is not None else fetch.repo_file_size(source, tensors, notes=notes)


    def planned_tensors(self, fetch: Fetcher, source: WeightSource, notes: list[str]) -> dict[str, int] | None:
        """Each tensor's bytes (name -> bytes) for the ``stream`` policy's plan, nothing downloaded: a safetensors
        header (on disk or the Hub's), a ``.pt``'s index on disk, or for MoGe-2's release not downloaded yet its
        blocks at the released config and the rest of its listed size; None when none of these is known."""
        tensors = str(self.tensors)
        path = fetch.cached_file(source, tensors, label=self.label)
        if tensors.endswith(".safetensors"):
            return fetch.planned_tensors(source, None if path is None else path.parent, tensors, label=self.label)
        if path is not None:
            return checkpoint_tensor_bytes(path)
        if self.name == "moge" and source.repo == RELEASED_REPO:
            listed = fetch.repo_file_size(source, tensors, notes=notes)
            return released_tensor_bytes(listed) if listed else None
        return None


def load_dinov3_folder(folder: Path, device: Any) -> Any:
    from pixal3d.models.dinov3 import load_dinov3

    return load_dinov3(folder, device)


def load_naf_weights(path: Path, device: Any) -> Any:
    """NAF from the release ``.pth`` (published defaults) or from a ``<stem>.json`` + safetensors pair."""
    from pixal3d.models.loading import load_model
    from pixal3d.models.naf import load_naf

    if path.with_suffix(".json").is_file() and path.suffix == ".safetensors":
        return load_model(path.with_suffix(""), device=device)
    return load_naf(path, device=device)


SHAPE_ENCODER_STEM = "ckpts/shape_enc_next_dc_f16c32_fp16"
"""TRELLIS.2's shape encoder in ``microsoft/TRELLIS.2-4B`` (its ``texturing_pipeline.json``'s ``shape_slat_encoder``)."""


def load_shape_encoder_folder(folder: Path, device: Any) -> Any:
    from pixal3d.models.loading import load_model

    return load_model(folder / SHAPE_ENCODER_STEM, device=device)


def load_dinov3_streamed(folder: Path, stream: Any, pin: bool) -> Any:
    from pixal3d.models.dinov3 import load_dinov3_streamed as load

    return load(folder, stream, pin=pin)


def load_moge_folder(folder: Path, device: Any) -> Any:
    from pixal3d.models.moge import load_moge

    return load_moge(folder / MOGE_FILE, device)


def load_moge_streamed(folder: Path, stream: Any, pin: bool) -> Any:
    from pixal3d.models.moge import load_moge_streamed as load

    return load(folder / MOGE_FILE, stream, pin=pin)


MODEL_SOURCES: tuple[ModelSource, ...] = (
    ModelSource("dinov3", load_dinov3_folder, files=("config.json", "model.safetensors"), tensors="model.safetensors",
                load_streamed=load_dinov3_streamed),
    ModelSource("naf", load_naf_weights),
    ModelSource("moge", load_moge_folder, files=(MOGE_FILE,), tensors=MOGE_FILE, on_demand=True, sized_late=True,
                load_streamed=load_moge_streamed,
                absent="no MoGe-2 source is configured (weights.moge) and no field of view was given; pass fov=DEG "
                       "or add weights.moge to the config"),
    ModelSource("shape_encoder", load_shape_encoder_folder,
                files=(f"{SHAPE_ENCODER_STEM}.json", f"{SHAPE_ENCODER_STEM}.safetensors"),
                tensors=f"{SHAPE_ENCODER_STEM}.safetensors", on_demand=True,
                absent="texturing a given mesh needs TRELLIS.2's shape encoder, and the config names no source for it "
                       "(weights.shape_encoder: microsoft/TRELLIS.2-4B, as configs/1024_cascade.yaml has)"),
)
"""Every model with a source of its own, in the order files are located and named in a missing-weights error."""

BY_NAME: dict[str, ModelSource] = {row.name: row for row in MODEL_SOURCES}
