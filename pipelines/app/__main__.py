"""``python -m pipelines.app``: the same as ``pixal3d-app``."""
from .main import main

raise SystemExit(main())
