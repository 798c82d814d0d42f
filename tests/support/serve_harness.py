"""A real ``pixal3d-serve`` for the tests: a process on a free loopback port, its worker processes, and a client.

``Server.start`` runs ``python -m pipelines.serve`` (``tests.support.held_serve`` when given a ``hold`` folder: see
``Server.held``; with this checkout first on the path, the session's tiny cache
and kernel pins inherited), waits for its ``serving`` line and for every worker to be ready (``--role worker``: for
its ``worker NAME`` line; it has no URL). ``kill`` sends SIGKILL to the server alone and waits until its workers
have gone, as after a crash.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"serving (http://\S+)|pixal3d-serve: worker \S+ on")
ENDED = ("done", "failed", "cancelled")


@dataclass
class Server:
    """One server process and how to reach it."""

    data: Path
    args: list[str]
    log: Path
    process: subprocess.Popen | None = None
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    hold: Path | None = None
    _seen: int = 0

    @classmethod
    def start(cls, data: Path, *args: str, token: str | None = None, ready: bool = True, timeout: float = 180,
              log: str | None = None, hold: Path | None = None) -> Server:
        """``log``: the log's name beside ``data`` (several processes on one data folder need one each); ``hold``:
        a folder whose stage-named files hold this server's jobs at that stage (``tests/support/held_serve.py``)."""
        server = cls.spawn(data, *args, token=token, log=log, hold=hold)
        server.started(ready=ready, timeout=timeout)
        return server

    @classmethod
    def spawn(cls, data: Path, *args: str, token: str | None = None, log: str | None = None,
              hold: Path | None = None) -> Server:
        """``start`` without the wait: the process is running, ``started`` waits for it (several started at once)."""
        server = cls(data, list(args), data.parent / f"{log or data.name}.log", hold=hold)
        if token is not None:
            server.headers = {"Authorization": f"Bearer {token}"}
        server._popen()
        return server

    def launch(self, *, ready: bool = True, timeout: float = 180) -> None:
        self._popen()
        self.started(ready=ready, timeout=timeout)

    def _popen(self) -> None:
        self._seen = len(SERVING.findall(self.log.read_text(errors="replace"))) if self.log.exists() else 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        entry = "pipelines.serve"
        if self.hold is not None:
            self.hold.mkdir(parents=True, exist_ok=True)
            entry, env["PIXAL3D_TEST_HOLD"] = "tests.support.held_serve", str(self.hold)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", entry, "--data", str(self.data),
                                             "--port", "0", *self.args], stdout=out, stderr=subprocess.STDOUT,
                                            env=env, cwd=REPO)

    def started(self, *, ready: bool = True, timeout: float = 180) -> None:
        """Wait for the ``serving`` (or ``worker NAME``) line of the last launch, then, with ``ready``, for the
        workers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = SERVING.findall(self.log.read_text(errors="replace"))
            if len(found) > self._seen:  # this launch's line (the log keeps earlier launches' too)
                self.url = found[-1]  # empty for a worker without the API
                break
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.tail()}")
            time.sleep(0.1)
        else:
            raise TimeoutError(f"the server did not start in {timeout} s:\n{self.tail()}")
        while ready and self.url and not self.get("/health").json().get("ready"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not start in {timeout} s:\n{self.tail()}")
            time.sleep(0.2)

    @contextmanager
    def held(self, stage: str, job: str | None = None) -> Iterator[None]:
        """While inside, a job of this server (started with ``hold``) that reaches ``stage`` waits there (only the job
        ``job`` when given)."""
        assert self.hold is not None, "start the server with hold=FOLDER"
        gate = self.hold / (stage if job is None else f"{stage}.{job}")
        gate.touch()
        try:
            yield
        finally:
            gate.unlink(missing_ok=True)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    # -- requests ----------------------------------------------------------------------------
    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        with self.client() as client:
            return client.get(path, **kwargs)

    def submit(self, image: bytes, settings: dict[str, Any] | None = None, *, path: str = "/jobs") -> httpx.Response:
        files = {"image": ("image.png", image, "image/png")}
        data = {"settings": json.dumps(settings)} if settings is not None else {}
        with self.client() as client:
            return client.post(path, files=files, data=data)

    def wait(self, job_id: str, until: Any = None, timeout: float = 300) -> dict[str, Any]:
        """Poll the job until ``until(view)`` (default: it has ended); returns the last view."""
        until = until or (lambda view: view["status"] in ENDED)
        deadline = time.monotonic() + timeout
        while True:
            view = self.get(f"/jobs/{job_id}").json()
            if until(view):
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {view}:\n{self.tail()}")
            time.sleep(0.2)

    # -- stopping ----------------------------------------------------------------------------
    def worker_pids(self) -> list[int]:
        pids = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if "spawn_main" in " ".join(child.cmdline()):
                    pids.append(child.pid)
            except psutil.Error:  # gone (or a zombie) meanwhile
                pass
        return pids

    def descendants(self) -> list[psutil.Process]:
        """Every process the server started (its workers, and Python's resource tracker)."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []

    def kill(self) -> list[int]:
        """SIGKILL the server process only; wait until its workers (and every other process it started) have exited
        too. Returns the workers' pids."""
        workers, others = self.worker_pids(), self.descendants()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        _, alive = psutil.wait_procs([psutil.Process(p) for p in workers if psutil.pid_exists(p)], timeout=30)
        assert not alive, f"workers {alive} outlived their server"
        psutil.wait_procs(others, timeout=30)
        return workers

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            others = self.descendants()
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
            psutil.wait_procs(others, timeout=30)
