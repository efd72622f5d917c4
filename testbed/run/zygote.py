"""The runner's side of the zygote (agents/runtime/zygote.py): start it, ask it for
agents, and hand each back as a Popen-like `ZygoteProcess`, so callers of
testbed/run/procs.py (AgentProcess: pid, poll, wait, communicate with timeouts,
send_signal, kill, returncode, args, stdout) do not change.

One zygote per run (docs/run-format.md, "Agent start-up"): the runner starts it before
`up`, so its imports overlap the bring-up, with the modules the run will use; every
`python -m agents.X` of that lab then forks from it. `TESTBED_ZYGOTE=0` turns it off
(every agent is its own `nsenter`/`ip netns exec` + `python -m`, as before). If it
cannot start, or dies, agents from then on are started by exec and the run says so in
a note: a start-up mechanism, not a fabric behaviour.

Exit statuses come from the zygote, which reaps its children and reports each
`pid -> returncode`. Each child also gets a pidfd here: signals go through it (never
to a reused pid), and it tells whether the child still lives once the zygote is gone
(its status is then unknown: ZYGOTE_LOST_RETURNCODE). A background thread reads the
zygote's messages; the zygote itself has none.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import json
import locale
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from agents.runtime.zygote import MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from agents.timebase import wall_timeout_s
from testbed.net.state import process_start_time

ENV_SWITCH = "TESTBED_ZYGOTE"
ZYGOTE_MODULE = "agents.runtime.zygote"
# Wall seconds for the zygote's imports (it starts while the fabric comes up).
READY_TIMEOUT_S = 20.0
# Wall seconds for one spawn's answer (a fork: milliseconds).
SPAWN_TIMEOUT_S = 10.0
# The returncode of a child whose zygote died before reporting it: unknown (its
# parent, who alone could know, is gone). 255, as `ssh` uses for "the channel died".
ZYGOTE_LOST_RETURNCODE = 255


class ZygoteError(RuntimeError):
    """The zygote could not do what was asked (it is gone, or refused)."""


def zygote_enabled(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether agents start from a zygote: `TESTBED_ZYGOTE` unset, 1 or on (default);
    0 or off starts each with exec. Anything else is an error naming the variable."""
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "1").strip().lower()
    if value in ("", "1", "on", "yes", "true"):
        return True
    if value in ("0", "off", "no", "false"):
        return False
    raise ValueError(f"environment {ENV_SWITCH}={value!r}: use 1 (fork agents from a "
                     "zygote, the default) or 0 (start every agent with exec)")


def module_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) if ARGV is `python -m MODULE ...` of this interpreter."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], list(argv[3:])
    return None


class Zygote:
    """One zygote process and the thread that reads its messages."""

    def __init__(self, popen: subprocess.Popen, sock: socket.socket, lab: str) -> None:
        self.popen = popen
        self.lab = lab
        # the run's agent modules: only they are forked from it (procs._from_zygote)
        self.modules: frozenset[str] | None = None
        self._sock = sock
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._statuses: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.ready: dict | None = None
        self.dead: str = ""             # why it can no longer serve ("" while it can)
        self.started_mono_ns = time.monotonic_ns()
        self.ready_mono_ns = 0
        self.recorded = False           # in the lab state yet
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(cls, lab: str, modules: list[str], log_path: Path | None = None) -> Zygote:
        """Start a zygote that preloads `modules` (it reads `__main__`'s imports); its
        stderr goes to `log_path` (else nowhere). Returns at once: the imports run while
        the caller goes on; the first spawn waits for them."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", ZYGOTE_MODULE, "--sock-fd", str(theirs.fileno()),
                "--parent-pid", str(os.getpid()), f"--lab={lab}", *modules]
        log: IO[bytes] | int = subprocess.DEVNULL
        try:
            if log_path is not None:
                log = open(log_path, "ab")     # noqa: SIM115 (closed below, once passed)
            popen = subprocess.Popen(argv, pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=log)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
            if not isinstance(log, int):
                log.close()
        zygote = cls(popen, ours, lab)
        zygote.modules = frozenset(modules)
        return zygote

    # --- messages ------------------------------------------------------------------

    def _read(self) -> None:
        reason = "its socket closed"
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
                if not data:
                    break
                msg = json.loads(data)
                with self._cond:
                    op = msg.get("op")
                    if op == "exit":
                        self._statuses[int(msg["pid"])] = int(msg["returncode"])
                    elif op in ("spawned", "error"):
                        self._replies[int(msg["id"])] = msg
                    elif op == "ready":
                        self.ready = msg
                        self.ready_mono_ns = time.monotonic_ns()
                    self._cond.notify_all()
        except (OSError, ValueError) as exc:
            reason = f"its socket failed ({exc})"
        code = self.popen.poll()
        if code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.popen.wait(0.5)
        with self._cond:
            if not self.dead:
                self.dead = (f"the zygote (pid {self.pid}) exited"
                             f"{'' if code is None else f' with code {code}'}: {reason}")
            self._cond.notify_all()

    def wait_ready(self, timeout_s: float | None = None) -> dict:
        """Its ready message, once its imports are done; ZygoteError if it died or took
        longer than `timeout_s` (wall; READY_TIMEOUT_S dilated by machine load)."""
        timeout_s = wall_timeout_s(READY_TIMEOUT_S) if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.ready is None:
                if self.dead:
                    raise ZygoteError(self.dead)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ZygoteError(f"the zygote (pid {self.pid}) was not ready "
                                      f"{timeout_s:g} s after it was started")
                self._cond.wait(left)
            if self.ready.get("version") != PROTOCOL_VERSION:
                raise ZygoteError(f"the zygote speaks protocol {self.ready.get('version')}, "
                                  f"the runner {PROTOCOL_VERSION}")
            return self.ready

    def status_of(self, pid: int) -> int | None:
        with self._cond:
            return self._statuses.get(pid)

    def spawn(self, module: str, argv: list[str], netns: str, keep_mounts: bool = False,
              stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE) -> ZygoteProcess:
        """Fork `python -m MODULE ARGV` in `netns` from the zygote; stdout/stderr as
        subprocess takes them (PIPE, DEVNULL, None, an fd or a file), stdin /dev/null.
        ZygoteError if the zygote cannot (the caller then starts it by exec)."""
        self.wait_ready()
        reads: list[int | None] = []    # our read ends of PIPEs
        opened: list[int] = []          # fds opened here to pass: closed once sent
        try:
            devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            opened.append(devnull)
            send = [devnull]
            for how, inherited in ((stdout, 1), (stderr, 2)):
                if how is subprocess.PIPE or how == subprocess.PIPE:
                    r, w = os.pipe2(os.O_CLOEXEC)
                    reads.append(r)
                    opened.append(w)
                    send.append(w)
                    continue
                reads.append(None)
                if how == subprocess.DEVNULL:
                    send.append(devnull)
                elif how is None:
                    send.append(inherited)
                else:
                    send.append(how if isinstance(how, int) else how.fileno())
            with self._send_lock:
                if self.dead:
                    raise ZygoteError(self.dead)
                rid = next(self._ids)
                msg = {"op": "spawn", "id": rid, "module": module, "argv": list(argv),
                       "netns": netns, "keep_mounts": keep_mounts}
                self._sock.sendmsg([json.dumps(msg).encode()], [(
                    socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", send))])
        except BaseException as exc:
            for fd in reads:
                if fd is not None:
                    os.close(fd)
            if isinstance(exc, OSError):
                raise ZygoteError(f"could not send to the zygote: {exc}") from exc
            raise
        finally:
            for fd in opened:
                os.close(fd)
        try:
            reply = self._reply(rid, wall_timeout_s(SPAWN_TIMEOUT_S))
        except ZygoteError:
            for fd in reads:
                if fd is not None:
                    os.close(fd)
            raise
        return ZygoteProcess(self, int(reply["pid"]), reply.get("start_time"),
                             [sys.executable, "-m", module, *argv], reads[0], reads[1])

    def _reply(self, rid: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while rid not in self._replies:
                if self.dead:
                    raise ZygoteError(self.dead)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            reply = self._replies.pop(rid, None)
        if reply is None:
            # a zygote that does not answer a fork in seconds is broken: it must not fork
            # an agent later that nobody records
            self.fail(f"the zygote (pid {self.pid}) did not answer a spawn in "
                      f"{timeout_s:g} s")
            raise ZygoteError(self.dead)
        if reply["op"] == "error":
            raise ZygoteError(f"the zygote refused: {reply.get('error')}")
        return reply

    def wait_change(self, timeout_s: float) -> None:
        """Wait (holding nothing) until a message arrives or `timeout_s` passes."""
        with self._cond:
            self._cond.wait(timeout_s)

    @property
    def cond(self) -> threading.Condition:
        return self._cond

    def fail(self, reason: str) -> None:
        """It can no longer serve: kill it (its children get SIGTERM, as from a dying
        runner) and remember why."""
        with self._cond:
            if not self.dead:
                self.dead = reason
            self._cond.notify_all()
        if self.popen.poll() is None:
            self.popen.kill()

    def close(self, timeout_s: float = 2.0) -> None:
        """End of the run: the zygote exits when its socket closes (an agent still
        running then gets SIGTERM from its parent's death)."""
        with self._cond:
            if not self.dead:
                self.dead = f"the zygote (pid {self.pid}) was closed"
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(timeout_s)
        self._sock.close()


class ZygoteProcess:
    """A child of the zygote, handled like subprocess.Popen (text mode)."""

    def __init__(self, zygote: Zygote, pid: int, start_time: str | None, args: list[str],
                 stdout_fd: int | None, stderr_fd: int | None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.args = args
        self.returncode: int | None = None
        self.stdin = None
        self._zygote = zygote
        self._encoding = locale.getpreferredencoding(False)
        self.stdout: IO[str] | None = (None if stdout_fd is None else
                                       open(stdout_fd, encoding=self._encoding,  # noqa: SIM115
                                            errors="replace"))
        self.stderr: IO[str] | None = (None if stderr_fd is None else
                                       open(stderr_fd, encoding=self._encoding,  # noqa: SIM115
                                            errors="replace"))
        self._chunks: dict[int, list[bytes]] = {fd: [] for fd in (stdout_fd, stderr_fd)
                                                if fd is not None}
        self._eof: set[int] = set()
        self._result: tuple[str | None, str | None] | None = None
        self._pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None        # gone already (its status is on its way) or not allowed
        if pidfd is not None and start_time is not None and process_start_time(pid) != start_time:
            os.close(pidfd)     # the pid is already someone else's
            pidfd = None
        self._pidfd = pidfd

    def _alive(self) -> bool:
        if self._pidfd is None:
            return (self.start_time is not None
                    and process_start_time(self.pid) == self.start_time)
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return not readable

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self._zygote.status_of(self.pid)
        if code is None and self._zygote.dead and not self._alive():
            code = ZYGOTE_LOST_RETURNCODE
        if code is not None:
            self.returncode = code
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = self._zygote.cond
        with cond:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)   # type: ignore[arg-type]
                # a dead zygote sends no more news: look at the pidfd now and then
                step = 0.05 if self._zygote.dead else 1.0
                cond.wait(step if left is None else min(left, step))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None or self._pidfd is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: str | None = None,    # noqa: A002 (Popen's name)
                    timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr to their end and wait for the exit, as Popen does: on
        TimeoutExpired what was read is kept for the next call."""
        if input:
            raise ValueError("a zygote child's stdin is /dev/null")
        if self._result is not None:
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in self._chunks:
                if fd not in self._eof:
                    sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)   # type: ignore[arg-type]
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        self._chunks[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
                        self._eof.add(key.fd)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self.wait(left)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout) from None   # type: ignore[arg-type]
        out = self._text(self.stdout)
        err = self._text(self.stderr)
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self._result = (out, err)
        return self._result

    def _text(self, stream: IO[str] | None) -> str | None:
        if stream is None:
            return None
        data = b"".join(self._chunks[stream.fileno()]).decode(self._encoding, "replace")
        return data.replace("\r\n", "\n").replace("\r", "\n")   # universal newlines


def start_run_zygote(lab: str, modules: list[str], log_path: Path | None
                     ) -> tuple[Zygote | None, str]:
    """A run's zygote, unless TESTBED_ZYGOTE=0: (the zygote or None, a note for the run
    if it was wanted and could not start)."""
    if not zygote_enabled():
        return None, ""
    try:
        return Zygote.start(lab, modules, log_path), ""
    except OSError as exc:
        return None, (f"agent start-up: the zygote could not start ({exc}); every agent was "
                      "started with exec (`python -m` in its namespace, as with "
                      "TESTBED_ZYGOTE=0) - a start-up mechanism only: the fabric and what the "
                      "agents do are the same")


def agent_start_record(wanted: bool, zygote: Zygote | None, counts: dict) -> dict:
    """timings.json's `agent_start` (docs/run-format.md): how the run's `python -m`
    agents were started; `wanted`: the zygote was asked for (TESTBED_ZYGOTE), `counts`:
    procs.zygote_counts."""
    requested = "zygote" if wanted else "exec"
    forked, executed = counts.get("forked", 0), counts.get("executed", 0)
    if zygote is None or (forked == 0 and executed > 0):
        path = "exec"
    elif executed:
        path = "zygote+exec"
    else:
        path = "zygote"
    ready_s = None
    if zygote is not None and zygote.ready_mono_ns:
        ready_s = round((zygote.ready_mono_ns - zygote.started_mono_ns) / 1e9, 6)
    return {"requested": requested, "path": path, "forked": forked, "executed": executed,
            "fallback": counts.get("fallback") or None, "zygote_ready_s": ready_s}
