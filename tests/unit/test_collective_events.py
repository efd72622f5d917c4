"""What a collective rank leaves for the run's store: its events file (agents.runtime.events:
batched, whole lines, capped), its phase events and counters (sweep.PhaseLog), and the
flat numbers of its live snapshot as the collector samples them."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import types
from pathlib import Path

import pytest

from agents.collectives import sweep
from agents.collectives.__main__ import Live, build_parser
from agents.runtime import events as events_mod
from agents.runtime.control import SnapshotServer
from agents.runtime.events import EventLog
from agents.timebase import Dilation, FabricClock
from testbed.run.collector import AgentEndpoint, read_agent_samples


def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_events_wait_in_memory_until_a_flush_writes_them_as_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "r0.events.jsonl"
    writes: list[bytes] = []
    real_write = os.write
    monkeypatch.setattr(events_mod.os, "write",
                        lambda fd, data: (writes.append(bytes(data)), real_write(fd, data))[1])
    log = EventLog(str(path), flush_wall_ns=10**12)          # no timed flush in this test
    for i in range(3):
        log.emit("collective_phase", 1000 + i, rank=0, phase="reduce_scatter", iteration=i)
    assert path.read_text() == "" and writes == []            # emit never touches the file
    log.flush()
    log.emit("collective_phase", 2000, rank=0, phase="all_gather", iteration=3)
    log.close()
    assert len(writes) == 2                                   # one write per batch
    for chunk in writes:
        assert chunk.endswith(b"\n")
        assert all(json.loads(line) for line in chunk.splitlines())
    got = _lines(path)
    assert [(e["kind"], e["mono_ns"], e["iteration"]) for e in got] == [
        ("collective_phase", 1000, 0), ("collective_phase", 1001, 1),
        ("collective_phase", 1002, 2), ("collective_phase", 2000, 3)]
    assert log.counters() == {"events_written": 4, "events_dropped": 0}
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_the_flusher_thread_writes_within_its_period_and_not_on_the_emitters(
        tmp_path, monkeypatch):
    path = tmp_path / "e.jsonl"
    writers: list[str] = []
    real_write = os.write
    monkeypatch.setattr(events_mod.os, "write", lambda fd, data: (
        writers.append(threading.current_thread().name), real_write(fd, data))[1])
    log = EventLog(str(path), flush_wall_ns=20_000_000).start()
    try:
        log.emit("collective_phase", 1, rank=1)
        deadline = time.monotonic() + 5
        while not path.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(_lines(path)) == 1                          # written without close()
        log.emit("collective_phase", 2, rank=1)
    finally:
        log.close()
    assert len(_lines(path)) == 2
    assert writers and "MainThread" not in writers[:-1]       # only close() writes here


def test_a_short_write_is_completed(tmp_path, monkeypatch):
    path = tmp_path / "e.jsonl"
    real_write = os.write
    monkeypatch.setattr(events_mod.os, "write", lambda fd, data: real_write(fd, data[:7]))
    log = EventLog(str(path))
    for i in range(5):
        log.emit("collective_phase", i, rank=2, phase="tree_up")
    log.close()
    assert [e["mono_ns"] for e in _lines(path)] == [0, 1, 2, 3, 4]


def test_events_beyond_the_cap_are_counted_not_written(tmp_path, capsys):
    path = tmp_path / "e.jsonl"
    log = EventLog(str(path), max_events=3, who="rank 0")
    for i in range(5):
        log.emit("collective_phase", i, rank=0)
    log.flush()
    log.emit("collective_phase", 9, rank=0)
    log.close()
    assert [e["mono_ns"] for e in _lines(path)] == [0, 1, 2]
    assert log.counters() == {"events_written": 3, "events_dropped": 3}
    err = capsys.readouterr().err
    assert err.count("events_dropped") == 1 and "rank 0: 3 events written" in err


def test_a_failed_write_drops_that_batch_and_later_events_and_goes_on(tmp_path, monkeypatch,
                                                                     capsys):
    log = EventLog(str(tmp_path / "e.jsonl"))

    def full(_fd, _data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(events_mod.os, "write", full)
    log.emit("collective_phase", 1, rank=0)
    log.emit("collective_phase", 2, rank=0)
    log.flush()
    log.emit("collective_phase", 3, rank=0)
    log.close()
    assert log.counters() == {"events_written": 0, "events_dropped": 3}
    assert "No space left" in capsys.readouterr().err


def test_without_a_path_nothing_is_kept():
    log = EventLog(None).start()
    log.emit("collective_phase", 1, rank=0)
    log.close()
    assert log.counters() == {"events_written": 0, "events_dropped": 0}


def test_each_phase_is_one_event_stamped_with_its_wall_start_and_its_fabric_length(tmp_path):
    wall = [5_000_000]
    clock = FabricClock(Dilation(100), wall_ns=lambda: wall[0])     # origin: wall 5 ms
    path = tmp_path / "e.jsonl"
    log = EventLog(str(path))
    phases = sweep.PhaseLog(3, clock, log)
    phases.iteration(65536, 0, True)
    pc = sweep.PhaseClock(clock.now_ns, on_close=phases.close)
    wall[0] += 100_000                    # 1 us fabric after the origin
    pc.mark("reduce_scatter")
    wall[0] += 400_000                    # 4 us fabric
    pc.mark("all_gather")
    wall[0] += 200_000
    pc.end()
    phases.iteration(65536, 1, False)
    pc = sweep.PhaseClock(clock.now_ns, on_close=phases.close)
    pc.mark("reduce_scatter")
    wall[0] += 300_000
    pc.end()
    log.close()
    got = _lines(path)
    assert [(e["phase"], e["iteration"], e["warmup"], e["mono_ns"], e["end_mono_ns"],
             e["duration_ns"]) for e in got] == [
        ("reduce_scatter", 0, True, 5_100_000, 5_500_000, 4_000),
        ("all_gather", 0, True, 5_500_000, 5_700_000, 2_000),
        ("reduce_scatter", 1, False, 5_700_000, 6_000_000, 3_000)]
    assert all(e["rank"] == 3 and e["bytes"] == 65536 and e["kind"] == "collective_phase"
               for e in got)
    # the snapshot's cumulative counters, warm-ups included, and the PhaseClock agree
    assert phases.counters() == {"phase_reduce_scatter_ns": 7_000, "phase_all_gather_ns": 2_000}
    assert pc.ns == {"reduce_scatter": 3_000.0}


def test_the_live_snapshot_is_sampled_as_flat_collective_counters(tmp_path):
    args = build_parser().parse_args(["--rank", "1", "--peers", "1.1.1.1:1:1,1.1.1.2:1:1"])
    log = EventLog(str(tmp_path / "e.jsonl"))
    live = Live(args, log)
    transport = {"bytes_sent": 4096, "bytes_received": 2048, "retransmissions": 3,
                 "per_peer": {"0": {"bytes_sent": 4096}}, "settings": {"dscp": 26}}
    live.transport = types.SimpleNamespace(counters=lambda: dict(transport))  # type: ignore[assignment]
    live.ina = types.SimpleNamespace(totals={"retransmissions": 2, "bytes_sent": 900},  # type: ignore[assignment]
                                     max_error_bound=0.5)
    clock = FabricClock(Dilation(1), wall_ns=lambda: 0)
    live.phases = sweep.PhaseLog(1, clock, log)
    live.phases.close("in_network", 0.0, 1234.4)
    live.current_bytes, live.iteration = 65536, 2
    log.flush()
    sock = str(tmp_path / "r1.sock")
    server = SnapshotServer(sock, live.snapshot)
    try:
        samples = read_agent_samples(AgentEndpoint("ar-r1", "h2", sock))
    finally:
        server.close()
        log.close()
    got = {s.counter: s.value for s in samples}
    assert {s.port for s in samples} == {"ar-r1"} and {s.node for s in samples} == {"h2"}
    assert got["collective.bytes_sent"] == 4096 and got["collective.bytes_received"] == 2048
    assert got["collective.retransmissions"] == 3
    assert got["collective.ina_retransmissions"] == 2 and got["collective.ina_bytes_sent"] == 900
    assert got["collective.phase_in_network_ns"] == 1234
    assert got["collective.current_bytes"] == 65536 and got["collective.iteration"] == 2
    assert got["collective.rank"] == 1
    assert got["collective.events_written"] == 1 and got["collective.events_dropped"] == 0
    assert not [c for c in got if "per_peer" in c or "settings" in c]


@pytest.mark.parametrize("argv", [["--events", "/nonexistent/dir/e.jsonl"]])
def test_an_events_file_that_cannot_be_opened_is_a_bad_argument(argv, capsys):
    from agents.collectives.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(["--rank", "0", "--peers", "127.0.0.1:1:1,127.0.0.1:2:2", *argv])
    assert exc.value.code == 2 and "--events" in capsys.readouterr().err
