"""An agent's events file (--events): JSON lines the run's collector imports as it samples.

Each line is one JSON object: `kind`, `mono_ns` (CLOCK_MONOTONIC ns of the event; the
collector turns it into fabric time since the run's t0) and the kind's own fields. The
collector reads a file up to its last newline at every sample, so a line it sees is
always whole.

`EventLog` keeps file writes off the agent's data path: `emit` only appends the event
to a list; a daemon thread writes what has gathered every `flush_wall_ns` (default
100 ms of wall time), as whole lines in one `write` per batch, and `close` writes the
rest. A pathological configuration cannot fill the disk: after `max_events` events the
rest are counted (`dropped`), not written, and the first drop is said once on stderr. A
write that fails (a full disk) is said once too; that batch and every later event count
as dropped, and the agent goes on.
"""

from __future__ import annotations

import json
import os
import sys
import threading

#: Wall ns between two writes of the gathered events.
FLUSH_WALL_NS = 100_000_000
#: Events one agent writes at most; a line is ~250 bytes, so this bounds a file at ~2.5 MB.
MAX_EVENTS = 10_000


class EventLog:
    """Buffered, capped JSON-lines events file; with `path` None, `emit` does nothing.

    `start()` starts the flushing thread (without it, events are written by `flush()`
    and `close()` alone, which is how tests drive it)."""

    def __init__(self, path: str | None, max_events: int = MAX_EVENTS,
                 flush_wall_ns: int = FLUSH_WALL_NS, who: str = "agent") -> None:
        self.path = path
        self.max_events = max_events
        self.flush_wall_ns = flush_wall_ns
        self.who = who
        self.accepted = 0           # events taken (written, or waiting to be)
        self.written = 0
        self.dropped = 0            # events beyond max_events
        self._pending: list[tuple[str, int, dict]] = []
        self._lock = threading.Lock()        # _pending: emit (any thread) vs the flusher
        self._write_lock = threading.Lock()  # one batch at a time, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self.error: str | None = None        # why writing stopped
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def start(self) -> EventLog:
        if self._fd is not None and self._thread is None:
            self._thread = threading.Thread(target=self._flusher, name="events", daemon=True)
            self._thread.start()
        return self

    def emit(self, kind: str, mono_ns: int, **detail: object) -> None:
        """Note one event that happened at `mono_ns`; written by the next flush."""
        if not self.path:
            return
        with self._lock:
            if self.accepted >= self.max_events or self.error is not None:
                self.dropped += 1
                first = self.dropped == 1 and self.error is None
            else:
                self.accepted += 1
                self._pending.append((kind, mono_ns, detail))
                return
        if first:
            print(f"{self.who}: {self.max_events} events written, later ones are counted "
                  "(events_dropped), not written", file=sys.stderr)

    def flush(self) -> None:
        """Write every event gathered so far: whole lines, one write per batch."""
        with self._write_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            if self._fd is None:          # closed, or a write failed
                with self._lock:
                    self.dropped += len(batch)
                return
            text = "".join(json.dumps({"kind": kind, "mono_ns": mono_ns, **detail},
                                      separators=(",", ":")) + "\n"
                           for kind, mono_ns, detail in batch)
            data = memoryview(text.encode())
            try:
                while data:
                    data = data[os.write(self._fd, data):]
            except OSError as e:      # a full disk: stop writing, keep the agent running
                with self._lock:
                    self.error = f"{self.path}: {e}"
                    self.dropped += len(batch)
                os.close(self._fd)
                self._fd = None
                print(f"{self.who}: events file {self.error}; later events are counted "
                      "(events_dropped), not written", file=sys.stderr)
                return
            self.written += len(batch)

    def _flusher(self) -> None:
        while not self._stop.wait(self.flush_wall_ns / 1e9):
            self.flush()

    def close(self) -> None:
        """Stop the flusher and write what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.flush()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def counters(self) -> dict[str, int]:
        return {"events_written": self.written, "events_dropped": self.dropped}
