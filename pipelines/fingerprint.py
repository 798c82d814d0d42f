"""Fingerprints of stage outputs: see ``pixal3d.staging.fingerprint`` (kept here for the cascade)."""
from pixal3d.staging.fingerprint import fingerprint_tensor, fingerprints

__all__ = ["fingerprint_tensor", "fingerprints"]
