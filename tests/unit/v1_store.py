"""A writer of counters format 1, as testbed wrote it before format 2 (a frozen copy of
that Store's schema and writes), so tests can make the old run directories readers
must keep reading."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from testbed.results.store import Sample

V1_SCHEMA = """
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


class V1Store:
    """Writes counters.sqlite the way format 1 did: a row per counter per sample."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(V1_SCHEMA)
        self.set_meta("format_version", "1")

    def set_meta(self, key: str, value: str) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def add_samples(self, ts_fabric_ns: int, ts_wall_ns: int, samples: Iterable[Sample],
                    final: bool = False) -> None:
        with self.db:
            self.db.executemany(
                "INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(ts_fabric_ns, ts_wall_ns, s.node, s.port, s.tclass, s.counter, s.value)
                 for s in samples])

    def add_event(self, ts_fabric_ns: int, ts_wall_ns: int, kind: str, node: str = "",
                  port: str = "", tclass: int = -1, **detail: object) -> None:
        with self.db:
            self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (ts_fabric_ns, ts_wall_ns, node, port, tclass, kind,
                             json.dumps(detail, sort_keys=True)))

    def add_result(self, workload: str, kind: str, row: dict) -> None:
        with self.db:
            self.db.execute("INSERT INTO results VALUES (?, ?, ?)",
                            (workload, kind, json.dumps(row, sort_keys=True)))

    def close(self) -> None:
        self.db.close()
