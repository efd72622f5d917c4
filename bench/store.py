"""What counters.sqlite costs: format 1 against format 2, replayed from a real run.

Reads a format 1 database (default: the 30 ms 7:1 RoCE incast fixture) and
replays it sample by sample, as the collector wrote it, through
- format 1's writer (its own schema, taken from the source database, and one
  executemany of a row per counter per sample), and
- format 2's Store (testbed/results/store.py), the last sample marked final as
  Collector.stop() does, then closed (points clustered by series).
Prints, per format, the file size, the rows, the write CPU per sample (thread
CPU time of add_samples: Python and SQLite, commit included) and the bytes
written per sample (write(2) bytes of the process: WAL frames and
checkpoints); also for two layouts format 2 could have written instead of
appending in time order: points clustered by series, or indexed by series,
while writing. Then the readers: seconds for the queries the report and the
summary make, on format 1, on format 2 as a run that died leaves it (points in
time order) and as a closed one (clustered by series), and what a
(series_id, ts_fabric_ns) index would add to the time-ordered table instead.
Last, it checks that format 2 gives back every sample of every series and
that the self-join on backlog_bytes and vq_bytes through the view gives what
format 1 gives.

    .venv/bin/python bench/store.py [V1_DB ...]

No root, no network namespaces; reads a copy of V1_DB and writes only into a
temporary directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.results.store import _POINTS_BY_SERIES, _SAMPLES_VIEW, Sample, Store, v1_samples  # noqa: E402

FIXTURE = Path("/work/fixtures/v1-dcqcnoff/counters.sqlite")
SELF_JOIN = """
SELECT a.node, a.port, a.tclass, MAX(ABS(a.value - b.value)) FROM samples a JOIN samples b
  ON a.ts_fabric_ns = b.ts_fabric_ns AND a.node = b.node AND a.port = b.port
     AND a.tclass = b.tclass
WHERE a.counter = 'backlog_bytes' AND b.counter = 'vq_bytes'
GROUP BY a.node, a.port, a.tclass ORDER BY 1, 2, 3"""


def written_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("wchar:"))


def table_bytes(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as db:
        try:
            return dict(db.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"))
        except sqlite3.Error:         # SQLite built without the dbstat table
            return {}


class Timer:
    def __init__(self) -> None:
        self.cpu_ns: list[int] = []
        self.io_bytes = 0

    def __call__(self, fn, *args, **kwargs) -> None:
        io0, cpu0 = written_bytes(), time.thread_time_ns()
        fn(*args, **kwargs)
        self.cpu_ns.append(time.thread_time_ns() - cpu0)
        self.io_bytes += written_bytes() - io0


def replay_v1(src: sqlite3.Connection, data, path: Path) -> tuple[Timer, int]:
    """Format 1's writer: its schema from the source, a row per counter per sample."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    for (sql,) in src.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND "
                              "name NOT LIKE 'sqlite_%' ORDER BY rowid"):
        db.execute(sql)
    db.commit()
    timer = Timer()

    def add(ts: int, wall: int, samples: list[Sample]) -> None:
        with db:
            db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [(ts, wall, s.node, s.port, s.tclass, s.counter, s.value)
                            for s in samples])

    for ts, wall, samples in data:
        timer(add, ts, wall, samples)
    rows = sum(len(s) for _, _, s in data)
    db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                   src.execute("SELECT * FROM events ORDER BY rowid"))
    db.commit()
    db.close()
    return timer, rows


# Layouts format 2 could have kept while writing, for comparison (not what it does).
LAYOUTS = {
    "clustered while writing": ["DROP VIEW samples", "DROP TABLE points", _POINTS_BY_SERIES,
                                _SAMPLES_VIEW],
    "indexed while writing": ["CREATE INDEX points_by_series ON points "
                              "(series_id, ts_fabric_ns)"],
}


def replay_v2(src: sqlite3.Connection, data, path: Path, died: Path | None = None,
              layout: str | None = None) -> tuple[Timer, int, float]:
    """Format 2's Store, as the collector drives it; `died` gets a copy before close()."""
    store = Store(path, create=True)
    for sql in LAYOUTS.get(layout, []):
        store.db.execute(sql)
    store.db.commit()
    with store.lock, store.db:
        store.db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                             src.execute("SELECT * FROM events ORDER BY rowid"))
    timer = Timer()
    for i, (ts, wall, samples) in enumerate(data):
        timer(store.add_samples, ts, wall, samples, final=i == len(data) - 1)
    rows = store._writer.rows if store._writer else 0
    if died is not None:
        with store.lock:
            store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            store.db.execute(f"VACUUM INTO '{died}'")        # what a run that died leaves
    cpu0 = time.thread_time_ns()
    store.close()
    return timer, rows, (time.thread_time_ns() - cpu0) / 1e9


def change_rows(data) -> tuple[int, int, int]:
    """Rows if each series were written only when it changed (not its whole group), rows
    of groups left out of the final sample (all zero since their first row), groups."""
    last: dict[tuple, float] = {}
    rows = 0
    groups: dict[tuple, dict[str, float]] = {}
    moved: set[tuple] = set()
    for _ts, _wall, samples in data:
        for s in samples:
            key = (s.node, s.port, s.tclass, s.counter)
            if last.get(key) != s.value:
                rows += 1
                if key in last:
                    moved.add(key[:3])
            last[key] = s.value
            groups.setdefault(key[:3], {})[s.counter] = s.value
    final = {(s.node, s.port, s.tclass) for s in data[-1][2]}
    idle = [g for g in final if g not in moved and not any(groups[g].values())]
    return rows, sum(len(groups[g]) for g in idle), len(final)


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def readers(path: Path) -> dict[str, float]:
    with Store(path) as store:
        return {
            "series(backlog_bytes)": timed(store.series, "backlog_bytes"),
            "aligned(backlog_bytes)": timed(store.aligned, "backlog_bytes"),
            "aligned(recv.bytes)": timed(store.aligned, "recv.bytes"),
            "last_values(class_bytes)": timed(store.last_values, "class_bytes"),
            "self-join through samples": timed(lambda: store.db.execute(SELF_JOIN).fetchall()),
        }


def same_answers(v1: Path, v2: Path) -> tuple[bool, bool]:
    with Store(v1) as old, Store(v2) as new:
        every = all(new.aligned(c) == old.series(c) for c in old.counters())
        join = old.db.execute(SELF_JOIN).fetchall() == new.db.execute(SELF_JOIN).fetchall()
    return every, join


def fmt_us(ns: list[int]) -> str:
    ns = sorted(ns)
    return (f"{statistics.mean(ns) / 1e3:,.0f} / {ns[len(ns) // 2] / 1e3:,.0f} / "
            f"{ns[int(0.95 * (len(ns) - 1))] / 1e3:,.0f}")


def bench(given: Path, tmp: Path) -> None:
    # A copy: even a read-only open of a WAL database leaves -shm/-wal files beside it.
    src_path = tmp / "source.sqlite"
    shutil.copyfile(given, src_path)
    if Path(f"{given}-wal").exists():
        shutil.copyfile(f"{given}-wal", f"{src_path}-wal")
    src = sqlite3.connect(src_path)
    with Store(src_path) as old:
        if old.version != 1:
            raise SystemExit(f"{src_path}: counters format {old.version}, not 1")
        data = list(v1_samples(old))
    n = len(data)
    v1, v2, died = tmp / "v1.sqlite", tmp / "v2.sqlite", tmp / "v2-died.sqlite"
    t1, rows1 = replay_v1(src, data, v1)
    t2, rows2, close_s = replay_v2(src, data, v2, died)
    others = {name: replay_v2(src, data, tmp / f"{n}.sqlite", layout=name)[0]
              for n, name in enumerate(LAYOUTS)}
    per_series, idle_rows, n_groups = change_rows(data)
    b1, b2, bd = table_bytes(v1), table_bytes(v2), table_bytes(died)
    src.close()

    print(f"\n## {given}\n")
    print(f"{n} samples, {rows1:,} counter values ({rows1 / n:,.0f} a sample, {n_groups} groups "
          f"at the end); source file {src_path.stat().st_size:,} bytes\n")
    print("| format | file bytes | samples/points bytes | index bytes | events bytes | rows "
          "| write CPU per sample, us (mean / median / p95) | bytes written per sample |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| 1 | {v1.stat().st_size:,} | {b1.get('samples', 0):,} | "
          f"{b1.get('samples_by_series', 0):,} | {b1.get('events', 0):,} | {rows1:,} | "
          f"{fmt_us(t1.cpu_ns)} | {t1.io_bytes / n:,.0f} |")
    print(f"| 2 | {v2.stat().st_size:,} | {b2.get('points', 0):,} | 0 | "
          f"{b2.get('events', 0):,} | {rows2:,} | {fmt_us(t2.cpu_ns)} | {t2.io_bytes / n:,.0f} |")
    print(f"| 2, died before close() | {died.stat().st_size:,} | {bd.get('points', 0):,} | 0 | "
          f"{bd.get('events', 0):,} | {rows2:,} | | |")
    for name, timer in others.items():
        print(f"| 2, {name} | | | | | {rows2:,} | {fmt_us(timer.cpu_ns)} | "
              f"{timer.io_bytes / n:,.0f} |")
    print(f"\nv2/v1: file {v2.stat().st_size / v1.stat().st_size:.1%}, rows {rows2 / rows1:.1%}, "
          f"write CPU {sum(t2.cpu_ns) / sum(t1.cpu_ns):.1%}, bytes written "
          f"{t2.io_bytes / max(t1.io_bytes, 1):.1%}; close() (flush, cluster, VACUUM) "
          f"{close_s:.2f} s CPU once")
    print(f"rows if each series were written alone when it changed (no group rule): "
          f"{per_series:,}; rows of all-zero groups the final sample leaves out: {idle_rows:,}")

    # What an index on the time-ordered table would cost, against clustering it.
    indexed = tmp / "v2-died-indexed.sqlite"
    with sqlite3.connect(died) as db:
        db.execute(f"VACUUM INTO '{indexed}'")
    with sqlite3.connect(indexed) as db:
        db.execute("CREATE INDEX points_by_series ON points (series_id, ts_fabric_ns)")
    index_bytes = table_bytes(indexed).get("points_by_series", 0)
    print(f"a (series_id, ts_fabric_ns) index on the time-ordered points: {index_bytes:,} bytes "
          f"more (clustered: 0)\n")
    times = {"1": readers(v1), "2 died (time order)": readers(died),
             "2 + index (time order)": readers(indexed), "2 closed (clustered)": readers(v2)}
    names = list(next(iter(times.values())))
    print("| reader, seconds | " + " | ".join(times) + " |")
    print("|---|" + "---:|" * len(times))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{t[name]:.3f}" for t in times.values()) + " |")
    every, join = same_answers(v1, v2)
    every_died, join_died = same_answers(v1, died)
    print(f"\nformat 2 gives every sample of every series back: {every} (died: {every_died}); "
          f"self-join through the view equals format 1's: {join} (died: {join_died})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("db", nargs="*", type=Path, default=[FIXTURE],
                        help=f"format 1 counters.sqlite (default {FIXTURE})")
    args = parser.parse_args()
    for path in args.db:
        with tempfile.TemporaryDirectory(prefix="tb-benchstore-") as tmp:
            bench(path, Path(tmp))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
