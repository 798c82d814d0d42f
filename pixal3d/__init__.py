"""Pixal3D image-to-3D with stage-aware model loading."""
__version__ = "0.1.0"
