"""Small meshes for the export's tests."""
from __future__ import annotations

import numpy as np


def grid_mesh(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A wavy n×n grid of 2(n-1)² triangles."""
    x, y = np.meshgrid(np.arange(n, dtype=np.float32), np.arange(n, dtype=np.float32))
    v = np.stack([x.ravel(), y.ravel(), np.sin(x.ravel() * 0.3) * np.cos(y.ravel() * 0.2)], 1)
    i = (np.arange(n - 1)[:, None] * n + np.arange(n - 1)[None, :]).ravel()
    f = np.concatenate([np.stack([i, i + 1, i + n], 1), np.stack([i + 1, i + n + 1, i + n], 1)]).astype(np.int32)
    return v, f
