"""``pixal3d-fetch``: download everything a config needs, so that a run afterwards works offline.

    pixal3d-fetch [--config configs/1024_cascade.yaml] [--no-moge] [--no-rembg]
    python scripts/fetch_weights.py [--config ...]

What is fetched is what ``resolve_weights`` would report missing (``pipeline_json.missing_files``): pipeline.json,
the checkpoints it names, DINOv3, NAF, MoGe-2 when the config names it, and rembg's model when the config uses
one. Hub files go through ``Fetcher.download_repo_file`` (the pinned revision, a progress bar, resumed partial
files, the size the Hub lists), the URL file through the Fetcher's own download (resumed ``.part``, the
announced size, the pinned sha256). Once pipeline.json is down, the listing is made again from it.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

PROG = "pixal3d-fetch"


def build_parser() -> argparse.ArgumentParser:
    """The command's options."""
    from pixal3d.config import shipped_config

    parser = argparse.ArgumentParser(prog=PROG, description="Download every weight file a config needs "
                                     "(pinned revisions, resumable, sizes checked), for offline runs afterwards.")
    parser.add_argument("--config", type=Path, default=shipped_config("1024_cascade.yaml"),
                        help="the cascade config whose weights to fetch (default: the shipped 1024_cascade)")
    parser.add_argument("--no-moge", action="store_true", help="skip MoGe-2 (runs that always pass --fov)")
    parser.add_argument("--no-rembg", action="store_true", help="skip rembg's model (inputs with alpha only)")
    parser.add_argument("--mesh", action="store_true",
                        help="also TRELLIS.2's shape encoder (0.71 GB), which texturing a given mesh (--mesh) needs")
    return parser


def fetch_all(config_file: str | Path, *, moge: bool = True, rembg: bool = True, encoder: bool = False,
              rounds: int = 3) -> list[Path]:
    """Download what the config at ``config_file`` needs and is not on disk; the files written. Raises
    ``WeightsError`` (``MissingWeightsError`` naming what is still missing when a download failed)."""
    from pixal3d.config import load_config
    from pixal3d.hub import Fetcher, merged_missing
    from pixal3d.pipeline_json import missing_files

    config = load_config(config_file)
    written: list[Path] = []
    for _ in range(rounds):  # pipeline.json first names the checkpoints; a second listing reads it
        listing = missing_files(config.weights, include_moge=moge, include_encoder=encoder)
        entries = merged_missing(listing.missing)
        if not entries:
            break
        online = Fetcher(offline=False, generate=None, config_file=str(config.source), progress=True)
        for entry in entries:
            if entry.source.repo is not None:
                for name in entry.files:
                    logger.info("%s: %s from %s", entry.label, name, entry.source.describe())
                    written.append(online.download_repo_file(entry.source, name))
            elif entry.source.url is not None:
                path = online.file(entry.source, label=entry.label, strict=True)
                if path is not None:
                    written.append(path)
            else:  # a local folder or generated weights: nothing to download
                online.missing.append(entry)
        online.raise_missing()
    else:
        missing_files(config.weights, include_moge=moge, include_encoder=encoder).raise_missing()
    if rembg and config.weights.rembg:
        written.extend(fetch_rembg(config.weights.rembg))
    return written


def fetch_rembg(model_name: str) -> list[Path]:
    """rembg's model for ``model_name``, through rembg's own download (its cache, its checksum)."""
    from rembg import new_session

    logger.info("rembg: %s (rembg's own download and checksum)", model_name)
    new_session(model_name)
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 when everything is on disk; one error line and 2 when the Hub cannot be reached, 1 for
    any other failure (a file the Hub refused, a wrong size, a bad config)."""
    args = build_parser().parse_args(argv)
    _log_progress()
    from pixal3d.config import ConfigError
    from pixal3d.hub import hub_offline, network_errors
    from pixal3d.weights_errors import HubUnreachableError, WeightsError

    if hub_offline():
        print(f"{PROG}: error: HF_HUB_OFFLINE is set, and this command downloads from the Hub: unset it here "
              f"(the runs afterwards may set it)", file=sys.stderr)
        return 2
    try:
        written = fetch_all(args.config, moge=not args.no_moge, rembg=not args.no_rembg, encoder=args.mesh)
    except HubUnreachableError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except (WeightsError, ConfigError) as err:  # the missing-weights list is one line per file, by design
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    except network_errors() as err:  # rembg's own download, a full disk: its first line, and what it was
        first = (str(err).strip().splitlines() or [""])[0][:300]
        print(f"{PROG}: error: {type(err).__name__}: {first}", file=sys.stderr)
        return 1
    print(f"{PROG}: every weight file {args.config} needs is on disk ({len(written)} downloaded now)")
    return 0


def _log_progress() -> None:
    """This command's progress lines (pixal3d's INFO records) on stderr, prefixed with its name; the HTTP
    client's per-request INFO lines are filtered out. Like ``logging.basicConfig``, nothing changes where the
    root logger has handlers already (a test session, an embedding program)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    handler.addFilter(logging.Filter("pixal3d"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


if __name__ == "__main__":
    raise SystemExit(main())
