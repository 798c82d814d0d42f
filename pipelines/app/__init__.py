"""The web app: one image in, the textured mesh in a 3D viewer, the memory in view while the run happens.

    pip install -e ".[app]"
    pixal3d-app --config configs/tiny.yaml          # or: python -m pipelines.app

A front end beside the command and the job server, each over the same floor: the form makes a job
(``pipelines.job.Job.from_form``), a session keeps the pipeline for its plan and writes the results
(``pipelines.session.Session``, one job at a time), and the one-line errors are ``pipelines.errors.error_line``.
It imports neither the command nor the server; only ``ui.py`` imports Gradio, so the rest is tested without it.

- ``job.py``: one job as a stream of updates (stage, step, memory trace so far, then the outputs).
- ``ui.py``: the Gradio page, its form one field per job setting; ``main.py``: ``pixal3d-app`` (``--config``,
  ``--host``, ``--port``).
"""
