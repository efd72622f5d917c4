"""counters.sqlite (docs/run-format.md): format 2 writes a group only when it changed and
reads back every sample; format 1 databases read as before; SQL written against format
1's `samples` table keeps giving the same answers through the view. The collector
writes a sample's agent events in one transaction and says when it missed its period."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from testbed.results.store import STORE_FORMAT_VERSION, Sample, Store, StoreVersionError, convert_v1
from testbed.run.collector import AgentEndpoint
from tests.unit.v1_store import V1Store

HOT = ("sw1", "swp1", 3)          # queue and virtual queue move; PFC agent counters too
IDLE = ("sw1", "swp2", 0)         # zero from start to end
STEADY = ("sw1", "swp3", 0)       # a constant that is not zero
AGENT = ("h1", "send-h1-h2", -1)  # starts late, misses one read, exits before the end
N = 10
PERIOD_NS = 5_000
QUEUE = [0, 0, 3000, 9000, 9000, 9000, 4000, 0, 0, 0]
# At sample 4 only the virtual queue moves, and there the two differ most (3000).
VQ = [0, 0, 3500, 8000, 12000, 9500, 3000, 0, 0, 0]


def _ticks() -> list[tuple[int, int, dict[tuple[str, str, int, str], float]]]:
    """(ts_fabric_ns, ts_wall_ns, {(node, port, tclass, counter): value}) per sample."""
    out = []
    for i in range(N):
        values = {(*HOT, "class_bytes"): 1000.0 * min(max(i - 1, 0), 6),
                  (*HOT, "backlog_bytes"): QUEUE[i], (*HOT, "vq_bytes"): VQ[i],
                  (*HOT, "class_drops"): 0.0}
        if i != 5:                                     # the PFC agent missed one read
            values[(*HOT, "pause_tx")] = float(min(max(0, i - 2), 5))
        values.update({(*IDLE, c): 0.0 for c in ("class_bytes", "backlog_bytes", "vq_bytes")})
        values.update({(*STEADY, "class_bytes"): 500.0, (*STEADY, "backlog_bytes"): 0.0,
                       (*STEADY, "vq_bytes"): 0.0})
        if 2 <= i <= 7 and i != 4:                     # missed sample 4, exited after 7
            values[(*AGENT, "send.bytes")] = 100.0 * min(i, 5)
            values[(*AGENT, "send.naks")] = 0.0
        out.append(((i - 2) * PERIOD_NS, 10**12 + i * 10**7, values))
    return out


TICKS = _ticks()
TS = [ts for ts, _, _ in TICKS]
COUNTERS = sorted({k[3] for _, _, values in TICKS for k in values})
SELF_JOIN = """
SELECT a.node, a.port, a.tclass, MAX(ABS(a.value - b.value)) FROM samples a JOIN samples b
  ON a.ts_fabric_ns = b.ts_fabric_ns AND a.node = b.node AND a.port = b.port
     AND a.tclass = b.tclass
WHERE a.counter = 'backlog_bytes' AND b.counter = 'vq_bytes'
GROUP BY a.node, a.port, a.tclass ORDER BY 1, 2, 3"""


def _write(store, ticks=TICKS, final: bool = True) -> None:
    for i, (ts, wall, values) in enumerate(ticks):
        store.add_samples(ts, wall, [Sample(*k, v) for k, v in values.items()],
                          final=final and i == len(ticks) - 1)


def _per_sample(counter: str) -> dict[tuple[str, str, int], list[tuple[int, float]]]:
    """What a row per counter per sample says: every sample at which a series was read."""
    out: dict = {}
    for ts, _wall, values in TICKS:
        for (node, port, tclass, c), v in values.items():
            if c == counter:
                out.setdefault((node, port, tclass), []).append((ts, v))
    return out


def _v1(path: Path) -> Path:
    old = V1Store(path)
    old.set_meta("lab", "t1")
    _write(old)
    old.add_event(0, 1, "phase", phase="workload")
    old.add_result("w", "udp_incast", {"src": "h1", "rx_bytes": 5})
    old.close()
    return path


def _v2(path: Path, close: bool = True, final: bool = True) -> Store:
    store = Store(path, create=True)
    _write(store, final=final)
    if close:
        store.close()
    return store


def _rows_at(path: Path, ts: int) -> set[tuple[str, str, int, str]]:
    with sqlite3.connect(path) as db:
        return set(db.execute("SELECT s.node, s.port, s.tclass, s.counter FROM points p "
                              "JOIN series s ON s.id = p.series_id WHERE p.ts_fabric_ns = ?",
                              (ts,)).fetchall())


# --- format 2 ------------------------------------------------------------------------------

@pytest.mark.parametrize("closed", [True, False], ids=["closed", "live"])
def test_v2_gives_back_every_sample_of_every_series(tmp_path: Path, closed: bool) -> None:
    writer = _v2(tmp_path / "c.sqlite", close=closed)
    # closed: points clustered by series; live (or a run that died): in time order
    try:
        with Store(tmp_path / "c.sqlite") as store:
            assert store.version == STORE_FORMAT_VERSION == 2
            assert store.sample_times() == TS
            assert store.sample_span() == (TS[0], TS[-1], TICKS[0][1], TICKS[-1][1])
            assert store.counters() == COUNTERS
            for counter in COUNTERS:
                assert store.aligned(counter) == _per_sample(counter), counter
                last = {k: pts[-1][1] for k, pts in _per_sample(counter).items()}
                assert store.last_values(counter) == last, counter
            assert store.db.execute(SELF_JOIN).fetchall() == [
                (*HOT, 3000.0), (*IDLE, 0.0), (*STEADY, 0.0)]
    finally:
        if not closed:
            writer.close()


def test_unchanged_groups_are_not_written_and_a_changed_group_is_written_whole(
        tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    _v2(path)
    assert _rows_at(path, TS[0]) == set(TICKS[0][2])          # the first sample: everything
    # Sample 1: nothing moved (the agent has not started), so nothing is written.
    assert _rows_at(path, TS[1]) == set()
    # Sample 2: HOT's queue moved: all of HOT's counters, its unchanged zeros too; the
    # agent appeared: its series. IDLE and STEADY did not change.
    assert _rows_at(path, TS[2]) == {k for k in TICKS[2][2] if k[:3] in (HOT, AGENT)}
    # Sample 4: only HOT's virtual queue moved: HOT in full, so backlog_bytes and
    # vq_bytes of that instant pair up in a join; the agent missed it: NULL rows.
    assert _rows_at(path, TS[4]) == {k for k in TICKS[3][2] if k[:3] in (HOT, AGENT)}
    # Sample 8: HOT did not change; the agent exited: NULL rows.
    assert _rows_at(path, TS[8]) == {(*AGENT, "send.bytes"), (*AGENT, "send.naks")}
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM points WHERE ts_fabric_ns = ? AND value IS "
                          "NULL", (TS[8],)).fetchone() == (2,)
        (rows,) = db.execute("SELECT COUNT(*) FROM points").fetchone()
    assert rows < sum(len(values) for _, _, values in TICKS) / 2


def test_the_final_sample_writes_every_group_but_those_zero_throughout(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    _v2(path)
    # HOT and STEADY did not change in the last sample; it is marked final.
    assert _rows_at(path, TS[-1]) == {k for k in TICKS[-1][2] if k[:3] in (HOT, STEADY)}
    with Store(path) as store:
        # IDLE was zero from its first row on; that row holds to the end of the run.
        assert store.series("backlog_bytes", *IDLE) == {IDLE: [(TS[0], 0.0), (TS[-1], 0.0)]}


def test_close_writes_the_end_state_when_no_sample_was_marked_final(tmp_path: Path) -> None:
    a, b = tmp_path / "final.sqlite", tmp_path / "closed.sqlite"
    _v2(a, final=True)
    _v2(b, final=False)
    assert _rows_at(b, TS[-1]) == _rows_at(a, TS[-1]) != set()


def test_series_are_steps_to_the_last_sample_read_and_aligned_fills_them(
        tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    _v2(path)
    with Store(path) as store:
        # Points where the value changed (group rows repeat it), each stretch the series
        # was read ending at its last sample: the run's last one, or before a missed read.
        assert store.series("backlog_bytes", *HOT)[HOT] == [
            (TS[0], 0), (TS[2], 3000), (TS[3], 9000), (TS[4], 9000), (TS[5], 9000),
            (TS[6], 4000), (TS[7], 0), (TS[9], 0)]
        assert store.series("send.bytes")[AGENT] == [
            (TS[2], 200), (TS[3], 300), (TS[5], 500), (TS[7], 500)]
        # Forward-filled at any times; unknown where the agent was not read.
        between = [TS[3] + 1, TS[4] + 1, TS[6] + 1, TS[9] + 1]
        assert store.aligned("send.bytes", times=between) == {
            AGENT: [(TS[3] + 1, 300), (TS[6] + 1, 500)]}
        assert store.aligned("pause_tx", *HOT, times=between) == {
            HOT: [(TS[3] + 1, 1), (TS[4] + 1, 2), (TS[6] + 1, 4), (TS[9] + 1, 5)]}


def test_samples_view_has_the_v1_columns_and_holds_only_values(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    _v2(path)
    with Store(path) as store:
        columns = [r[1] for r in store.db.execute("PRAGMA table_info(samples)")]
        assert columns == ["ts_fabric_ns", "ts_wall_ns", "node", "port", "tclass", "counter",
                           "value"]
        rows = store.db.execute("SELECT ts_fabric_ns, ts_wall_ns, counter, value FROM samples "
                                "WHERE node = ? AND port = ? ORDER BY ts_fabric_ns",
                                AGENT[:2]).fetchall()
        walls = {ts: wall for ts, wall, _ in TICKS}
        assert all(walls[ts] == wall and v is not None for ts, wall, _c, v in rows)
        assert [(ts, v) for ts, _w, c, v in rows if c == "send.bytes"] == [
            (TS[2], 200), (TS[3], 300), (TS[5], 500)]


def test_value_at_a_time_and_every_sample_by_sql_as_documented(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    _v2(path)
    with Store(path) as store:
        t = TS[4] + 1
        at = store.db.execute("""
            SELECT s.node, s.port, s.tclass, p.value
            FROM series s JOIN points p ON p.series_id = s.id
            WHERE s.counter = :counter
              AND p.ts_fabric_ns = (SELECT MAX(ts_fabric_ns) FROM points
                                    WHERE series_id = s.id AND ts_fabric_ns <= :t)""",
                              {"counter": "vq_bytes", "t": t}).fetchall()
        assert sorted(at) == sorted((*k, v) for k, pts in store.aligned(
            "vq_bytes", times=[t]).items() for _, v in pts)
        every = store.db.execute("""
            SELECT s.node, s.port, s.tclass, t.ts_fabric_ns,
                   (SELECT p.value FROM points p
                    WHERE p.series_id = s.id AND p.ts_fabric_ns <= t.ts_fabric_ns
                    ORDER BY p.ts_fabric_ns DESC LIMIT 1) AS value
            FROM series s CROSS JOIN sample_times t
            WHERE s.counter = 'send.bytes' ORDER BY s.id, t.ts_fabric_ns""").fetchall()
        assert [(ts, v) for *_k, ts, v in every if v is not None] == \
            _per_sample("send.bytes")[AGENT]


def test_points_are_clustered_by_series_once_closed_with_no_other_index(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    writer = _v2(path, close=False)
    schema = dict(writer.db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
    assert "WITHOUT ROWID" not in schema["points"]           # appended in time order
    writer.close()
    with sqlite3.connect(path) as db:
        schema = dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
        indexes = [r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'points'")]
        views = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'view'")]
    assert "WITHOUT ROWID" in schema["points"] and "PRIMARY KEY (series_id, ts_fabric_ns)" \
        in schema["points"]
    assert set(schema) == {"meta", "events", "results", "flows", "series", "sample_times",
                           "points"}
    assert indexes == [] and views == ["samples"]


def test_a_reopened_store_writes_its_first_sample_in_full(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    _v2(path)
    ts, wall, values = TS[-1] + PERIOD_NS, TICKS[-1][1] + 10**7, TICKS[-1][2]
    with Store(path) as store:
        store.add_samples(ts, wall, [Sample(*k, v) for k, v in values.items()])
    assert _rows_at(path, ts) == set(values)
    with Store(path) as store:
        assert store.sample_times() == [*TS, ts]
        assert store.aligned("class_bytes", *STEADY)[STEADY][-2:] == [(TS[-1], 500), (ts, 500)]


# --- format 1, and format 1 converted -------------------------------------------------------

def test_v1_database_reads_as_it_did(tmp_path: Path) -> None:
    with Store(_v1(tmp_path / "v1.sqlite")) as store:
        assert store.version == 1
        assert store.sample_times() == TS
        assert store.counters() == COUNTERS
        for counter in COUNTERS:
            assert store.series(counter) == _per_sample(counter), counter
            assert store.aligned(counter) == _per_sample(counter), counter
        assert store.aligned("send.bytes", times=[TS[3] + 1, TS[4] + 1]) == {
            AGENT: [(TS[3] + 1, 300)]}
        assert store.last_values("send.bytes") == {AGENT: 500}
        assert store.events()[0]["phase"] == "workload"
        assert store.results() == [{"workload": "w", "kind": "udp_incast", "src": "h1",
                                    "rx_bytes": 5}]


def test_v1_is_not_appended_to(tmp_path: Path) -> None:
    with Store(_v1(tmp_path / "v1.sqlite")) as store, \
            pytest.raises(StoreVersionError, match="format 1 is read only"):
        store.add_samples(10**6, 10**13, [Sample(*HOT, "class_bytes", 1.0)])


def test_the_self_join_through_the_view_equals_v1s(tmp_path: Path) -> None:
    with sqlite3.connect(_v1(tmp_path / "v1.sqlite")) as db:
        v1 = db.execute(SELF_JOIN).fetchall()
    _v2(tmp_path / "v2.sqlite")
    with sqlite3.connect(tmp_path / "v2.sqlite") as db:
        v2 = db.execute(SELF_JOIN).fetchall()
    assert v2 == v1 == [(*HOT, 3000.0), (*IDLE, 0.0), (*STEADY, 0.0)]


def test_v1_converted_to_v2_reads_the_same(tmp_path: Path) -> None:
    src = _v1(tmp_path / "v1.sqlite")
    convert_v1(src, tmp_path / "v2.sqlite").close()
    with Store(src) as old, Store(tmp_path / "v2.sqlite") as new:
        assert new.version == 2
        assert new.meta()["lab"] == "t1" and new.meta()["format_version"] == "2"
        assert new.sample_times() == old.sample_times()
        assert new.counters() == old.counters()
        for counter in old.counters():
            assert new.aligned(counter) == old.series(counter), counter
            assert new.last_values(counter) == old.last_values(counter), counter
        assert new.events() == old.events() and new.results() == old.results()
        assert new.db.execute(SELF_JOIN).fetchall() == old.db.execute(SELF_JOIN).fetchall()


# --- versions -------------------------------------------------------------------------------

def test_a_newer_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    _v2(path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '3' WHERE key = 'format_version'")
    with pytest.raises(StoreVersionError, match=r"counters format 3 is newer than this testbed "
                                                r"reads \(2\); upgrade"):
        Store(path)


# --- the collector marks its last sample -----------------------------------------------------

def test_the_collector_writes_the_end_state_with_its_last_sample(tmp_path, monkeypatch) -> None:
    from testbed.config import load_config
    from testbed.plan import compile_plan
    from testbed.run import collector as collector_mod
    from tests.conftest import REPO

    class Sampler:
        def __init__(self, plan, whole_plan=None) -> None:
            pass

        def sample(self) -> list[Sample]:
            return [Sample(*STEADY, "class_bytes", 500), Sample(*STEADY, "backlog_bytes", 0)]

        def close(self) -> None:
            pass

    monkeypatch.setattr(collector_mod, "KernelSampler", Sampler)
    plan = compile_plan(load_config(REPO / "configs/default.yaml"),
                        max_wall_port_rate_bps=200_000_000)
    store = Store(tmp_path / "c.sqlite", create=True)
    collector = collector_mod.Collector(plan, store, 10**6, 0)
    for _ in range(3):
        collector.sample_once()
    collector.stop()                      # one more sample, the final one
    with sqlite3.connect(tmp_path / "c.sqlite") as db:
        per_sample = db.execute("SELECT t.ts_fabric_ns, COUNT(p.value) FROM sample_times t "
                                "LEFT JOIN points p ON p.ts_fabric_ns = t.ts_fabric_ns "
                                "GROUP BY 1 ORDER BY 1").fetchall()
    store.close()
    assert [n for _, n in per_sample] == [2, 0, 0, 2]


def _collector(tmp_path, monkeypatch, sample_s: float = 0.0, agents=None):
    from testbed.config import load_config
    from testbed.plan import compile_plan
    from testbed.run import collector as collector_mod
    from tests.conftest import REPO

    class Sampler:
        def __init__(self, plan, whole_plan=None) -> None:
            pass

        def sample(self) -> list[Sample]:
            time.sleep(sample_s)
            return [Sample(*STEADY, "class_bytes", 500)]

        def close(self) -> None:
            pass

    monkeypatch.setattr(collector_mod, "KernelSampler", Sampler)
    plan = compile_plan(load_config(REPO / "configs/default.yaml"),
                        max_wall_port_rate_bps=200_000_000)
    store = Store(tmp_path / "c.sqlite", create=True)
    return store, collector_mod.Collector(plan, store, 10**6, 0, agents)


def test_the_collector_imports_each_samples_agent_events_in_one_transaction(
        tmp_path, monkeypatch) -> None:
    events = tmp_path / "sw1-pfc.events.jsonl"
    events.write_text(
        '{"kind": "pfc_xoff", "mono_ns": 5, "port": "swp1", "tclass": 3, "bytes": 9000}\n'
        '{"kind": "pfc_xon", "mono_ns": 7, "port": "swp1", "tclass": 3}\n'
        'not json\n'
        '{"kind": "pfc_xoff", "mono_ns": 9')            # a line still being written
    agent = AgentEndpoint("pfc-sw1", "sw1", str(tmp_path / "no.sock"), str(events))
    store, collector = _collector(tmp_path, monkeypatch, agents=[agent])
    calls = []
    real = store.add_events
    monkeypatch.setattr(store, "add_events", lambda evs: (calls.append(len(evs)), real(evs)))
    collector.sample_once()
    with events.open("a") as fh:
        fh.write(', "port": "swp2", "tclass": 3}\n')
    collector.sample_once()
    got = [(e["kind"], e["node"], e["port"], e["tclass"], e.get("bytes")) for e in store.events()]
    store.close()
    assert calls == [2, 1]
    assert got == [("pfc_xoff", "sw1", "swp1", 3, 9000), ("pfc_xon", "sw1", "swp1", 3, None),
                   ("pfc_xoff", "sw1", "swp2", 3, None)]


def test_an_agent_event_without_a_port_is_stored_under_the_agents_name(
        tmp_path, monkeypatch) -> None:
    events = tmp_path / "ar-r1.events.jsonl"
    events.write_text('{"kind": "collective_phase", "mono_ns": 4000000, "rank": 1, '
                      '"phase": "reduce_scatter", "duration_ns": 20}\n')
    agent = AgentEndpoint("ar-r1", "h2", str(tmp_path / "no.sock"), str(events))
    store, collector = _collector(tmp_path, monkeypatch, agents=[agent])
    collector.sample_once()
    (got,) = store.events("collective_phase")
    store.close()
    assert (got["node"], got["port"], got["tclass"]) == ("h2", "ar-r1", -1)
    assert got["rank"] == 1 and got["duration_ns"] == 20
    assert got["ts_wall_ns"] == 4000000 and got["ts_fabric_ns"] == collector.fabric_now_ns(4000000)


def test_a_collector_that_misses_its_period_says_when_and_by_how_much(
        tmp_path, monkeypatch) -> None:
    # a 1 ms period and a sample that takes 5 ms: every tick of the workload is late
    store, collector = _collector(tmp_path, monkeypatch, sample_s=0.005)
    assert collector.late_notes() == []
    collector.start()
    time.sleep(0.05)
    collector.stop()
    store.close()
    [note] = collector.late_notes()
    assert collector.late_ticks >= 2
    assert f"fell behind its period {collector.late_ticks} times, between " in note
    first, last = collector.late_span_fabric_ns
    assert 0 <= first < last
    assert collector.longest_tick_wall_ns >= 5 * collector.period_wall_ns
    assert "us fabric (its slowest sample took" in note
