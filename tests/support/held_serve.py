"""``python -m tests.support.held_serve ARGS`` is ``pixal3d-serve ARGS`` whose jobs can be held at a stage, for the tests
that must act while a job runs (cancel it, kill its worker) without racing a tiny stage that lasts milliseconds.

``PIXAL3D_TEST_HOLD`` names a folder: while a file named after a stage (``structure``) exists in it, a job that
reaches that stage reports it (its status then says ``"stage": "structure"``) and waits, before its first step,
until the file is removed; a file ``structure.<job id>`` holds that job only. The worker processes are spawned, and ``multiprocessing``'s spawn runs this module
again in each of them (as ``__mp_main__``), so the hold is installed there too. Nothing is held without the
variable or without a file.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pipelines.session import Session

HOLD = os.environ.get("PIXAL3D_TEST_HOLD")


def _install(folder: Path) -> None:
    run = Session.run

    def held_run(self: Session, job: Any, **options: Any) -> Any:
        callback = options.get("callback")
        if callback is not None:
            def held(report: dict[str, Any]) -> None:
                callback(report)
                gates = (folder / str(report.get("stage")), folder / f"{report.get('stage')}.{report.get('image')}")
                while report.get("kind") == "stage" and any(gate.exists() for gate in gates):
                    time.sleep(0.05)

            options["callback"] = held
        return run(self, job, **options)

    Session.run = held_run


if HOLD:
    _install(Path(HOLD))

if __name__ == "__main__":
    from pipelines.serve.main import main

    raise SystemExit(main())
