"""The job server (``pixal3d-serve``): an HTTP API over a durable queue on disk, one worker process per device.

- ``main.py``: the command, its checks (closed by default: loopback, or a token), uvicorn
- ``app.py``: the endpoints, the token check and the body limit
- ``store.py``: the data folder: jobs written atomically before they are acknowledged, their ends, their results
- ``scheduler.py``: the queue in memory, grouping by plan, one thread and worker process per device
- ``worker.py``: the worker process: a kept pipeline, groups through ``Pixal3D.run_batch`` over the work directory
"""
