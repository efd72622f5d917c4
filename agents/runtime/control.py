"""An agent's UNIX sockets: its live counter snapshot, and commands to it.

- Snapshots (--control-sock): a client connects, the agent writes one line of
  JSON (its counters now) and closes.
- Commands (--command-sock, `serve_commands` / `send_command`): a client sends
  one JSON object on one line, the agent answers one JSON line,
  `{"ok": true, ...}` or `{"ok": false, "error": "..."}`, and closes. A
  request that is not JSON, not an object, has no "op", is larger than
  MAX_REQUEST_BYTES or makes the handler raise is answered with ok false: a
  bad client can never stop the agent.

Socket files are created 0600 inside the run directory: counters and control
stay with whoever ran the fabric. Peers are identified by their credentials
(SO_PEERCRED): only a process of the agent's own user, or root, is served; any
other is refused. Every refusal is said once per reason on stderr and counted
per reason in the server's `refused` (docs/pfc.md "Commands"); the PFC agent
reports its command socket's as `command_refused` in its snapshot and --out;
every agent's snapshot carries its snapshot socket's as `snapshot_refused` (per reason)
and `snapshot_refused_total`, once it has refused anyone.
Servers are daemon threads, so they never keep an agent alive.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agents.runtime.messages import MAX_MESSAGE_DEPTH, BadMessage, decode_message
from agents.timebase import wall_timeout_s

MAX_REQUEST_BYTES = 64 * 1024     # one command line; an agent's commands are a few hundred B
REQUEST_TIMEOUT_S = 2.0           # a client that connects and says nothing is dropped
MAX_CLIENTS = 16                  # connections served at once; more are told to retry


def _bind_private(path: str, backlog: int = 8) -> socket.socket:
    """A listening UNIX stream socket at `path` (replacing a stale file), mode 0600."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(backlog)
    return sock


_UCRED = struct.Struct("3i")        # struct ucred: pid, uid, gid


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of a UNIX socket (None if unknown)."""
    try:
        _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    except (OSError, struct.error):
        return None
    return uid


class _UnixServer:
    """A private listening socket at `path` and a daemon thread accepting on it; each
    connection from an allowed peer (same uid, or root) goes to `_accepted`, others are
    refused (`refused["peer"]`). `close()` stops it and removes the socket file."""

    def __init__(self, path: str, name: str, backlog: int = 8) -> None:
        self.path = path
        self.name = name
        #: refusals per reason (counter keys: docs/pfc.md "Commands")
        self.refused: dict[str, int] = {}
        self._refused_lock = threading.Lock()
        self._uid = os.geteuid()
        self._sock = _bind_private(path, backlog)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def refuse(self, reason: str, detail: str) -> None:
        """Count a refusal; the first of each reason is said on stderr."""
        with self._refused_lock:
            first = reason not in self.refused
            self.refused[reason] = self.refused.get(reason, 0) + 1
        if first:
            print(f"{self.name} socket {self.path}: refused ({reason}): {detail} "
                  "(further ones of this reason are counted only)", file=sys.stderr, flush=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            uid = peer_uid(conn)
            if uid is None or uid not in (self._uid, 0):
                self.refuse("peer", f"a process of uid {uid} (served: {self._uid} and root)")
                conn.close()
                continue
            self._accepted(conn)

    def _accepted(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class SnapshotServer(_UnixServer):
    def __init__(self, path: str, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot
        super().__init__(path, "snapshot")

    def _accepted(self, conn: socket.socket) -> None:
        with conn:
            snap = self._snapshot()
            if self.refused:
                # every agent's snapshot says whom its socket turned away (only once it
                # has, so the snapshots of a clean run keep their keys)
                with self._refused_lock:
                    refused = dict(self.refused)
                snap = {**snap, "snapshot_refused": refused,
                        "snapshot_refused_total": sum(refused.values())}
            try:
                conn.sendall(json.dumps(snap, sort_keys=True).encode() + b"\n")
            except OSError:
                pass


def serve_snapshots(path: str | None, snapshot: Callable[[], dict]) -> SnapshotServer | None:
    """A SnapshotServer on `path` (--control-sock), or None when no path was given."""
    return SnapshotServer(path, snapshot) if path else None


def read_snapshot(path: str, timeout_s: float = 0.5) -> dict:
    """Client side: one snapshot from an agent's socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    return json.loads(b"".join(chunks))


@dataclass(frozen=True)
class _NoRequest:
    """Why a connection gave no request line; `unread`: the client is still sending.
    `reason`: its counter key."""

    error: str
    unread: bool = False
    reason: str = "read_error"


class CommandServer(_UnixServer):
    """Answers one JSON request line per connection with `handler(request)`.

    The handler runs in a server thread (one per connection, at most MAX_CLIENTS
    at once); an agent whose state belongs to its main loop hands the request to
    that loop (`CommandInbox`). Whatever the handler returns is sent back with
    "ok" true unless it says otherwise; an exception becomes ok false.
    """

    def __init__(self, path: str, handler: Callable[[dict], dict]) -> None:
        self._handler = handler
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(path, "commands", backlog=64)

    def _accepted(self, conn: socket.socket) -> None:
        if not self._slots.acquire(blocking=False):
            self.refuse("busy", f"more than {MAX_CLIENTS} clients at once")
            self._answer(conn, {"ok": False, "error": "busy: too many clients"})
            conn.close()
            return
        threading.Thread(target=self._client, args=(conn,), name="command",
                         daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(wall_timeout_s(REQUEST_TIMEOUT_S))
            try:
                line = self._read_line(conn)
                reply = self._reply(line)
            finally:
                # Free the slot before answering: a client that has its answer may
                # connect again at once, before this thread is done closing.
                self._slots.release()
            self._answer(conn, reply)
            if isinstance(line, _NoRequest) and line.unread:
                self._discard(conn)

    @staticmethod
    def _discard(conn: socket.socket, limit_bytes: int = 16 * MAX_REQUEST_BYTES) -> None:
        """Read (and drop) the rest of an oversized request: closing with it unread would
        reset the connection before the client reads its answer."""
        try:
            conn.shutdown(socket.SHUT_WR)
            left = limit_bytes
            while left > 0:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                left -= len(chunk)
        except OSError:
            pass

    @staticmethod
    def _read_line(conn: socket.socket) -> bytes | _NoRequest:
        """The request line, or why there is none."""
        data = bytearray()
        try:
            while b"\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
                if len(data) > MAX_REQUEST_BYTES:
                    return _NoRequest(f"request larger than {MAX_REQUEST_BYTES} bytes",
                                      unread=True, reason="too_large")
        except TimeoutError:
            return _NoRequest(f"no request line within {wall_timeout_s(REQUEST_TIMEOUT_S):g} s",
                              reason="silent")
        except OSError as exc:
            return _NoRequest(f"reading the request: {exc}")
        line = bytes(data).split(b"\n", 1)[0]
        if len(line) > MAX_REQUEST_BYTES:
            return _NoRequest(f"request larger than {MAX_REQUEST_BYTES} bytes", unread=True,
                              reason="too_large")
        return line

    def _reply(self, line: bytes | _NoRequest) -> dict:
        reply = self._checked_reply(line)
        if not reply.get("ok"):
            self.refuse(reply.pop("_reason", "refused_by_handler"), str(reply.get("error")))
        return reply

    def _checked_reply(self, line: bytes | _NoRequest) -> dict:
        if isinstance(line, _NoRequest):
            return {"ok": False, "error": line.error, "_reason": line.reason}
        try:
            request = decode_message(line, MAX_REQUEST_BYTES, MAX_MESSAGE_DEPTH)
        except BadMessage as exc:
            error = ("a request is a JSON object" if exc.reason == "not_object" else str(exc))
            return {"ok": False, "error": error, "_reason": exc.reason}
        if not isinstance(request.get("op"), str):
            return {"ok": False, "error": 'a request names its "op"', "_reason": "no_op"}
        try:
            reply = self._handler(request)
        except Exception as exc:   # noqa: BLE001 - a bad request must never stop the agent
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "_reason": "handler_error"}
        if not isinstance(reply, dict):
            return {"ok": False, "error": "handler returned no object",
                    "_reason": "handler_error"}
        return {"ok": True, **reply}

    @staticmethod
    def _answer(conn: socket.socket, reply: dict) -> None:
        try:
            conn.sendall(json.dumps(reply, sort_keys=True, default=str).encode() + b"\n")
        except OSError:
            pass           # the client left; nothing to tell


def command_refusals(server: _UnixServer | None) -> dict:
    """`command_refused` (per reason) and `command_refused_total` of a command socket,
    for an agent's snapshot and --out (empty and 0 without one)."""
    refused = dict(server.refused) if server is not None else {}
    return {"command_refused": refused, "command_refused_total": sum(refused.values())}


def serve_commands(path: str | None, handler: Callable[[dict], dict]) -> CommandServer | None:
    """A CommandServer on `path` (--command-sock), or None when no path was given."""
    return CommandServer(path, handler) if path else None


def send_command(path: str, request: dict, timeout_s: float = 2.0) -> dict:
    """Client side: send one request, return the agent's reply.

    Never raises for the agent's or the socket's failures: no socket, a refused or
    timed-out connection, or a reply that is not one JSON object come back as
    `{"ok": False, "error": ...}`, so a caller handles every failure in one place.
    """
    try:
        line = json.dumps(request).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        return {"ok": False, "error": f"request not JSON-serialisable: {exc}"}
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            while True:
                try:
                    sock.connect(path)
                    break
                except BlockingIOError:
                    # The server's backlog is full (a burst of clients): a UNIX socket
                    # with a timeout says EAGAIN instead of waiting. Retry until due.
                    if time.monotonic() >= deadline:
                        raise TimeoutError("the agent's command backlog stayed full") from None
                    time.sleep(0.002)
            sock.sendall(line)
            data = bytearray()
            while b"\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:           # TimeoutError and FileNotFoundError included
        return {"ok": False, "error": f"{path}: {exc or type(exc).__name__}"}
    try:
        reply = json.loads(bytes(data).split(b"\n", 1)[0])
    except ValueError:
        return {"ok": False, "error": f"{path}: reply is not JSON: {bytes(data[:200])!r}"}
    if not isinstance(reply, dict):
        return {"ok": False, "error": f"{path}: reply is not a JSON object"}
    return reply


class CommandInbox:
    """Hands requests from CommandServer threads to an agent's main loop.

    `submit` (a server thread) queues a request and waits for its reply; the loop
    selects on `fileno()` and calls `run(handler)`, which answers every queued
    request in the loop's thread, so commands never race the loop's state.
    """

    def __init__(self, timeout_s: float = 1.5) -> None:
        self.timeout_s = timeout_s
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._queue: list[tuple[dict, dict, threading.Event]] = []

    def fileno(self) -> int:
        return self._read_fd

    def submit(self, request: dict) -> dict:
        box: dict = {}
        done = threading.Event()
        with self._lock:
            self._queue.append((request, box, done))
        try:
            os.write(self._write_fd, b"x")
        except BlockingIOError:
            pass               # the pipe is full of wake-ups already
        if not done.wait(self.timeout_s):
            raise TimeoutError(f"the agent did not take the request in {self.timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["reply"]

    def run(self, handler: Callable[[dict], dict]) -> int:
        """Answer every queued request with `handler` (in the caller's thread)."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            queue, self._queue = self._queue, []
        for request, box, done in queue:
            try:
                box["reply"] = handler(request)
            except Exception as exc:   # noqa: BLE001 - handed back to the client's thread
                box["error"] = exc
            done.set()
        return len(queue)

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
