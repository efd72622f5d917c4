"""The run directory's time-series database: `counters.sqlite` (docs/run-format.md).

Written as samples are taken (WAL mode, one transaction per sample), so a
run killed with SIGKILL still leaves a database that opens and holds every
sample up to the last one. Readers check the format version and refuse a
newer one; format 1 databases (old run directories) are still read.

Format 2 stores each series as a step function: a value holds until the
next row of its series.
- meta(key, value): format_version, lab, dilation, ...
- series(id, node, port, tclass, counter): every series once. `port` is ''
  for node-wide counters and `tclass` is -1 where the counter is not per
  class. Counters are cumulative as read (bytes, packets, drops ...) or
  instantaneous (backlog_bytes, rates).
- sample_times(ts_fabric_ns, ts_wall_ns): one row per sample taken.
- points(series_id, ts_fabric_ns, value): rows are written per group
  (node, port, tclass): when any counter of a group differs from the
  group's previous sample, every counter of the group is written at that
  sample; an unchanged group is not. The first sample writes every group,
  the final one every group except those all zero since their first row.
  A series missing from a sample (an agent that exited or did not answer)
  gets a row with value NULL there: unknown until its next row.
  The collector writes `points` in time order (appending is cheap); the
  writer's close() rewrites it clustered by (series_id, ts_fabric_ns), the
  order readers ask in. A run that died keeps the time order; both read alike.
- samples: a VIEW with format 1's columns (ts_fabric_ns, ts_wall_ns, node,
  port, tclass, counter, value) over the rows that hold a value.
- events(ts_fabric_ns, ts_wall_ns, node, port, tclass, kind, detail): phase
  marks, pauses, faults, fidelity problems; `detail` is JSON.
- results(workload, kind, row): one JSON row per workload result.
- flows(workload, flow_id, src, dst, src_ip, dst_ip, sport, dport, size_bytes, start_ns,
  fct_ns, ideal_fct_ns, slowdown, tc, extra): one row per sized flow (kind: flows),
  testbed/workloads/base.FlowRecord; fct_ns and slowdown NULL for a flow that did not
  finish, `extra` JSON (with time_offset_ns when it is not 0). Databases written before
  the table existed read as no flows; the table needs no new format version.

Format 1 had one `samples` table row per counter per sample (and an index
on it); it is read as the same step functions.
"""

from __future__ import annotations

import bisect
import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed.workloads.base import FlowRecord

STORE_FORMAT_VERSION = 2

Key = tuple[str, str, int]                 # (node, port, tclass): a group
Points = list[tuple[int, float]]           # [(ts_fabric_ns, value), ...]

_FLOWS = """
CREATE TABLE IF NOT EXISTS flows (
    workload TEXT NOT NULL, flow_id INTEGER NOT NULL, src TEXT NOT NULL, dst TEXT NOT NULL,
    src_ip TEXT NOT NULL, dst_ip TEXT NOT NULL, sport INTEGER NOT NULL, dport INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL, start_ns INTEGER NOT NULL, fct_ns INTEGER NULL,
    ideal_fct_ns INTEGER NOT NULL, slowdown REAL NULL, tc INTEGER NOT NULL, extra TEXT NOT NULL);
"""
_COMMON = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    ts_fabric_ns INTEGER NOT NULL, ts_wall_ns INTEGER NOT NULL,
    node TEXT NOT NULL, port TEXT NOT NULL, tclass INTEGER NOT NULL,
    kind TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (workload TEXT NOT NULL, kind TEXT NOT NULL, row TEXT NOT NULL);
""" + _FLOWS
# As the collector writes it: in time order, no index. Kept in series order while
# writing (an index, or this table clustered), each commit touches a page per series:
# 6-7x the CPU and ~80x the bytes written per sample in a 7:1 incast (bench/store.py).
_POINTS_BY_TIME = """
CREATE TABLE points (
    series_id INTEGER NOT NULL, ts_fabric_ns INTEGER NOT NULL, value REAL);
"""
# As close() leaves it: clustered by series, which is how every reader asks.
_POINTS_BY_SERIES = """
CREATE TABLE points (
    series_id INTEGER NOT NULL, ts_fabric_ns INTEGER NOT NULL, value REAL,
    PRIMARY KEY (series_id, ts_fabric_ns)) WITHOUT ROWID;
"""
_SAMPLES_VIEW = """
CREATE VIEW samples AS
SELECT p.ts_fabric_ns AS ts_fabric_ns, t.ts_wall_ns AS ts_wall_ns, s.node AS node,
       s.port AS port, s.tclass AS tclass, s.counter AS counter, p.value AS value
FROM points p JOIN series s ON s.id = p.series_id
     JOIN sample_times t ON t.ts_fabric_ns = p.ts_fabric_ns
WHERE p.value IS NOT NULL;
"""
SCHEMA = _COMMON + """
CREATE TABLE series (
    id INTEGER PRIMARY KEY, node TEXT NOT NULL, port TEXT NOT NULL, tclass INTEGER NOT NULL,
    counter TEXT NOT NULL, UNIQUE (counter, node, port, tclass));
CREATE TABLE sample_times (ts_fabric_ns INTEGER PRIMARY KEY, ts_wall_ns INTEGER NOT NULL);
""" + _POINTS_BY_TIME + _SAMPLES_VIEW


class StoreVersionError(RuntimeError):
    """The database was written by a newer testbed."""


@dataclass(frozen=True)
class Sample:
    node: str
    port: str
    tclass: int
    counter: str
    value: float


@dataclass(frozen=True)
class Event:
    """One row of the events table: `detail` is stored as JSON."""

    ts_fabric_ns: int
    ts_wall_ns: int
    kind: str
    node: str = ""
    port: str = ""
    tclass: int = -1
    detail: dict = field(default_factory=dict)


class _Writer:
    """What the writer remembers between samples: the last values of every group present."""

    def __init__(self, ids: dict[Key, dict[str, int]], next_id: int) -> None:
        self.ids = ids                                  # group -> counter -> series id
        self.next_id = next_id
        self.last: dict[Key, dict[str, float]] = {}     # group -> counter -> value
        self.moved: set[Key] = set()                    # groups that changed after their first row
        self.ts: tuple[int, int] | None = None          # the last sample's (fabric, wall)
        self.written: set[Key] = set()                  # groups written at that sample
        self.final = False                              # that sample wrote the end state
        self.rows = 0                                   # points rows written


class _SeriesIds:
    """Series ids for one write: the known ones, and new ones numbered on from the writer's
    next id; the writer learns the new ones only once the write has committed."""

    def __init__(self, w: _Writer) -> None:
        self._ids = w.ids
        self.next_id = w.next_id
        self.new_ids: dict[tuple[Key, str], int] = {}
        self.new_series: list[tuple[int, str, str, int, str]] = []

    def __call__(self, key: Key, counter: str) -> int:
        known = self._ids.get(key)
        i = known.get(counter) if known is not None else None
        if i is None:
            i = self.new_ids.get((key, counter))
            if i is None:
                i = self.new_ids[(key, counter)] = self.next_id
                self.new_series.append((self.next_id, *key, counter))
                self.next_id += 1
        return i

    def commit(self, w: _Writer) -> None:
        for (key, counter), i in self.new_ids.items():
            w.ids.setdefault(key, {})[counter] = i
        w.next_id = self.next_id


def _changed_rows(w: _Writer, groups: dict[Key, dict[str, float]], sid: _SeriesIds, ts: int,
                  final: bool) -> tuple[list[tuple[int, int, float | None]], list[Key],
                                        list[Key], list[Key]]:
    """The points one sample writes, and which groups it wrote, changed and lost. A group
    equal to its last row is skipped (except at the final sample, where only groups all
    zero and never changed are); a counter or group that disappeared gets a None row, so
    a reader sees the gap instead of a stale value."""
    rows: list[tuple[int, int, float | None]] = []
    written: list[Key] = []
    moved: list[Key] = []
    for key, values in groups.items():
        old = w.last.get(key)
        if old == values:
            if not final or (key not in w.moved and not any(values.values())):
                continue
        elif old is not None:
            moved.append(key)
            rows += [(sid(key, counter), ts, None) for counter in old.keys() - values.keys()]
        written.append(key)
        rows += [(sid(key, counter), ts, value) for counter, value in values.items()]
    gone = [key for key in w.last if key not in groups]
    for key in gone:
        rows += [(sid(key, counter), ts, None) for counter in w.last[key]]
    return rows, written, moved, gone


class Store:
    """Append-only writer (and reader) of one run's counters.sqlite."""

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
        self._writer: _Writer | None = None
        self._v1_times: list[int] | None = None
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        if create:
            self.db.executescript(SCHEMA)
            self.set_meta("format_version", str(STORE_FORMAT_VERSION))
            self.db.commit()
            self.version = STORE_FORMAT_VERSION
        else:
            self.version = int(self.meta().get("format_version", "0"))
            if self.version > STORE_FORMAT_VERSION:
                raise StoreVersionError(
                    f"{self.path}: counters format {self.version} is newer than this testbed "
                    f"reads ({STORE_FORMAT_VERSION}); upgrade the testbed to read this run")

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close; a store that wrote samples first writes the end state (if the last sample
        was not marked final) and clusters `points` by series for the readers."""
        with self.lock:
            try:
                if self._writer is not None:
                    self._flush_end_state()
                    try:
                        self._cluster_points()
                    except sqlite3.OperationalError:
                        # Locked, or no room for the copy. The rewrite is one transaction
                        # (rolled back whole) and VACUUM is atomic: the database stays
                        # valid, at worst in time order, which reads the same, slower.
                        pass
            finally:
                self.db.close()

    # writing
    def set_meta(self, key: str, value: str) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def add_samples(self, ts_fabric_ns: int, ts_wall_ns: int, samples: Iterable[Sample],
                    final: bool = False) -> None:
        """One sample: the groups that changed since the previous sample, in one transaction.

        `final` marks the last sample of the run: every group still present is written
        (except groups all zero since their first row), so the end state is explicit.
        """
        groups: dict[Key, dict[str, float]] = {}
        for s in samples:
            groups.setdefault((s.node, s.port, s.tclass), {})[s.counter] = s.value
        with self.lock:
            w = self._writer_state()
            sid = _SeriesIds(w)
            rows, written, moved, gone = _changed_rows(w, groups, sid, ts_fabric_ns, final)
            with self.db:
                if sid.new_series:
                    self.db.executemany("INSERT INTO series VALUES (?, ?, ?, ?, ?)",
                                        sid.new_series)
                self.db.execute("INSERT OR IGNORE INTO sample_times VALUES (?, ?)",
                                (ts_fabric_ns, ts_wall_ns))
                self.db.executemany("INSERT OR REPLACE INTO points VALUES (?, ?, ?)", rows)
            # Remember only what was committed.
            sid.commit(w)
            for key in written:
                w.last[key] = groups[key]
            for key in gone:
                del w.last[key]
            w.moved.update(moved)
            w.moved.update(gone)
            w.ts, w.written, w.final = (ts_fabric_ns, ts_wall_ns), set(written), final
            w.rows += len(rows)

    def import_store(self, other: Path, shift_fabric_ns: int, shift_wall_ns: int) -> int:
        """Copy every series, sample time, point and event of another run's store into this
        one (empty or holding other nodes' series), its times moved by the shifts: how one
        VM's part of a run joins the others on one time axis (testbed/run/merge.py). A
        sample time both stores have keeps this store's wall time. Returns the points
        copied. The other store is only read."""
        with self.lock:
            w = self._writer_state()
            db = self.db
            db.execute("ATTACH DATABASE ? AS other", (str(other),))
            try:
                with db:
                    version = int(dict(db.execute("SELECT key, value FROM other.meta"))
                                  .get("format_version", 0))
                    if version != STORE_FORMAT_VERSION:
                        raise StoreVersionError(f"{other}: counters format {version} cannot "
                                                f"be merged (this testbed writes "
                                                f"{STORE_FORMAT_VERSION})")
                    base = w.next_id
                    series = db.execute("SELECT id, node, port, tclass, counter "
                                        "FROM other.series").fetchall()
                    taken = {(n, p, t, c) for _i, n, p, t, c in
                             db.execute("SELECT id, node, port, tclass, counter FROM series")}
                    clash = [r for r in series if tuple(r[1:]) in taken]
                    if clash:
                        raise ValueError(f"{other}: series {clash[0][1:]} is in both stores "
                                         "(two parts sampled the same port)")
                    db.executemany("INSERT INTO series VALUES (?, ?, ?, ?, ?)",
                                   [(base + i, n, p, t, c) for i, n, p, t, c in series])
                    db.execute("INSERT OR IGNORE INTO sample_times SELECT ts_fabric_ns + ?, "
                               "ts_wall_ns + ? FROM other.sample_times",
                               (shift_fabric_ns, shift_wall_ns))
                    cur = db.execute("INSERT OR REPLACE INTO points SELECT series_id + ?, "
                                     "ts_fabric_ns + ?, value FROM other.points",
                                     (base, shift_fabric_ns))
                    copied = cur.rowcount
                    db.execute("INSERT INTO events SELECT ts_fabric_ns + ?, ts_wall_ns + ?, "
                               "node, port, tclass, kind, detail FROM other.events",
                               (shift_fabric_ns, shift_wall_ns))
            finally:
                db.execute("DETACH DATABASE other")
            for i, n, p, t, c in series:
                w.ids.setdefault((n, p, t), {})[c] = base + i
                w.next_id = max(w.next_id, base + i + 1)
            w.final = True          # the end states came with the points
            return copied

    def _writer_state(self) -> _Writer:
        if self._writer is None:
            if self.version != STORE_FORMAT_VERSION:
                raise StoreVersionError(f"{self.path}: counters format {self.version} is read "
                                        "only; samples are written in format "
                                        f"{STORE_FORMAT_VERSION}")
            # A store reopened for writing knows the series ids but not the previous
            # values: its first sample writes every group in full.
            ids: dict[Key, dict[str, int]] = {}
            top = 0
            for i, node, port, tclass, counter in self.db.execute(
                    "SELECT id, node, port, tclass, counter FROM series"):
                ids.setdefault((node, port, tclass), {})[counter] = i
                top = max(top, i)
            self._writer = _Writer(ids, top + 1)
        return self._writer

    def _flush_end_state(self) -> None:
        """Write, at the last sample, the groups it did not write (the final sample's rule)."""
        w = self._writer
        if w is None or w.ts is None or w.final:
            return
        rows = [(w.ids[key][counter], w.ts[0], value)
                for key, values in w.last.items()
                if key not in w.written and (key in w.moved or any(values.values()))
                for counter, value in values.items()]
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO points VALUES (?, ?, ?)", rows)
        w.final = True
        w.rows += len(rows)

    def _cluster_points(self) -> None:
        """Rewrite `points` clustered by (series_id, ts_fabric_ns) and compact the file."""
        row = self.db.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'points'").fetchone()
        if row is None or "WITHOUT ROWID" in row[0].upper():
            return
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DROP VIEW samples")
            db.execute("ALTER TABLE points RENAME TO points_by_time")
            db.execute(_POINTS_BY_SERIES)
            # A later row of the same series and time (a reopened writer) wins.
            db.execute("INSERT OR REPLACE INTO points SELECT series_id, ts_fabric_ns, value "
                       "FROM points_by_time ORDER BY series_id, ts_fabric_ns, rowid")
            db.execute("DROP TABLE points_by_time")
            db.execute(_SAMPLES_VIEW)
            db.commit()
        except BaseException:
            db.rollback()
            raise
        db.execute("VACUUM")

    def add_event(self, ts_fabric_ns: int, ts_wall_ns: int, kind: str, node: str = "",
                  port: str = "", tclass: int = -1, **detail: object) -> None:
        self.add_events([Event(ts_fabric_ns, ts_wall_ns, kind, node, port, tclass, detail)])

    def add_events(self, events: Iterable[Event]) -> None:
        """Many events in one transaction: the collector imports a PFC burst's hundreds
        of agent events per sample, and a commit each cost it ~40 us apiece (4x the
        insert) on an idle VM, enough on a loaded one to make it miss its period."""
        rows = [(e.ts_fabric_ns, e.ts_wall_ns, e.node, e.port, e.tclass, e.kind,
                 json.dumps(e.detail, sort_keys=True)) for e in events]
        if not rows:
            return
        with self.lock, self.db:
            self.db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def add_result(self, workload: str, kind: str, row: dict) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT INTO results VALUES (?, ?, ?)",
                            (workload, kind, json.dumps(row, sort_keys=True)))

    def add_flows(self, records: Iterable[FlowRecord]) -> int:
        """Sized flows' records, in one transaction (streamed from the iterable); returns
        how many. A database opened from before the table existed gets it first."""
        count = 0

        def rows():
            nonlocal count
            for r in records:
                count += 1
                extra = dict(r.extra)
                if r.time_offset_ns:
                    extra["time_offset_ns"] = r.time_offset_ns
                yield (r.workload, r.flow_id, r.src, r.dst, r.src_ip, r.dst_ip, r.sport,
                       r.dport, r.size_bytes, r.start_ns, r.fct_ns, r.ideal_fct_ns,
                       r.slowdown, r.tc, json.dumps(extra, sort_keys=True))

        with self.lock:
            if not self._has_table("flows"):
                self.db.executescript(_FLOWS)
        with self.lock, self.db:
            self.db.executemany("INSERT INTO flows VALUES "
                                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows())
        return count

    # reading
    def _has_table(self, name: str) -> bool:
        with self.lock:
            return self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                   "name = ?", (name,)).fetchone() is not None

    def flows(self, workload: str | None = None) -> list[FlowRecord]:
        """The sized flows' records (of one traffic entry, if given), by flow_id; [] for
        a database without the table."""
        if not self._has_table("flows"):
            return []
        query = ("SELECT workload, flow_id, src, dst, src_ip, dst_ip, sport, dport, "
                 "size_bytes, start_ns, fct_ns, ideal_fct_ns, tc, extra FROM flows")
        args: list[str] = []
        if workload is not None:
            query += " WHERE workload = ?"
            args.append(workload)
        with self.lock:
            rows = self.db.execute(query + " ORDER BY flow_id, rowid", args).fetchall()
        out = []
        for (name, flow_id, src, dst, src_ip, dst_ip, sport, dport, size, start, fct, ideal,
             tc, extra_text) in rows:
            extra = json.loads(extra_text)
            offset = int(extra.pop("time_offset_ns", 0) or 0)
            out.append(FlowRecord(name, flow_id, src, dst, src_ip, dst_ip, sport, dport, size,
                                  start, fct, ideal, tc, time_offset_ns=offset, extra=extra))
        return out

    def meta(self) -> dict[str, str]:
        with self.lock:
            return dict(self.db.execute("SELECT key, value FROM meta"))

    def sample_times(self) -> list[int]:
        """ts_fabric_ns of every sample taken, in order."""
        if self.version < 2:
            # A scan of every row; format 1 is never written to, so once is enough.
            if self._v1_times is None:
                with self.lock:
                    self._v1_times = [r[0] for r in self.db.execute(
                        "SELECT DISTINCT ts_fabric_ns FROM samples ORDER BY 1")]
            return list(self._v1_times)
        with self.lock:
            rows = self.db.execute(
                "SELECT ts_fabric_ns FROM sample_times ORDER BY 1").fetchall()
        return [r[0] for r in rows]

    def sample_span(self) -> tuple[int, int, int, int] | None:
        """(first, last ts_fabric_ns, first, last ts_wall_ns) of the samples; None if none."""
        table = "sample_times" if self.version >= 2 else "samples"
        with self.lock:
            row = self.db.execute(f"SELECT MIN(ts_fabric_ns), MAX(ts_fabric_ns), "
                                  f"MIN(ts_wall_ns), MAX(ts_wall_ns) FROM {table}").fetchone()
        return None if row[0] is None else tuple(row)

    def _steps(self, counter: str, node: str | None, port: str | None, tclass: int | None
               ) -> tuple[dict[Key, list[tuple[int, float | None]]], list[int]]:
        """Each series' rows as a step function ((ts, value), None = unknown from ts), and
        the sample times. Format 1 rows are every sample at which a series was read: a
        sample without its row is a gap, marked None the same way."""
        where = "counter = ?"
        args: list[str | int] = [counter]
        for name, value in (("node", node), ("port", port), ("tclass", tclass)):
            if value is not None:
                where += f" AND {name} = ?"
                args.append(value)
        out: dict[Key, list[tuple[int, float | None]]] = {}
        with self.lock:
            if self.version >= 2:
                rows = self.db.execute(
                    "SELECT s.node, s.port, s.tclass, p.ts_fabric_ns, p.value FROM series s "
                    f"JOIN points p ON p.series_id = s.id WHERE {where} "
                    "ORDER BY s.id, p.ts_fabric_ns", args).fetchall()
            else:
                rows = self.db.execute(
                    "SELECT node, port, tclass, ts_fabric_ns, value FROM samples "
                    f"WHERE {where} ORDER BY ts_fabric_ns", args).fetchall()
            times = self.sample_times()
        for n, p, t, ts, v in rows:
            out.setdefault((n, p, t), []).append((ts, v))
        if self.version < 2:
            index = {ts: i for i, ts in enumerate(times)}
            for key, pts in out.items():
                marked: list[tuple[int, float | None]] = []
                for j, (ts, v) in enumerate(pts):
                    marked.append((ts, v))
                    following = index[ts] + 1
                    if following < len(times) and (j + 1 == len(pts)
                                                   or pts[j + 1][0] != times[following]):
                        marked.append((times[following], None))
                out[key] = marked
        return out, times

    def series(self, counter: str, node: str | None = None, port: str | None = None,
               tclass: int | None = None) -> dict[Key, Points]:
        """{(node, port, tclass): [(ts_fabric_ns, value), ...]} for one counter.

        The points of a step function: a value holds from its ts until the next point.
        Format 2 has a point where its group was written (it changed, or another counter
        of its (node, port, tclass) did), and each stretch in which the series was read
        ends with a point at the last sample it was read in (so a series runs to the end
        of the run, or to where its agent stopped). Format 1 has a point per sample.
        Maxima, minima, last values and the value at a time come out of either; for
        means over samples and rates from cumulative counters, use aligned().
        """
        steps, times = self._steps(counter, node, port, tclass)
        out: dict[Key, Points] = {}
        for key, rows in steps.items():
            pts: Points = []
            for j, (ts, v) in enumerate(rows):
                if v is None:
                    continue
                pts.append((ts, v))
                if j + 1 < len(rows) and rows[j + 1][1] is not None:
                    continue
                # The end of a stretch: the last sample before the next row (a None),
                # or the last sample of the run.
                end = times[bisect.bisect_left(times, rows[j + 1][0]) - 1] \
                    if j + 1 < len(rows) else (times[-1] if times else ts)
                if end > ts:
                    pts.append((end, v))
            if pts:
                out[key] = pts
        return out

    def aligned(self, counter: str, node: str | None = None, port: str | None = None,
                tclass: int | None = None, times: Sequence[int] | None = None
                ) -> dict[Key, Points]:
        """The value of each series at every time of `times` (increasing; default: every
        sample time), forward-filled: [(t, value at t), ...], leaving out times at which
        the series had no value yet or was not read. Series share their times, so rates
        (from cumulative counters) and means over samples come out as with a row per
        sample; on format 1, at the sample times, it is the rows as stored."""
        steps, sample_times = self._steps(counter, node, port, tclass)
        grid = list(sample_times if times is None else times)
        out: dict[Key, Points] = {}
        for key, rows in steps.items():
            pts: Points = []
            j, value = 0, None
            for t in grid:
                while j < len(rows) and rows[j][0] <= t:
                    value = rows[j][1]
                    j += 1
                if value is not None:
                    pts.append((t, value))
            if pts:
                out[key] = pts
        return out

    def last_values(self, counter: str) -> dict[Key, float]:
        """The last value read of every series of `counter`."""
        with self.lock:
            if self.version >= 2:
                # SQLite takes the bare column (value) from the row holding the MAX.
                rows = self.db.execute(
                    "SELECT s.node, s.port, s.tclass, p.value, MAX(p.ts_fabric_ns) "
                    "FROM series s JOIN points p ON p.series_id = s.id "
                    "WHERE s.counter = ? AND p.value IS NOT NULL GROUP BY s.id",
                    (counter,)).fetchall()
            else:
                rows = self.db.execute(
                    "SELECT node, port, tclass, value FROM samples s WHERE counter = ? AND "
                    "ts_fabric_ns = (SELECT MAX(ts_fabric_ns) FROM samples WHERE "
                    "counter = s.counter AND node = s.node AND port = s.port AND "
                    "tclass = s.tclass)", (counter,)).fetchall()
        return {(r[0], r[1], r[2]): r[3] for r in rows}

    def counters(self) -> list[str]:
        table = "series" if self.version >= 2 else "samples"
        with self.lock:
            rows = self.db.execute(f"SELECT DISTINCT counter FROM {table} ORDER BY 1").fetchall()
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


def convert_v1(src: Path, dst: Path) -> Store:
    """Replay a format 1 database sample by sample into a new format 2 one (open, returned
    for the caller to close). Meta, events and results are copied as they are."""
    old = Store(src)
    if old.version != 1:
        old.close()
        raise ValueError(f"{src}: counters format {old.version}, not 1")
    new = Store(dst, create=True)
    try:
        for key, value in old.meta().items():
            if key != "format_version":
                new.set_meta(key, value)
        with new.lock, new.db:
            new.db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                               old.db.execute("SELECT * FROM events ORDER BY rowid"))
            new.db.executemany("INSERT INTO results VALUES (?, ?, ?)",
                               old.db.execute("SELECT * FROM results ORDER BY rowid"))
        for ts_fabric, ts_wall, samples in v1_samples(old):
            new.add_samples(ts_fabric, ts_wall, samples)
    except BaseException:
        new.close()
        raise
    finally:
        old.close()
    return new


def v1_samples(store: Store) -> Iterable[tuple[int, int, list[Sample]]]:
    """(ts_fabric_ns, ts_wall_ns, samples) of each sample of a format 1 store, in order."""
    cursor = store.db.execute(
        "SELECT ts_fabric_ns, ts_wall_ns, node, port, tclass, counter, value FROM samples "
        "ORDER BY ts_fabric_ns, rowid")
    current: tuple[int, int] | None = None
    batch: list[Sample] = []
    for ts, wall, node, port, tclass, counter, value in cursor:
        if current is not None and ts != current[0]:
            yield (*current, batch)
            batch = []
        current = (ts, wall)
        batch.append(Sample(node, port, tclass, counter, value))
    if current is not None:
        yield (*current, batch)
