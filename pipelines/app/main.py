"""``pixal3d-app``: start the web app (Gradio) on one cascade config.

    pixal3d-app [--config configs/1024_cascade.yaml] [--host 127.0.0.1] [--port 7860] [--device D]
        [--outputs DIR] [--queue-size N]

Binds to the loopback address unless ``--host`` says otherwise. Job files (GLB, run.json, memory trace)
go to ``--outputs`` (default: a temporary folder removed when the app stops). A bad config or device is
one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pixal3d.config import ConfigError, load_config

from ..cli import DEFAULT_CONFIG, UsageError, parse_device

logger = logging.getLogger("pixal3d-app")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pixal3d-app", allow_abbrev=False,
                                     description="Pixal3D web app: image → textured 3D mesh, with memory in view.")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="cascade config (default: configs/1024_cascade.yaml; configs/tiny.yaml is the offline demo)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda, else mps, else cpu)")
    parser.add_argument("--outputs", type=Path, default=None,
                        help="keep job files here (default: a temporary folder removed at exit)")
    parser.add_argument("--queue-size", type=int, default=16, help="jobs that may wait in the queue (default: 16)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: serves until interrupted; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="pixal3d-app: %(levelname)s: %(message)s")
    try:
        config = load_config(args.config)
        device = parse_device(args.device) if args.device else None
        if not 0 < args.port < 65536:
            raise UsageError(f"--port {args.port} is not a TCP port; use 1-65535, e.g. --port 7860")
        import gradio  # noqa: F401 - checked here so a missing extra is one line, not a traceback
    except (ConfigError, UsageError) as err:
        print(f"pixal3d-app: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        print(f"pixal3d-app: error: the web app needs Gradio ({err}); install it with: pip install -e \".[app]\"",
              file=sys.stderr)
        return 2
    from .ui import CSS, build_ui
    from .worker import Worker

    gc.freeze()  # as the CLI does: the imports' objects are never rescanned by the collections each release runs
    worker = Worker(config, device=device)
    with tempfile.TemporaryDirectory(prefix="pixal3d-app-") as scratch:
        outputs = args.outputs if args.outputs is not None else Path(scratch)
        outputs.mkdir(parents=True, exist_ok=True)
        page = build_ui(worker, outputs=outputs)
        page.queue(max_size=args.queue_size, default_concurrency_limit=1)
        try:
            page.launch(server_name=args.host, server_port=args.port, show_error=True, quiet=False,
                        allowed_paths=[str(outputs.resolve())], footer_links=[], css=CSS)
        except KeyboardInterrupt:
            pass
        finally:
            worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
