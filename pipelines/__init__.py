"""The Pixal3D cascade as stage objects, the library entry point and the command line.

    from pipelines import Pixal3D
    result = Pixal3D.from_config("configs/tiny.yaml").run("assets/example.png", seed=42)
    result.save("outputs/demo.glb")
"""
from .batch import BatchItem
from .errors import NotEnoughMemoryError
from .pipeline import Pixal3D
from .plan import RunPlan
from .result import Result

__all__ = ["BatchItem", "NotEnoughMemoryError", "Pixal3D", "Result", "RunPlan"]
