"""pixal3d-guard: start one heavy command only when memory allows, and stop it before swap runs away.

``pixal3d-guard [options] -- COMMAND ...`` (or ``python -m pixal3d.guard``) waits until enough memory
is available and no busy process has been seen for a while, starts COMMAND in a process group of its
own, and watches it: when swap grows past a budget over its level at start, or available memory stays
under a floor for two polls in a row, it stops the whole group (SIGTERM, then SIGKILL after a grace).

It is an admission check and watchdog for one command, not a system OOM killer (earlyoom,
systemd-oomd or macos-oom-guard protect the whole machine): the only processes it ever signals are the
command it started and that command's process group. The command runs in a process group of its
own, so it must not read from the terminal; a process that leaves that group (setsid) is not
followed, and a SIGKILL of the guard itself leaves the command running.

Exit codes: 3 the guard stopped the command; 4 it never found room to start; 127 the command could not
be started; 128+N the guard got signal N (it stops the command first) or the command was ended by
signal N; otherwise the command's own exit status. Misuse of the options exits 2.

The decisions are pure functions (:func:`decide_start`, :func:`decide_stop`) of a :class:`Reading`;
the memory source and the busy-process finder are injectable, so tests can simulate swap growth and low
memory on machines that have no swap.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Self

import psutil

from pixal3d.telemetry.readers import system_memory
from pixal3d.telemetry.units import format_bytes, parse_duration, parse_size

logger = logging.getLogger("pixal3d.guard")

EXIT_STOPPED = 3
EXIT_NO_ROOM = 4
EXIT_CANNOT_START = 127
_SLICE = 0.05  # seconds between checks for a signal or the command's exit
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_LOG_EVERY = 60.0  # seconds between repeated "waiting" lines when nothing changes


# -- configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GuardConfig:
    """What the guard waits for and what makes it stop the command (percentages are 0-100)."""

    wait_free: float = 40.0
    busy: tuple[re.Pattern[str], ...] = ()
    quiet_for: float = 60.0
    start_timeout: float = 1800.0
    swap_budget: int = 8 * 2**30
    kill_free: float = 10.0
    poll: float = 5.0
    grace: float = 5.0

    def __post_init__(self) -> None:
        for name in ("wait_free", "kill_free"):
            if not 0 <= getattr(self, name) <= 100:
                raise ValueError(f"{name} must be a percentage from 0 to 100, got {getattr(self, name)}")
        if not self.poll > 0:
            raise ValueError(f"poll must be more than zero seconds, got {self.poll}")
        for name in ("quiet_for", "start_timeout", "grace", "swap_budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")


# -- pure decisions --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reading:
    """One poll: monotonic time, percent of memory available, swap bytes used (None: unknown), and the
    command lines of busy processes seen."""

    time: float
    available_percent: float | None
    swap_used: int | None
    busy: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """``action``: ``start``, ``wait`` or ``give_up`` before the start; ``run`` or ``stop`` after it."""

    action: str
    reasons: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """The reasons as one line."""
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class AdmissionState:
    """When the wait began, and since when no busy process has been seen (None: one is seen now)."""

    began: float
    quiet_since: float | None = None


def decide_start(config: GuardConfig, reading: Reading,
                 state: AdmissionState | None) -> tuple[Decision, AdmissionState]:
    """Start, wait or give up, from one reading and the wait so far (None on the first reading)."""
    state = state or AdmissionState(began=reading.time)
    if reading.busy:
        state = replace(state, quiet_since=None)
    elif state.quiet_since is None:
        state = replace(state, quiet_since=reading.time)
    reasons = []
    if reading.available_percent is not None and reading.available_percent < config.wait_free:
        reasons.append(f"memory available {reading.available_percent:.0f}% < {config.wait_free:g}%")
    if reading.busy:
        shown = ", ".join(repr(command[:80]) for command in reading.busy[:3])
        more = f" and {len(reading.busy) - 3} more" if len(reading.busy) > 3 else ""
        reasons.append(f"busy: {shown}{more}")
    elif config.busy and config.quiet_for > 0:
        quiet = reading.time - state.quiet_since
        if quiet < config.quiet_for:
            reasons.append(f"quiet for {quiet:.0f} s of {config.quiet_for:g} s")
    if not reasons:
        return Decision("start"), state
    if reading.time - state.began >= config.start_timeout:
        return Decision("give_up", tuple(reasons)), state
    return Decision("wait", tuple(reasons)), state


@dataclass(frozen=True)
class WatchState:
    """Swap used when the command started (None: unknown) and consecutive polls under ``kill_free``."""

    swap_at_start: int | None
    low_polls: int = 0


def decide_stop(config: GuardConfig, reading: Reading,
                state: WatchState) -> tuple[Decision, WatchState]:
    """Keep running or stop, from one reading while the command runs."""
    low = reading.available_percent is not None and reading.available_percent < config.kill_free
    state = replace(state, low_polls=state.low_polls + 1 if low else 0)
    reasons = []
    if reading.swap_used is not None and state.swap_at_start is not None:
        growth = reading.swap_used - state.swap_at_start
        if growth > config.swap_budget:
            reasons.append(f"swap grew {format_bytes(growth)} since the start "
                           f"> budget {format_bytes(config.swap_budget)}")
    if state.low_polls >= 2:
        reasons.append(f"memory available {reading.available_percent:.0f}% < "
                       f"{config.kill_free:g}% for {state.low_polls} polls in a row")
    return Decision("stop" if reasons else "run", tuple(reasons)), state


# -- what the guard reads --------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryReading:
    """What a memory source returns: percent available and swap bytes used (None: unknown)."""

    available_percent: float | None
    swap_used: int | None


def read_system_memory() -> MemoryReading:
    """The real source: MemAvailable (cgroup limit applied) on Linux, memorystatus_level on macOS."""
    memory = system_memory()
    return MemoryReading(memory.available_percent, memory.swap_used)


def own_lineage() -> set[int]:
    """This process and every process above it (the shells that started it mention the patterns)."""
    me = psutil.Process()
    return {me.pid, *(parent.pid for parent in me.parents())}


def find_busy(patterns: Sequence[re.Pattern[str]], exclude: set[int]) -> tuple[str, ...]:
    """Command lines of running processes (outside ``exclude``) that match any pattern."""
    if not patterns:
        return ()
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info.get("cmdline") or [])
        if process.info["pid"] not in exclude and command and any(p.search(command) for p in patterns):
            found.append(command)
    return tuple(found)


# -- signals and the process group -----------------------------------------------------------------
class _Signals:
    """Records SIGINT/SIGTERM/SIGHUP while the guard runs, so it can stop the command before exiting.

    A signal the guard was started to ignore (SIGHUP under nohup) stays ignored; handlers can only be
    installed on the main thread, elsewhere nothing is recorded."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for signum in _HANDLED_SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = previous
                    signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _group_members(pgid: int, leader: int) -> list[int]:
    """Live processes in group ``pgid`` other than its (possibly zombie) leader."""
    members = []
    for pid in psutil.pids():
        if pid == leader:
            continue
        try:
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.append(pid)
        except (OSError, psutil.Error):
            continue
    return members


def _leader_running(process: subprocess.Popen) -> bool:
    """Whether the leader still runs, without reaping it: its zombie keeps the group id reserved, so
    the id cannot be reused by an unrelated process while the guard still signals it."""
    if process.returncode is not None:
        return False
    if hasattr(os, "waitid"):
        try:
            return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False
    return process.poll() is None


def _group_alive(process: subprocess.Popen) -> bool:
    return _leader_running(process) or bool(_group_members(process.pid, process.pid))


def stop_group(process: subprocess.Popen, grace: float, signals: _Signals | None = None) -> None:
    """SIGTERM the command's process group, SIGKILL whatever is left after ``grace`` seconds (at once
    on a further signal to the guard), then reap the leader. The group is the one the guard created."""
    pgid = process.pid
    seen = len(signals.received) if signals else 0
    if process.returncode is None:  # a reaped leader's group id may already belong to someone else
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(process):
            if signals is not None and len(signals.received) > seen:
                logger.info("another signal: killing the group now")
                break
            time.sleep(_SLICE)
        if _group_alive(process):
            logger.info("group %d still running %.1f s after SIGTERM: sending SIGKILL", pgid, grace)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    process.wait()


# -- the run ---------------------------------------------------------------------------------------
MemorySource = Callable[[], MemoryReading]
BusyFinder = Callable[[Sequence[re.Pattern[str]], set[int]], tuple[str, ...]]


@dataclass
class _Run:
    config: GuardConfig
    command: list[str]
    memory: MemorySource
    busy: BusyFinder
    signals: _Signals
    lineage: set[int] = field(default_factory=set)

    def read(self) -> Reading:
        memory = self.memory()
        busy = self.busy(self.config.busy, self.lineage) if self.config.busy else ()
        return Reading(time.monotonic(), memory.available_percent, memory.swap_used, busy)

    def pause(self, seconds: float, process: subprocess.Popen | None = None) -> None:
        """Sleep up to ``seconds``, returning early on a signal or the command's exit."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.signals.received:
            if process is not None and process.poll() is not None:
                return
            time.sleep(min(_SLICE, max(deadline - time.monotonic(), 0)))

    def wait_for_room(self) -> Reading | int:
        """The reading that allowed the start, or an exit code (no room, or a signal)."""
        state, last_kinds, last_logged = None, None, float("-inf")
        while True:
            if self.signals.received:
                signum = self.signals.received[0]
                logger.info("got %s before starting the command", signal.Signals(signum).name)
                return 128 + signum
            reading = self.read()
            decision, state = decide_start(self.config, reading, state)
            if decision.action == "start":
                return reading
            if decision.action == "give_up":
                logger.info("no room after %.1f s (%s)", reading.time - state.began, decision.reason)
                return EXIT_NO_ROOM
            kinds = tuple(reason.split(" ")[0] for reason in decision.reasons)
            if kinds != last_kinds or reading.time - last_logged >= _LOG_EVERY:
                logger.info("waiting: %s", decision.reason)
                last_kinds, last_logged = kinds, reading.time
            else:
                logger.debug("waiting: %s", decision.reason)
            self.pause(self.config.poll)

    def start(self, reading: Reading) -> subprocess.Popen | int:
        config = self.config
        swap = format_bytes(reading.swap_used) if reading.swap_used is not None else "unknown"
        available = (f"{reading.available_percent:.0f}%" if reading.available_percent is not None
                     else "unknown")
        logger.info("starting %r: memory available %s (need %g%%), swap used %s; will stop it if swap "
                    "grows more than %s or memory available stays under %g%% for two polls",
                    " ".join(self.command), available, config.wait_free, swap,
                    format_bytes(config.swap_budget), config.kill_free)
        try:
            # process_group=0: the command leads a new group, so the guard can stop it with its
            # children, and a Ctrl-C in the terminal reaches the guard only (it stops the group).
            return subprocess.Popen(self.command, process_group=0)
        except OSError as error:
            logger.error("cannot start %r: %s", self.command[0], error.strerror or error)
            return EXIT_CANNOT_START

    def watch(self, process: subprocess.Popen, started: Reading) -> int:
        state = WatchState(swap_at_start=started.swap_used)
        while True:
            self.pause(self.config.poll, process)
            code = process.poll()
            if code is not None:
                if code < 0:
                    logger.info("command ended by %s", signal.Signals(-code).name)
                    return 128 - code
                logger.info("command exited with status %d", code)
                return code
            if self.signals.received:
                signum = self.signals.received[0]
                logger.info("got %s, stopping pid %d and its group", signal.Signals(signum).name,
                            process.pid)
                stop_group(process, self.config.grace, self.signals)
                return 128 + signum
            reading = self.read()
            decision, state = decide_stop(self.config, reading, state)
            logger.debug("watching: available %s%%, swap %s", reading.available_percent,
                         format_bytes(reading.swap_used))
            if decision.action == "stop":
                logger.info("stopping pid %d and its group: %s", process.pid, decision.reason)
                stop_group(process, self.config.grace, self.signals)
                return EXIT_STOPPED


def run_guarded(command: Sequence[str], config: GuardConfig | None = None, *,
                memory: MemorySource = read_system_memory, busy: BusyFinder = find_busy) -> int:
    """Wait for room, run ``command`` in its own process group, watch it; return the exit code."""
    if not command:
        raise ValueError("run_guarded needs a command to run")
    config = config or GuardConfig()
    with _Signals() as signals:
        run = _Run(config, list(command), memory, busy, signals,
                   own_lineage() if config.busy else set())
        reading = run.wait_for_room()
        if isinstance(reading, int):
            return reading
        process = run.start(reading)
        if isinstance(process, int):
            return process
        try:
            return run.watch(process, reading)
        except BaseException:
            # The command cannot be watched any more, so it must not keep running unwatched.
            if process.poll() is None:
                stop_group(process, config.grace)
            raise


# -- command line ----------------------------------------------------------------------------------
def _typed(parse: Callable[[str], Any], check: Callable[[Any], bool] | None = None,
           rule: str = "") -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if check is not None and not check(value):
            raise argparse.ArgumentTypeError(f"{text!r} {rule}")
        return value
    return convert


def _percent(text: str) -> float:
    try:
        return float(text.strip().rstrip("%"))
    except ValueError:
        raise ValueError(f"not a percentage: {text!r}; write a number from 0 to 100, e.g. 40") from None


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as error:
        raise ValueError(f"bad regex {text!r}: {error}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pixal3d-guard", usage="pixal3d-guard [options] -- COMMAND ...",
        description="Start COMMAND only when memory allows; stop it (and its process group) before "
                    "swap runs away. Exit codes: 3 stopped by the guard, 4 no room to start, 127 "
                    "cannot start, 128+N signal N, else the command's own.")
    percent = _typed(_percent, lambda v: 0 <= v <= 100, "is out of range: use 0 to 100")
    duration = _typed(parse_duration)
    parser.add_argument("--wait-free", type=percent, default=40.0, metavar="PCT",
                        help="start only when available memory is at least PCT%% (default 40)")
    parser.add_argument("--busy", type=_typed(_regex), action="append", default=[], metavar="REGEX",
                        help="processes whose command line matches count as heavy work; repeatable")
    parser.add_argument("--quiet-for", type=duration, default=60.0, metavar="DURATION",
                        help="with --busy: no busy process seen for this long before starting "
                             "(default 1m; restarts whenever one is seen)")
    parser.add_argument("--start-timeout", type=duration, default=1800.0, metavar="DURATION",
                        help="give up (exit 4) when there is no room for this long (default 30m)")
    parser.add_argument("--swap-budget", type=_typed(parse_size), default=8 * 2**30, metavar="SIZE",
                        help="stop the command when swap grows more than SIZE over its level at "
                             "the start (default 8G)")
    parser.add_argument("--kill-free", type=percent, default=10.0, metavar="PCT",
                        help="stop the command when available memory stays below PCT%% for two "
                             "polls in a row (default 10)")
    parser.add_argument("--poll", type=_typed(parse_duration, lambda v: v > 0, "must be more than "
                                              "zero"), default=5.0, metavar="DURATION",
                        help="how often to read memory (default 5s)")
    parser.add_argument("--grace", type=duration, default=5.0, metavar="DURATION",
                        help="time between SIGTERM and SIGKILL when stopping (default 5s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``pixal3d-guard``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "--" in argv:
        split = argv.index("--")
        args = parser.parse_args(argv[:split])
        if args.command:
            parser.error(f"unexpected arguments before '--': {args.command}")
        args.command = argv[split + 1:]
    else:
        args = parser.parse_args(argv)
    if not args.command:
        parser.error("the guard needs a command after '--', e.g. pixal3d-guard -- python run.py")
    config = GuardConfig(wait_free=args.wait_free, busy=tuple(args.busy), quiet_for=args.quiet_for,
                         start_timeout=args.start_timeout, swap_budget=args.swap_budget,
                         kill_free=args.kill_free, poll=args.poll, grace=args.grace)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pixal3d-guard %(asctime)sZ %(message)s", "%H:%M:%S"))
    handler.formatter.converter = time.gmtime
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return run_guarded(args.command, config)


if __name__ == "__main__":
    sys.exit(main())
