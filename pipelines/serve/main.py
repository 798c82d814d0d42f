"""``pixal3d-serve``: the job server (``python -m pipelines.serve`` is the same command).

    pixal3d-serve [--role all | api | worker] [--config configs/1024_cascade.yaml] [--data DIR]
        [--queue postgresql://user@host/db] [--name NAME] [--lease 30]
        [--host 127.0.0.1] [--port 8000] [--token-file FILE] [--max-upload 32M] [--max-pixels N] [--queue-size 64]
        [--keep 7d]                                                   (the API: roles all and api)
        [--devices cuda:0,cuda:1 | mps | cpu] [--job-timeout 3600] [--group-size 8] [--threads N]
                                                                      (the workers: roles all and worker)

Roles: ``all`` (the default) is the API and one worker process per device in one command, as on one machine;
``api`` answers HTTP only and ``worker`` runs jobs only, on any machine that reaches the same ``--queue`` (a
PostgreSQL URL; by default SQLite in ``--data``, which only one machine can share) and mounts the same ``--data``.

Closed by default: it binds the loopback address, and a non-loopback ``--host`` is refused unless a token is set
(``--token-file``, or the environment variable ``PIXAL3D_SERVE_TOKEN``); with a token every request needs
``Authorization: Bearer <token>``. Startup errors are one line on stderr and exit code 2; once serving, one line on
stdout says where (``pixal3d-serve: serving http://HOST:PORT ...``; a worker: ``pixal3d-serve: worker NAME ...``).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pixal3d.config import CascadeConfig, ConfigError, Range, load_config
from pixal3d.locks import LockedError, exclusive_lock
from pixal3d.memory_budget import parse_budget
from pixal3d.models.preprocess import MAX_DECODE_PIXELS

from ..exposure import is_loopback
from ..job import DEFAULT_CONFIG, UsageError, check_options, plan_key
from ..plan import default_device, parse_device
from .db import QueueError, open_queue, queue_url
from .db.migrate import adopt_folder
from .store import DataDirError, DataFolder

TOKEN_ENV = "PIXAL3D_SERVE_TOKEN"
ROLES = ("all", "api", "worker")
ANY_PORT = Range(0, 65535, integer=True)
"""The server's ``--port``: 0 is any free port."""
logger = logging.getLogger("pixal3d-serve")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pixal3d-serve", allow_abbrev=False,
                                     description="Pixal3D job server: HTTP API, durable queue, one worker per device.")
    parser.add_argument("--role", choices=ROLES, default="all",
                        help="all: the API and the workers (default); api: the API only; worker: the workers only "
                             "(other machines, on the same --queue and --data)")
    parser.add_argument("--queue", default=None,
                        help="the queue's database: postgresql://user@host:5432/db for several machines (the "
                             "[fleet] extra); default: SQLite in --data (this machine only)")
    parser.add_argument("--name", default=None,
                        help="this worker's name, unique on the queue: it owns the jobs' leases (default: the host "
                             "name); a worker started again under its name takes its old jobs back at once")
    parser.add_argument("--lease", type=float, default=30.0,
                        help="seconds a worker's claim on a job lasts without a heartbeat (default 30; renewed every "
                             "third of it): after a worker dies, its jobs wait this long before another takes them")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="cascade config (default: 1024_cascade; tiny is the offline demo)")
    parser.add_argument("--data", type=Path, default=Path("pixal3d-serve-data"),
                        help="the jobs' inputs, results and stage records, the same path on every machine of one "
                             "queue (default: ./pixal3d-serve-data)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1, this machine only; any other needs a token)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free port)")
    parser.add_argument("--devices", default=None,
                        help="one worker per device, comma-separated: cuda:0,cuda:1 / mps / cpu / cpu,cpu "
                             "(default: cuda, else mps, else cpu)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help=f"a file holding the API token (or set {TOKEN_ENV}); every request then needs "
                             f"Authorization: Bearer <token>")
    parser.add_argument("--max-upload", default="32M", help="largest image upload (default: 32M)")
    parser.add_argument("--max-pixels", type=int, default=MAX_DECODE_PIXELS,
                        help=f"largest image in pixels (default: {MAX_DECODE_PIXELS}, the command's)")
    parser.add_argument("--queue-size", type=int, default=64, help="jobs that may wait (default: 64; then 429)")
    parser.add_argument("--job-timeout", type=float, default=3600.0,
                        help="seconds a job may run before it is stopped at its next stage or step (default: 3600; "
                             "0: none); a group of n jobs gets n times this")
    parser.add_argument("--keep", default="7d",
                        help="remove jobs this long after they end (e.g. 30m, 12h, 7d; default 7d; 0: keep all)")
    parser.add_argument("--group-size", type=int, default=8,
                        help="queued jobs with one plan run as one batch, stage by stage, up to this many (default 8)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: torch's; two CPU workers share the cores)")
    return parser.parse_args(argv)


def read_token(path: Path | None, env: dict[str, str] | None = None) -> str | None:
    """The API token from ``--token-file`` (first line, stripped) or the environment; None when neither is set."""
    env = os.environ if env is None else env
    if path is not None:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as err:
            raise UsageError(f"--token-file {path} cannot be read ({err.strerror or err})") from None
        if not token:
            raise UsageError(f"--token-file {path} is empty; put the token on its first line")
    else:
        token = env.get(TOKEN_ENV, "").strip() or None
    if token is not None and len(token) < 16:
        raise UsageError("the API token is shorter than 16 characters; use e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'")
    return token


def parse_duration(text: str) -> float | None:
    """``30m``, ``12h``, ``7d``, ``90s`` or plain seconds as seconds; ``0`` as None (keep everything)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise UsageError(f"--keep {text!r} is not a duration; use e.g. 30m, 12h or 7d (0: keep all)")
    seconds = float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]
    return None if seconds == 0 else seconds


def check_args(args: argparse.Namespace) -> tuple[list[str], str | None, int]:
    """The devices, the token and the upload limit; ``UsageError`` for what cannot work, before anything starts."""
    devices = [str(parse_device(d.strip())) for d in args.devices.split(",")] if args.devices else \
        [str(default_device())]
    token = read_token(args.token_file)
    if not is_loopback(args.host) and token is None:
        raise UsageError(f"--host {args.host} is reachable from other machines: set a token (--token-file FILE or "
                         f"{TOKEN_ENV}) so that only its holders can run jobs, or bind 127.0.0.1")
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9._:@-]{1,100}", args.name):
        raise UsageError(f"--name {args.name!r}: use letters, digits and . _ : @ - (at most 100)")
    check_options({"--port": args.port, "--queue-size": args.queue_size, "--group-size": args.group_size,
                   "--max-pixels": args.max_pixels, "--job-timeout": args.job_timeout, "--threads": args.threads,
                   "--lease": args.lease},
                  {"--port": ANY_PORT})  # one line, exit 2: a worker with 0 threads died and restarted forever
    try:
        max_upload = parse_budget(args.max_upload)
    except ValueError:  # SettingError: its words are about a memory budget
        raise UsageError(f"--max-upload {args.max_upload!r} is not a size; write e.g. 32M or 500K") from None
    return devices, token, max_upload


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: serves until interrupted; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="pixal3d-serve: %(levelname)s: %(message)s")
    api, workers = args.role in ("all", "api"), args.role in ("all", "worker")
    name = args.name or socket.gethostname()
    with ExitStack() as held:
        try:
            opened = _open(args, held, name=name, api=api, workers=workers)
        except (ConfigError, UsageError, DataDirError, LockedError, QueueError) as err:
            print(f"pixal3d-serve: error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
        except OSError as err:
            print(f"pixal3d-serve: error: cannot listen on {args.host}:{args.port} ({err.strerror or err})",
                  file=sys.stderr)
            return 2
        except ImportError as err:
            print(f"pixal3d-serve: error: the server needs FastAPI and uvicorn ({err}); install them with: "
                  f"pip install -e \".[serve]\"", file=sys.stderr)
            return 2
        from .node import Node

        gc.freeze()
        node = None
        if workers:
            node = Node(opened.queue, queue_url(args.queue, opened.data.root), opened.data, name=name, role=args.role,
                        devices=opened.devices, config=str(args.config), group_size=args.group_size,
                        job_timeout=args.job_timeout or None, threads=args.threads, lease=args.lease)
            node.start()
            held.callback(node.stop)
        if not api:
            print(f"pixal3d-serve: worker {name} on {', '.join(opened.devices)} ({opened.where})", flush=True)
            wait_for_a_stop()
            return 0
        _serve(args, opened, held, node)
    return 0


@dataclass(frozen=True)
class _Opened:
    """What ``main`` opened before anything serves: the checked settings, the data folder, the queue, the socket."""

    config: CascadeConfig
    devices: list[str]
    token: str | None
    max_upload: int
    keep: float | None
    data: DataFolder
    queue: Any
    sock: socket.socket | None

    @property
    def where(self) -> str:
        return f"data {self.data.root}; queue {self.queue.describe()}"


def _open(args: argparse.Namespace, held: ExitStack, *, name: str, api: bool, workers: bool) -> _Opened:
    """The config, the settings (``check_args``), the data folder and its queue (a files-only folder's jobs moved in),
    this worker's lock, the API's socket bound; what a user can get wrong raises, for ``main``'s one line."""
    config = load_config(args.config)
    devices, token, max_upload = check_args(args)
    keep = parse_duration(args.keep)
    data = DataFolder(args.data)
    queue = open_queue(args.queue, data.root)
    held.callback(queue.close)
    if data.files_only():
        moved = adopt_folder(queue, data.root, plan_key)
        data.mark_migrated(queue.describe())
        print(f"pixal3d-serve: moved {moved} job(s) of {data.root} into the queue {queue.describe()}", flush=True)
    if workers:
        held.enter_context(exclusive_lock(data.worker_lock(name), wait=False, what=f"worker {name} on {data.root}",
                                          owner="another pixal3d-serve worker of that name (give this one another "
                                                "--name)"))
    sock = None
    if api:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        import uvicorn  # noqa: F401 - here, so that a missing extra is one line
    return _Opened(config, devices, token, max_upload, keep, data, queue, sock)


def _serve(args: argparse.Namespace, opened: _Opened, held: ExitStack, node: Any) -> None:
    """The API on ``opened``'s socket, with retention, until interrupted (``node``: this process's workers)."""
    import uvicorn

    from .app import create_app
    from .service import Jobs

    jobs = Jobs(opened.queue, opened.data, queue_size=args.queue_size, keep_seconds=opened.keep,
                wake=node.wake if node is not None else lambda: None)
    jobs.start()
    held.callback(jobs.stop)
    app = create_app(jobs, opened.config, token=opened.token, max_upload=opened.max_upload,
                     max_pixels=args.max_pixels, local=node)
    opened.sock.listen(128)
    host, port = opened.sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ran = f"devices {', '.join(opened.devices)}; " if node is not None else "API only; "
    print(f"pixal3d-serve: serving http://{shown}:{port} ({ran}{opened.where}; "
          f"{'token required' if opened.token else 'no token: this machine only'})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.run(sockets=[opened.sock])


def wait_for_a_stop() -> None:
    """Block until SIGTERM or SIGINT (a worker without an API has nothing else to wait on)."""
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


if __name__ == "__main__":
    raise SystemExit(main())
