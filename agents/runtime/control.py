"""Serve an agent's live counter snapshot on a UNIX socket.

A client connects, the agent writes one line of JSON (its counters now) and
closes. The socket file is created 0600 inside the run directory: counters
and control stay with whoever ran the fabric. The server is a daemon thread,
so it never keeps an agent alive.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable


class SnapshotServer:
    def __init__(self, path: str, snapshot: Callable[[], dict]) -> None:
        self.path = path
        self._snapshot = snapshot
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="snapshot", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(json.dumps(self._snapshot(), sort_keys=True).encode() + b"\n")
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
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
