"""A job's settings as a client sends them (the ``settings`` field of ``POST /jobs``, JSON) and the checks they pass.

    {"seed": 42, "fov": 49.1, "texture_size": 1024, "face_budget": 200000,
     "memory_policy": "staged", "memory_budget": "8G"}

Every key is optional; an unknown key, a wrong type or a value out of range is refused with one line naming it.
The values are the web app's (``pipelines.app.settings.JobSettings``) under the names the command uses (the
memory policy is ``--memory-policy`` there); the export settings are checked by building the job's config.
The hosted Pixal3D endpoint's names (fal-ai/pixal3d, mirrored by lee101/pixal3dcog's predictor) are ``seed`` and
``texture_size`` as here, and ``decimation_target`` for the face budget, accepted as its alias (``ALIASES``). Its
``fov`` is in radians with ``<= 0`` meaning "estimate"; ours is in degrees with null meaning "estimate", so that one
name is not the hosted one's meaning and is documented as such.
"""
from __future__ import annotations

import json
from typing import Any

from pixal3d.config import CascadeConfig, ConfigError

from ..app.settings import JobSettings, job_config

FIELDS: dict[str, tuple[type, ...]] = {
    "seed": (int,), "fov": (int, float), "texture_size": (int,), "face_budget": (int,), "memory_policy": (str,),
    "memory_budget": (str,),
}
"""Each accepted key and the JSON types it may have (any may be null: the config's value, or no budget)."""
ALIASES = {"decimation_target": "face_budget"}
"""The hosted endpoint's name for a setting → ours."""


class SettingsError(ValueError):
    """The settings field cannot be used; the message names the key and what is accepted."""


def parse_settings(text: str | None, config: CascadeConfig) -> JobSettings:
    """The job's settings from the ``settings`` field (None or empty: every default), checked against ``config``."""
    if text is None or not text.strip():
        raw: Any = {}
    else:
        try:
            raw = json.loads(text)
        except ValueError as err:
            raise SettingsError(f"settings is not JSON ({err}); send an object such as {{\"seed\": 42}}") from None
    if not isinstance(raw, dict):
        raise SettingsError(f"settings must be a JSON object, not {type(raw).__name__}; e.g. {{\"seed\": 42}}")
    for alias, key in ALIASES.items():
        if alias in raw:
            if key in raw:
                raise SettingsError(f"settings give both {alias} and {key} (the same setting); send one")
            raw[key] = raw.pop(alias)
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise SettingsError(f"unknown settings {unknown}; accepted: {sorted([*FIELDS, *ALIASES])}")
    for key, value in raw.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, FIELDS[key])):
            kinds = " or ".join(t.__name__ for t in FIELDS[key])
            raise SettingsError(f"settings.{key} must be {kinds} (or null), not {json.dumps(value)}")
    values = {("policy" if key == "memory_policy" else key): value for key, value in raw.items() if value is not None}
    try:
        settings = JobSettings(**values)
        job_config(config, settings)  # the export settings' own ranges
    except ConfigError as err:
        raise SettingsError(f"settings: {err}") from None
    return settings


def settings_dict(settings: JobSettings) -> dict[str, Any]:
    """``settings`` under the names clients send (what job.json and ``GET /jobs/{id}`` show)."""
    return {"seed": settings.seed, "fov": settings.fov, "texture_size": settings.texture_size,
            "face_budget": settings.face_budget, "memory_policy": settings.policy,
            "memory_budget": settings.memory_budget}


def from_dict(values: dict[str, Any]) -> JobSettings:
    """The settings stored in job.json back as ``JobSettings``."""
    return JobSettings(**{("policy" if k == "memory_policy" else k): v for k, v in values.items()
                          if v is not None or k in ("fov", "texture_size", "face_budget", "memory_budget")})


def group_key(values: dict[str, Any]) -> str:
    """What jobs must share to run as one batch: every setting but the seed (each item has its own generator)."""
    return json.dumps({k: v for k, v in values.items() if k != "seed"}, sort_keys=True)
