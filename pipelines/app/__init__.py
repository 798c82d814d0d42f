"""The web app: one image in, the textured mesh in a 3D viewer, the memory in view while the run happens.

    pip install -e ".[app]"
    pixal3d-app --config configs/tiny.yaml          # or: python -m pipelines.app

It lives beside the command line, at the edge: ``pixal3d`` never imports ``pipelines``, and only
``ui.py`` imports Gradio, so everything else here (settings, the worker, the job) is tested without it.

- ``worker.py``: one ``Pixal3D`` kept alive for the current plan, one job at a time.
- ``job.py``: one job as a stream of updates (stage, step, memory trace so far, then the outputs).
- ``errors.py``: the one line a visitor sees for an error they caused.
- ``ui.py``: the Gradio page; ``main.py``: ``pixal3d-app`` (``--config``, ``--host``, ``--port``).
"""
