"""The common start, given once every sender is armed: `--start-file` and `--armed-file`.

A run's senders must begin at one agreed CLOCK_MONOTONIC instant t0. Fixing t0 before
they start means guessing how long their interpreters, imports, sockets and connections
take, and the guess has to be generous on a loaded 2-CPU machine (it was most of a
short run's wall time). Instead the run starts every sender with

    --start-file RUN/agents/start/t0.json  --armed-file RUN/agents/NAME.armed
    [--start-offset-ns WALL_NS]

(the start file alone in its directory: every waiting agent is woken by what happens in
that directory, and the armed files of a hundred agents must not wake them all)

and each sender, once everything before its first packet is done (sockets, QPs,
connections, buffers), calls `await_start`:

1. it writes its armed file (`{"armed_mono_ns": ...}`, atomically);
2. it sleeps until the start file exists (inotify on its directory, so the wake-up is
   prompt without polling; a short poll where inotify is not available), reads t0 from
   it, and rewrites its armed file with the moment it saw it (`go_seen_mono_ns`);
3. it waits until t0 + its offset (`agents.runtime.waiting.wait_until_mono`).

The run waits for every sender's armed file, then writes the start file with t0 = now
+ a margin that covers waking them all (testbed/run/runner.py `go_margin_s`). An agent
that saw t0 after its own start time began late by the difference; the run reads the
armed files afterwards and names each one (runner.late_senders). Without --start-file
an agent takes `--start-at-mono-ns` as before (0: at once), which is how agents run by
hand or in tests.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import select
import time
from collections.abc import Callable

from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import write_json_atomically
from agents.runtime.waiting import wait_until_mono

#: Longest single wait for the start file, so stop requests and the parent check stay
#: responsive (as agents.runtime.waiting.MAX_SLEEP_NS).
WAIT_SLICE_S = 0.05
#: Poll period where inotify cannot be used.
POLL_S = 0.002

_IN_MOVED_TO = 0x00000080
_IN_CLOSE_WRITE = 0x00000008
_IN_CREATE = 0x00000100
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000


def add_start_arguments(parser: argparse.ArgumentParser) -> None:
    """The start-signal flags every sender agent takes (see the module docstring)."""
    parser.add_argument("--start-file", metavar="FILE", default=None,
                        help="wait for FILE (JSON {\"t0_mono_ns\": T}) after arming and "
                             "start at T + --start-offset-ns; overrides --start-at-mono-ns")
    parser.add_argument("--armed-file", metavar="FILE", default=None,
                        help="written once the agent is set up and waits for the start")
    parser.add_argument("--start-offset-ns", type=int, default=0, metavar="WALL_NS",
                        help="wall ns after the start file's t0 to begin (the entry's "
                             "own start time, converted by the run)")


def read_start_file(path: str) -> int | None:
    """t0 from a start file, or None while it does not exist (it is written atomically)."""
    try:
        with open(path) as f:
            return int(json.load(f)["t0_mono_ns"])
    except FileNotFoundError:
        return None


def write_start_file(path: str, t0_mono_ns: int) -> None:
    """The run's side: publish t0 (atomically: a reader sees all of it or nothing)."""
    write_json_atomically(path, {"t0_mono_ns": t0_mono_ns})


class _Inotify:
    """The start file's directory, watched for the file being moved or written in."""

    def __init__(self, directory: str) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.fd = fd
        wd = libc.inotify_add_watch(fd, os.fsencode(directory),
                                    _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_CREATE)
        if wd < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch {directory}")

    def wait(self, timeout_s: float) -> None:
        """Until something happened in the directory, or timeout_s."""
        ready, _w, _x = select.select([self.fd], [], [], timeout_s)
        if ready:
            try:
                while os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        os.close(self.fd)


def wait_for_start_file(path: str, life: Lifecycle,
                        clock_ns: Callable[[], int] = time.monotonic_ns) -> int | None:
    """t0 once `path` exists; None if a stop was requested first."""
    try:
        watcher: _Inotify | None = _Inotify(os.path.dirname(os.path.abspath(path)))
    except OSError:
        watcher = None          # no inotify here: a short poll instead
    try:
        while True:
            t0 = read_start_file(path)
            if t0 is not None:
                return t0
            if life.should_stop(clock_ns()):
                return None
            if watcher is not None:
                watcher.wait(WAIT_SLICE_S)
            else:
                time.sleep(POLL_S)
    finally:
        if watcher is not None:
            watcher.close()


def await_start(args: argparse.Namespace, life: Lifecycle,
                clock_ns: Callable[[], int] = time.monotonic_ns) -> int:
    """Arm, wait for the run's start signal, then for this agent's start time; returns
    that start time (CLOCK_MONOTONIC ns; 0: started at once). Sets
    `args.start_at_mono_ns` to it, so the agent's later arithmetic is unchanged."""
    start_file = getattr(args, "start_file", None)
    if start_file:
        armed = getattr(args, "armed_file", None)
        armed_ns = clock_ns()
        if armed:
            write_json_atomically(armed, {"armed_mono_ns": armed_ns})
        t0 = wait_for_start_file(start_file, life, clock_ns)
        if t0 is None:
            return 0                # stopped before the start
        seen_ns = clock_ns()
        start = t0 + int(getattr(args, "start_offset_ns", 0) or 0)
        if armed:
            write_json_atomically(armed, {"armed_mono_ns": armed_ns, "go_seen_mono_ns": seen_ns,
                                          "start_mono_ns": start})
        args.start_at_mono_ns = start
    start = int(getattr(args, "start_at_mono_ns", 0) or 0)
    wait_until_mono(start, life, clock_ns)
    return start


def read_armed_file(path: str) -> dict | None:
    """An armed file's content, or None if the agent never armed."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


__all__ = ["add_start_arguments", "await_start", "read_armed_file", "read_start_file",
           "wait_for_start_file", "write_start_file"]
