"""The job server (``pixal3d-serve``): an HTTP API over a queue in a database, workers with leases on any machine.

- ``main.py``: the command, its roles (all, api, worker) and checks (closed by default: loopback, or a token)
- ``app.py``: the API: its error handlers, the token check and the body limit, around ``routes.py``: the
  endpoints, each a function of its request (what they serve: ``routes.Served``)
- ``db/``: the queue in SQLite or PostgreSQL: jobs, leases, cancel flags, attempts, live workers as rows
- ``store.py``: the data folder every machine mounts: inputs, results, stage records
- ``service.py``: the API's side of the queue (submit, view, cancel, health, retention), for any replica
- ``node.py``: a worker: one process per device, claims by plan, heartbeats, takeovers
- ``worker.py``: the worker process: a kept pipeline (``pipelines.session.Session``), groups run through it over the
  work directory
"""
