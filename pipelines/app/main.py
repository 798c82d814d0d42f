"""``pixal3d-app``: start the web app (Gradio) on one cascade config.

    pixal3d-app [--config configs/1024_cascade.yaml] [--host 127.0.0.1] [--port 7860] [--device D]
        [--outputs DIR] [--queue-size N] [--auth-file FILE | --insecure]

Binds to the loopback address unless ``--host`` says otherwise; a non-loopback ``--host`` needs ``--auth-file``
(Gradio's sign-in, ``user:password`` lines) or an explicit ``--insecure``, and one line at start says which. Job files (GLB, run.json, memory trace)
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

from ..exposure import is_loopback
from ..job import DEFAULT_CONFIG, UsageError, check_options
from ..plan import parse_device

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
    parser.add_argument("--auth-file", type=Path, default=None,
                        help="sign-in: a file of user:password lines (needed for a non-loopback --host)")
    parser.add_argument("--insecure", action="store_true",
                        help="serve a non-loopback --host without sign-in: anyone who reaches it can run jobs")
    return parser.parse_args(argv)


def exposure(args: argparse.Namespace) -> tuple[list[tuple[str, str]] | None, str | None]:
    """The sign-in pairs (None: none) and the line to say at start (None on loopback without sign-in);
    ``UsageError`` for a non-loopback ``--host`` with neither ``--auth-file`` nor ``--insecure``."""
    auth = read_auth_file(args.auth_file) if args.auth_file is not None else None
    if is_loopback(args.host):
        return auth, None if auth is None else f"sign-in required ({len(auth)} users in {args.auth_file})"
    if auth is not None:
        return auth, f"--host {args.host} is reachable from other machines; sign-in required ({args.auth_file})"
    if args.insecure:
        return None, (f"--host {args.host} is reachable from other machines and --insecure is set: anyone who reaches "
                      f"it can run jobs and upload files")
    raise UsageError(f"--host {args.host} is reachable from other machines: pass --auth-file FILE (user:password "
                     f"lines) so that visitors sign in, or --insecure to serve it open, or bind 127.0.0.1")


def start_line(host: str, port: int, exposed: str | None) -> str:
    """The one line said once the app listens: its address, what it is bound to, who may use it."""
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url_host = f"[{url_host}]" if ":" in url_host else url_host
    bound = "this machine only" if is_loopback(host) else "other machines too"
    return f"serving http://{url_host}:{port} (bound to {host}: {bound}; {exposed or 'no sign-in'}); Ctrl-C stops it"


def read_auth_file(path: Path) -> list[tuple[str, str]]:
    """``user:password`` pairs, one a line (blank lines and ``#`` comments skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise UsageError(f"--auth-file {path} cannot be read ({err.strerror or err})") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        user, colon, password = line.strip().partition(":")
        if not colon or not user or not password:
            raise UsageError(f"--auth-file {path} line {number} is not user:password")
        pairs.append((user, password))
    if not pairs:
        raise UsageError(f"--auth-file {path} holds no user:password line")
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: serves until interrupted; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="pixal3d-app: %(levelname)s: %(message)s")
    try:
        config = load_config(args.config)
        device = parse_device(args.device) if args.device else None
        check_options({"--port": args.port, "--queue-size": args.queue_size})  # one line, exit 2
        auth, exposed = exposure(args)
        import gradio  # noqa: F401 - checked here so a missing extra is one line, not a traceback
    except (ConfigError, UsageError) as err:
        print(f"pixal3d-app: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        print(f"pixal3d-app: error: the web app needs Gradio ({err}); install it with: pip install -e \".[app]\"",
              file=sys.stderr)
        return 2
    from ..session import Session
    from .ui import CSS, build_ui

    gc.freeze()  # as the CLI does: the imports' objects are never rescanned by the collections each release runs
    session = Session("app", device=device)
    with tempfile.TemporaryDirectory(prefix="pixal3d-app-") as scratch:
        outputs = args.outputs if args.outputs is not None else Path(scratch)
        outputs.mkdir(parents=True, exist_ok=True)
        page = build_ui(session, config, outputs=outputs)
        page.queue(max_size=args.queue_size, default_concurrency_limit=1)
        try:  # Gradio's own start lines (and its share=True hint, which a user of this command cannot act on) stay out
            page.launch(server_name=args.host, server_port=args.port, show_error=True, quiet=True,
                        allowed_paths=[str(outputs.resolve())], footer_links=[], css=CSS, auth=auth,
                        prevent_thread_lock=True)
            print(f"pixal3d-app: {start_line(args.host, args.port, exposed)}", flush=True)
            page.block_thread()
        except KeyboardInterrupt:
            pass
        finally:
            session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
