"""The run directory's time-series database: `counters.sqlite`.

Written as samples are taken (WAL mode, one transaction per sample), so a
run killed with SIGKILL still leaves a database that opens and holds every
sample up to the last one. Readers check the format version and refuse a
newer one.

Tables
- meta(key, value): format_version, lab, dilation, ...
- samples(ts_fabric_ns, ts_wall_ns, node, port, tclass, counter, value):
  one row per counter per sample; `port` is '' for node-wide counters and
  `tclass` is -1 where the counter is not per class. Counters are cumulative
  as read (bytes, packets, drops ...) or instantaneous (backlog_bytes, rates).
- events(ts_fabric_ns, ts_wall_ns, node, port, tclass, kind, detail): phase
  marks, pauses, faults, fidelity problems; `detail` is JSON.
- results(workload, kind, row): one JSON row per workload result.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

STORE_FORMAT_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (
    ts_fabric_ns INTEGER NOT NULL, ts_wall_ns INTEGER NOT NULL,
    node TEXT NOT NULL, port TEXT NOT NULL, tclass INTEGER NOT NULL,
    counter TEXT NOT NULL, value REAL NOT NULL);
CREATE INDEX IF NOT EXISTS samples_by_series ON samples (node, port, tclass, counter, ts_fabric_ns);
CREATE TABLE IF NOT EXISTS events (
    ts_fabric_ns INTEGER NOT NULL, ts_wall_ns INTEGER NOT NULL,
    node TEXT NOT NULL, port TEXT NOT NULL, tclass INTEGER NOT NULL,
    kind TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (workload TEXT NOT NULL, kind TEXT NOT NULL, row TEXT NOT NULL);
"""


class StoreVersionError(RuntimeError):
    """The database was written by a newer testbed."""


@dataclass(frozen=True)
class Sample:
    node: str
    port: str
    tclass: int
    counter: str
    value: float


class Store:
    """Append-only writer (and simple reader) of one run's counters.sqlite."""

    def __init__(self, path: Path, create: bool = False) -> None:
        self.path = Path(path)
        if create:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            os.close(fd)
        elif not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no counters database")
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        # The run's main thread (phase events) and the collector thread
        # (samples) share this connection; sqlite3 connections are not safe
        # for concurrent use, so every access takes this lock.
        self.lock = threading.RLock()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        if create:
            self.db.executescript(SCHEMA)
            self.set_meta("format_version", str(STORE_FORMAT_VERSION))
            self.db.commit()
        else:
            version = int(self.meta().get("format_version", "0"))
            if version > STORE_FORMAT_VERSION:
                raise StoreVersionError(
                    f"{self.path}: counters format {version} is newer than this testbed reads "
                    f"({STORE_FORMAT_VERSION}); upgrade the testbed to read this run")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # writing
    def set_meta(self, key: str, value: str) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def add_samples(self, ts_fabric_ns: int, ts_wall_ns: int, samples: Iterable[Sample]) -> None:
        with self.lock, self.db:
            self.db.executemany(
                "INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(ts_fabric_ns, ts_wall_ns, s.node, s.port, s.tclass, s.counter, s.value)
                 for s in samples])

    def add_event(self, ts_fabric_ns: int, ts_wall_ns: int, kind: str, node: str = "",
                  port: str = "", tclass: int = -1, **detail: object) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (ts_fabric_ns, ts_wall_ns, node, port, tclass, kind,
                             json.dumps(detail, sort_keys=True)))

    def add_result(self, workload: str, kind: str, row: dict) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT INTO results VALUES (?, ?, ?)",
                            (workload, kind, json.dumps(row, sort_keys=True)))

    # reading
    def meta(self) -> dict[str, str]:
        with self.lock:
            return dict(self.db.execute("SELECT key, value FROM meta"))

    def series(self, counter: str, node: str | None = None, port: str | None = None,
               tclass: int | None = None) -> dict[tuple[str, str, int], list[tuple[int, float]]]:
        """{(node, port, tclass): [(ts_fabric_ns, value), ...]} for one counter."""
        query = "SELECT node, port, tclass, ts_fabric_ns, value FROM samples WHERE counter = ?"
        args: list = [counter]
        for name, value in (("node", node), ("port", port), ("tclass", tclass)):
            if value is not None:
                query += f" AND {name} = ?"
                args.append(value)
        out: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
        with self.lock:
            rows = self.db.execute(query + " ORDER BY ts_fabric_ns", args).fetchall()
        for n, p, t, ts, v in rows:
            out.setdefault((n, p, t), []).append((ts, v))
        return out

    def last_values(self, counter: str) -> dict[tuple[str, str, int], float]:
        with self.lock:
            rows = self.db.execute(
                "SELECT node, port, tclass, value FROM samples s WHERE counter = ? AND "
                "ts_fabric_ns = (SELECT MAX(ts_fabric_ns) FROM samples WHERE counter = s.counter "
                "AND node = s.node AND port = s.port AND tclass = s.tclass)", (counter,)).fetchall()
        return {(n, p, t): v for n, p, t, v in rows}

    def counters(self) -> list[str]:
        with self.lock:
            rows = self.db.execute("SELECT DISTINCT counter FROM samples ORDER BY 1").fetchall()
        return [r[0] for r in rows]

    def events(self, kind: str | None = None) -> list[dict]:
        query = "SELECT ts_fabric_ns, ts_wall_ns, node, port, tclass, kind, detail FROM events"
        args: list = []
        if kind:
            query += " WHERE kind = ?"
            args.append(kind)
        with self.lock:
            rows = self.db.execute(query + " ORDER BY ts_fabric_ns", args).fetchall()
        return [{"ts_fabric_ns": r[0], "ts_wall_ns": r[1], "node": r[2], "port": r[3],
                 "tclass": r[4], "kind": r[5], **json.loads(r[6])} for r in rows]

    def results(self) -> list[dict]:
        with self.lock:
            rows = self.db.execute(
                "SELECT workload, kind, row FROM results ORDER BY rowid").fetchall()
        return [{"workload": w, "kind": k, **json.loads(r)} for w, k, r in rows]
