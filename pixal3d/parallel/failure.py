"""When one rank fails, every rank stops within a bounded time, saying which rank failed and why.

A collective job hangs by default: a rank that raises leaves its peers blocked in receives that will
never complete (xDiT's users report exactly this). Here:

* the failing rank posts ``"rank r failed: <Type>: <message>"`` on a notice board in the job's c10d
  store (the first failure wins), waits up to ``grace_s`` for the others to acknowledge (the store may
  live in its process), then re-raises its own error;
* every wait of every rank (``wait_work``) polls the board while it waits and raises
  ``PeerFailedError`` quoting the notice as soon as it appears;
* a peer that dies without posting (killed, crashed) breaks its connections: the waits on it raise
  ``LinkError`` naming it; one that hangs is caught by the timeout (``TimeoutError`` naming the rank
  waited for).

On CPU/gloo a wait runs in a helper thread so the calling thread can watch the board; CUDA/NCCL
waits are stream-ordered and return at once, so there only the NCCL timeout bounds a hang (not
measured here: no GPU).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

POLL_S = 0.05         # how often a waiting thread wakes up
BOARD_POLL_S = 0.2    # how often it reads the store


class PeerFailedError(RuntimeError):
    """Another rank failed; this rank stops too. The message names that rank and its error."""


class LinkError(RuntimeError):
    """A transfer with rank ``peer`` failed (its process is gone or its connection broke)."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class FailureBoard:
    """The notice board of one request, in the job's store: who failed first, who has read it."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, request: int, *, grace_s: float = 10.0,
                 name: Callable[[int], str] = "rank {}".format):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.name = name  # how notices name a rank (its data group too, in a job of several)
        self.prefix = f"request{request}/"
        self.grace_s = grace_s
        self._next_poll = 0.0
        self._acked = False
        self.settled = False  # a failure of this request was posted or read here: nothing more to tell

    def _key(self, name: str) -> str:
        return self.prefix + name

    def check(self) -> None:
        """Raise ``PeerFailedError`` if a failure has been posted (reads the store at most every 0.2 s)."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + BOARD_POLL_S
        try:
            posted = self.store.check([self._key("failures")])
        except Exception:  # the store is gone with its host: the waits will report the broken links
            return
        if posted:
            self.settled = True
            notice = self._read_and_ack()
            self._wait_for_acks()
            raise PeerFailedError(f"{self.name(self.rank)} stopped: {notice}")

    def report(self, err: BaseException) -> str:
        """Post this rank's failure (unless another was first); return the notice everybody sees.

        Every rank that stops waits (up to ``grace_s``) until all have read the notice before it
        returns: the store may live in its process, and its exit closes the connections that the
        others would otherwise see break before they read why."""
        self.settled = True
        if isinstance(err, LinkError):
            notice = f"{self.name(err.peer)} is gone ({self.name(self.rank)}: {err})"
        else:
            notice = f"{self.name(self.rank)} failed: {type(err).__name__}: {err}"
        try:
            if self.store.add(self._key("failures"), 1) == 1:
                gone = 1 if isinstance(err, LinkError) else 0  # a dead rank never acknowledges
                self.store.set(self._key("readers"), str(self.world_size - 1 - gone))
                self.store.set(self._key("notice"), notice)
            else:
                notice = self._read_and_ack()
            self._wait_for_acks()
        except Exception as store_err:  # the store's host died: nothing more to tell anybody
            logger.debug("failure board unavailable: %s", store_err)
        return notice

    def _read_and_ack(self) -> str:
        try:
            self.store.wait([self._key("notice")], timedelta(seconds=self.grace_s))
            notice = self.store.get(self._key("notice")).decode()
            if not self._acked:
                self._acked = True
                self.store.add(self._key("acks"), 1)
            return notice
        except Exception:
            return "another rank failed (its notice could not be read)"

    def _wait_for_acks(self) -> None:
        """Until every live rank has read the notice (or ``grace_s``); a vanished store ends the wait."""
        deadline = time.monotonic() + self.grace_s
        try:
            readers = int(self.store.get(self._key("readers")))
            while self.store.add(self._key("acks"), 0) < readers and time.monotonic() < deadline:
                time.sleep(POLL_S)
        except Exception as store_err:  # its host (a rank that had read the notice too) has exited
            logger.debug("failure board closed: %s", store_err)


def wait_work(work: Any, *, board: FailureBoard, timeout_s: float, what: str, peer: int, threaded: bool) -> None:
    """Wait for a c10d ``Work`` with rank ``peer`` while watching the failure board; errors name the
    peer and ``what`` was awaited."""
    if not threaded:
        work.wait()
        board.check()
        return
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            work.wait()
        except BaseException as err:  # reported by the waiting thread below
            errors.append(err)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="pixal3d-parallel-wait").start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(POLL_S):
        board.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {board.rank}: {what}: nothing after {timeout_s:.0f} s (is rank {peer} "
                               f"stuck? raise the parallel timeout if its work legitimately takes longer)")
    if errors:
        board.check()  # a posted failure explains a broken link better than the link error does
        raise LinkError(f"{what} failed: {errors[0]}", peer) from errors[0]
