"""``python -m pipelines.serve``: the same as ``pixal3d-serve``."""
from .main import main

if __name__ == "__main__":
    raise SystemExit(main())
