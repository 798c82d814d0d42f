"""Result: what one ``Pixal3D.run`` produced — the mesh, the decoded fields, coords and latents — and how it
went: per-stage seconds, models, peak memory and fingerprints. ``save`` writes the GLB, ``record`` is the
run.json content, ``save_latents`` the coords and latents; ``save_outputs`` writes any of the three as one
group that appears whole or not at all."""
from __future__ import annotations

import hashlib
import io
import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pixal3d import kernels
from pixal3d.config import CascadeConfig, to_dict
from pixal3d.files import (
    atomic_paths,
    json_bytes,
    write_bytes_atomic,
    write_bytes_to,
    write_json_atomic,
)
from pixal3d.mesh.fields import DualGridFields, PbrVoxels
from pixal3d.mesh.records import ExportedMesh
from pixal3d.staging import Policy, StageRecord
from pixal3d.telemetry import format_bytes, text_table

from .camera import camera_source, moge_fp16
from .state import RunState

STAGE_COLUMNS = ("stage", "seconds", "peak memory", "peak device", "models used", "loaded")
"""The per-stage table's columns (``Result.stage_rows``): the command prints it, the web app shows it."""


def versions() -> dict[str, str]:
    """Versions of Python and the libraries that decide the numbers."""
    import numpy
    import transformers

    import pixal3d

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "transformers": transformers.__version__, "pixal3d": pixal3d.__version__,
            "platform": platform.platform()}


def run_json_path(output: Path) -> Path:
    """``out.glb`` → ``out.run.json`` (same folder)."""
    return output.with_name(output.stem + ".run.json")


@dataclass
class Result:
    """One image's run. ``state`` holds every field the stages wrote (see ``RunState``); ``stages`` one
    record per stage; ``memory`` the memory meter's per-window rows (a ``setup`` window first, where an
    eager policy loads its models); ``parallel`` (under torchrun) the job's settings and every rank's
    per-stage peak memory (``pipelines/parallel.py``); ``choices`` what the plan fitted each stage to (NAF
    mode, decode tiles, chunk sizes; ``RunPlan.choices``) and ``memory_budget`` the bound it fitted to."""

    input: str
    seed: int
    config: CascadeConfig
    device: torch.device
    policy: Policy
    policy_reasons: tuple[str, ...]
    state: RunState
    stages: list[StageRecord]
    memory: list[dict[str, Any]]
    parallel: dict[str, Any] | None = None
    choices: dict[str, Any] = field(default_factory=dict)
    memory_budget: int | None = None
    shape_only: bool = False  # the run ended with the untextured export (``--shape-only``)

    # -- outputs -----------------------------------------------------------------------------
    @property
    def mesh(self) -> ExportedMesh | None:
        """The mesh (textured; untextured for a shape-only run), its GLB bytes and the export report (None if the
        run had no export stage)."""
        return self.state.mesh

    @property
    def fields(self) -> DualGridFields | None:
        """The shape decoder's flexible-dual-grid fields."""
        return self.state.fields

    @property
    def pbr(self) -> PbrVoxels | None:
        """The texture decoder's PBR voxels."""
        return self.state.pbr

    def latents(self) -> dict[str, Any]:
        """Coords (int32) and latents (on the CPU): ``coords_lr``, ``coords_hr``, ``hr_resolution``,
        ``ss_latent``, ``lr_latent``, ``shape_latent``, ``tex_latent`` (whichever the run reached)."""
        s = self.state
        data = {"coords_lr": s.coords_lr, "coords_hr": s.coords_hr, "hr_resolution": s.hr_resolution,
                "ss_latent": s.ss_latent, "lr_latent": _feats(s.lr_latent), "shape_latent": _feats(s.shape_latent),
                "tex_latent": _feats(s.tex_latent)}
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in data.items() if v is not None}

    def camera(self) -> dict[str, Any]:
        """The run's camera for run.json: horizontal fov (degrees), distance, where the fov came from (``given``,
        ``MoGe-2``, ``fallback``) and, for MoGe-2, its precision; empty before the camera stage."""
        camera = self.state.camera
        if camera is None:
            return {}
        source = camera_source(self.config, self.state.fov_deg)
        out = {"fov_deg": math.degrees(camera.fov), "distance": camera.distance, "source": source}
        if source == "MoGe-2":
            fp16 = moge_fp16(self.config.camera.moge_precision, self.state.device)
            out["moge_precision"] = "float16 autocast" if fp16 else "float32"
        return out

    def views(self) -> dict[str, Any]:
        """The input views for run.json (a multi-view run): folder, count, names, fields of view, mesh scale, frame
        0's distance and whether it is the canonical front pose; empty for an image."""
        views = self.state.input_views
        return {} if views is None else views.describe()

    def camera_line(self) -> str | None:
        """``camera: 59.29° horizontal field of view (MoGe-2, float32)``, what the command prints after a run
        (``views: 4 posed views ...`` for a multi-view run)."""
        views = self.views()
        if views:
            front = "frame 0 at the front pose" if views["front_pose"] else "frame 0 NOT at the front pose"
            return (f"views: {views['views']} posed views from {views['folder']} "
                    f"({', '.join(views['names'])}; {front})")
        camera = self.camera()
        if not camera:
            return None
        how = ", ".join(filter(None, (camera["source"], camera.get("moge_precision"))))
        return f"camera: {camera['fov_deg']:.2f}° horizontal field of view ({how})"

    def fingerprints(self) -> dict[str, dict[str, str]]:
        """Stage → {output name → sha256} (stages without outputs left out)."""
        return {r.stage: r.fingerprints for r in self.stages if r.fingerprints}

    @property
    def seconds(self) -> float:
        """Wall seconds this run spent in its stages (a stage reused from a work directory costs none)."""
        return sum(r.seconds for r in self.stages if not r.reused)

    def stage_rows(self) -> list[list[str]]:
        """One row per stage (``STAGE_COLUMNS``): seconds, peak process and device memory, the models it used,
        and what was loaded in its window (count and bytes, from the memory meter); a ``setup`` row first when
        an eager policy loaded every model before the first stage; a total last."""
        windows = {row["stage"]: row for row in self.memory}
        rows = []
        setup = windows.get("setup", {})
        if setup.get("loads"):
            rows.append(["setup", f"{setup['seconds']:.2f}", format_bytes(setup.get("peak_process")),
                         format_bytes(setup.get("peak_device")), "-",
                         f"{setup['loads']} ({format_bytes(setup.get('loaded_bytes', 0))})"])
        for record in self.stages:
            window = windows.get(record.stage, {})
            loads = window.get("loads", 0)
            loaded = f"{loads} ({format_bytes(window.get('loaded_bytes', 0))})" if loads else "-"
            if record.reused:  # restored from the work directory: nothing ran, the old figures are not this run's
                rows.append([record.stage, f"reused ({record.seconds:.2f} then)", "-", "-", "-", "-"])
                continue
            rows.append([record.stage, f"{record.seconds:.2f}", format_bytes(record.peak_process_bytes),
                         format_bytes(record.peak_device_bytes), ", ".join(record.used) or "-", loaded])
        rows.append(["total", f"{self.seconds:.2f}", "", "", "", ""])
        return rows

    def table(self) -> str:
        """``stage_rows`` as text (``pixal3d.telemetry.text_table``)."""
        return text_table(STAGE_COLUMNS, self.stage_rows())

    # -- files -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the GLB to ``path`` atomically (no partial file, ever); returns the path."""
        if self.mesh is None:
            raise ValueError("this run has no mesh to save (it stopped before the export stage)")
        return self.mesh.save(path)

    def save_latents(self, path: str | Path) -> Path:
        """Write ``latents()`` with ``torch.save`` to ``path`` atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, self.latents_bytes())
        return path

    def latents_bytes(self) -> bytes:
        """``latents()`` serialized by ``torch.save`` (in memory: a write error is then an ``OSError`` naming
        the file, not torch's ``RuntimeError`` from inside its zip writer)."""
        buffer = io.BytesIO()
        torch.save(self.latents(), buffer)
        return buffer.getvalue()

    def save_outputs(self, glb: str | Path, *, record: str | Path | None = None, latents: str | Path | None = None,
                     command: Sequence[str] = (), output: str | Path | None = None,
                     extension: Mapping[str, Any] | None = None) -> list[Path]:
        """Write the GLB and, when paths are given, its run.json (``record(output=..., command=..., extension=...)``;
        ``output``: what it calls the GLB, default its path) and its latents, atomically as one group: every file is written before any appears, so a full disk, an
        error or a signal leaves none of them. The GLB is the group's commit point (``pixal3d.files``): it is
        renamed last, after the latents and the run.json are complete on disk, so even a SIGKILL or a power loss
        never leaves a GLB without its record (at most a record without its GLB, which counts as absent; the
        record's ``export.glb_sha256`` ties it to its GLB). Returns the paths: GLB, run.json, latents."""
        if self.mesh is None:
            raise ValueError("this run has no mesh to save (it stopped before the export stage)")
        files: dict[Path, Any] = {}
        if latents is not None:
            files[Path(latents)] = self.latents_bytes
        if record is not None:
            files[Path(record)] = lambda: json_bytes(self.record(output=glb if output is None else output,
                                                                 command=command, extension=extension))
        for extra, data in self.mesh.extra_paths(glb).items():  # a printable mesh's STL and 3MF
            files[extra] = lambda data=data: data
        files[Path(glb)] = lambda: self.mesh.glb  # last: the group's commit point
        for path in files:
            path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_paths(list(files)) as temps:
            for tmp, (path, data) in zip(temps, files.items()):
                write_bytes_to(tmp, data(), path)
        return [Path(glb), *(Path(p) for p in (record, latents) if p is not None)]

    def record(self, *, output: str | Path | None = None, command: Sequence[str] = (),
               extension: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The run.json content: config, seed, versions, the CPU kernels and their pins (``pixal3d.kernels``),
        policy and reasons, camera, tokens, per-stage rows (``reused``: taken from a work directory, its seconds
        those of the run that made it; ``total_seconds`` counts only this run's); ``extension``: entries a front
        end adds (``pipelines.session.Session.write``: one, named after it)."""
        stages = [{"stage": r.stage, "seconds": round(r.seconds, 4), "models": r.used,
                   "peak_process_bytes": r.peak_process_bytes, "peak_device_bytes": r.peak_device_bytes,
                   "fingerprints": r.fingerprints, "reused": r.reused} for r in self.stages]
        s = self.state
        return {
            "input": self.input,
            "output": None if output is None else str(output),
            "command": list(command),
            "config_file": self.config.source,
            "config": to_dict(self.config),
            "seed": self.seed,
            "fov_deg": s.fov_deg,
            "device": str(self.device),
            "policy": self.policy.value,
            "policy_reasons": list(self.policy_reasons),
            "memory_budget": self.memory_budget,
            "shape_only": self.shape_only,
            "stage_choices": self.choices,
            "versions": versions(),
            "kernels": kernels.describe(),
            "camera": self.camera(),
            **({"views": self.views()} if self.views() else {}),
            **({"mesh": self.mesh_input()} if s.input_mesh is not None else {}),
            "tokens": {"lr": _rows(s.coords_lr), "hr": _rows(s.coords_hr if s.coords_hr is not None else
                                                             getattr(s.shape_latent, "coords", None)),
                       "hr_resolution": s.hr_resolution},
            "total_seconds": round(self.seconds, 4),
            "stages": stages,
            "memory": list(self.memory),
            "export": self._export_record(output),
            **({"parallel": self.parallel} if self.parallel is not None else {}),
            **(extension or {}),
        }

    def mesh_input(self) -> dict[str, Any]:
        """A ``--mesh`` run's mesh for run.json: its file, sha256, size, pose (and the estimate's residual, in voxels
        of the 1024 grid), and whether a shape-only note's latent was used instead of encoding it."""
        from pixal3d.mesh.latent_note import usable_note

        mesh, pose = self.state.input_mesh, self.state.mesh_pose
        out = {"file": mesh.source, "sha256": mesh.digest(), "vertices": len(mesh.vertices), "faces": len(mesh.faces),
               "uvs_kept": mesh.uvs is not None, "pose": mesh.pose}
        if pose is not None:
            out["residual_voxels"] = round(float(pose.residual), 3)
            out["voxels"] = None if self.state.mesh_voxels is None else len(self.state.mesh_voxels)
        out["shape_latent_from_note"] = mesh.pose == "aligned" and usable_note(mesh) is not None
        return out

    def _export_record(self, output: str | Path | None) -> dict[str, Any]:
        if self.mesh is None:
            return {}
        export = self.mesh.report.to_dict()
        export["glb_sha256"] = hashlib.sha256(self.mesh.glb).hexdigest()  # ties the record to its GLB
        if output is not None:
            export["path"] = str(output)  # where the GLB is, not where the exporter held it
        return export

    def save_record(self, path: str | Path, *, output: str | Path | None = None, command: Sequence[str] = ()) -> Path:
        """Write ``record(...)`` as JSON to ``path`` atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.record(output=output, command=command))
        return path


def item_result(item: Any, plan: Any, rows: Sequence[Any], *, parallel: dict[str, Any] | None) -> Result:
    """The ``Result`` of one batch item run on ``plan`` (a ``RunPlan``): its state and stage records, the memory
    meter's ``rows`` (each record without peaks takes its stage's from them), run.json's ``parallel`` entry."""
    peaks = {row.stage: row for row in rows}
    for record in item.records:
        if record.stage in peaks and record.peak_process_bytes is None:
            record.peak_process_bytes = peaks[record.stage].peak_process
            record.peak_device_bytes = peaks[record.stage].peak_device
    return Result(input=item.label, seed=item.seed, config=plan.config, device=plan.device, policy=plan.policy,
                  policy_reasons=plan.reasons, state=item.state, stages=item.records,
                  memory=[row.to_dict() for row in rows], parallel=parallel, choices=plan.choices(),
                  memory_budget=plan.memory_budget, shape_only=plan.shape_only)


def _feats(latent: Any) -> Any:
    return None if latent is None else latent.feats


def _rows(tensor: Any) -> int | None:
    return None if tensor is None else int(tensor.shape[0])
