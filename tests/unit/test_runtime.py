"""The shared agent runtime (agents.runtime): what every agent relies on, without sockets
to the fabric (a UNIX socket and files in tmp_path at most)."""

from __future__ import annotations

import argparse
import errno
import json
import os

import pytest

from agents.runtime import argtypes
from agents.runtime.control import read_snapshot, serve_snapshots
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import PARENT_CHECK_NS, Lifecycle
from agents.runtime.output import mark_ready, report_counters, write_counters
from agents.runtime.sockets import CE, ECT0, SendErrors, timeval, tos_byte
from agents.runtime.waiting import wait_until_mono


class FakeClock:
    """Monotonic ns that moves by `tick_ns` per read (a spin makes progress) and by the
    time slept."""

    def __init__(self, now: int = 1_000_000_000, tick_ns: int = 0) -> None:
        self.now = now
        self.tick_ns = tick_ns
        self.sleeps: list[float] = []

    def __call__(self) -> int:
        self.now += self.tick_ns
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += round(seconds * 1e9)


def test_wire_overhead_is_udp_ipv4_ethernet_and_the_gap():
    assert WIRE_OVERHEAD_BYTES == 8 + 20 + 14 + 4 + 8 + 12 == 66


def test_tos_byte_takes_an_ecn_name_or_value():
    assert tos_byte(26, "ect0") == tos_byte(26, ECT0) == 0x6A
    assert tos_byte(0, CE) == 3
    with pytest.raises(ValueError, match="dscp"):
        tos_byte(64, 0)
    with pytest.raises(ValueError, match="2-bit"):
        tos_byte(0, 4)
    with pytest.raises(ValueError, match="ecn must be one of"):
        tos_byte(0, "ect2")


def test_timeval_never_means_block_forever():
    assert timeval(0) == timeval(1_000)          # 1 us, not 0
    assert timeval(1_500_000_000) == timeval(1_500_000_999)


def test_send_errors_count_retryable_failures_and_raise_the_rest(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("agents.runtime.sockets.time.sleep", slept.append)
    errs = SendErrors()
    assert errs.absorb(BlockingIOError(errno.EAGAIN, "timeout")) == "eagain"
    assert errs.absorb(OSError(errno.ENOBUFS, "qdisc full")) == "enobufs"
    assert errs.absorb(OSError(errno.ECONNREFUSED, "port unreachable")) == "icmp"
    assert (errs.eagain, errs.enobufs, errs.icmp_errors) == (1, 1, 1)
    assert slept == [50e-6]
    with pytest.raises(OSError, match="bad address"):
        errs.absorb(OSError(errno.EFAULT, "bad address"))


def test_lifecycle_keeps_the_first_reason_and_can_ignore_the_parent():
    ppid = [10]
    clock = FakeClock()
    life = Lifecycle(getppid=lambda: ppid[0], clock_ns=clock, watch_parent=False)
    ppid[0] = 1
    clock.now += 2 * PARENT_CHECK_NS
    assert not life.should_stop()
    life.stop("count")
    life.stop("duration")
    assert life.should_stop() and life.stop_reason == "count"


def test_wait_until_mono_sleeps_then_returns_at_the_moment_or_on_a_stop():
    clock = FakeClock(tick_ns=1_000)
    life = Lifecycle(getppid=lambda: 1, clock_ns=clock)
    target = clock.now + 30_000_000
    wait_until_mono(target, life, clock, clock.sleep)
    assert target <= clock.now < target + 10_000
    # one coarse sleep up to 200 us before the moment, then the spin
    assert clock.sleeps and sum(clock.sleeps) * 1e9 <= 30_000_000 - 200_000 + 1
    clock.now = target
    wait_until_mono(target, life, clock, clock.sleep)          # already there: at once
    wait_until_mono(0, life, clock, clock.sleep)               # 0: no start time
    life.stop("signal:SIGTERM")
    before = len(clock.sleeps)
    wait_until_mono(clock.now + 10**12, life, clock, clock.sleep)
    assert len(clock.sleeps) == before


def test_ready_file_is_touched_or_holds_one_json_line(tmp_path):
    plain, named = tmp_path / "ready", tmp_path / "ports"
    mark_ready(str(plain))
    assert plain.exists() and plain.read_text() == ""
    mark_ready(str(named), {"port": 5, "roce_port": 4791})
    assert json.loads(named.read_text()) == {"port": 5, "roce_port": 4791}
    assert named.read_text().count("\n") == 1
    mark_ready(None)
    assert sorted(os.listdir(tmp_path)) == ["ports", "ready"]   # no temporary left


def test_final_counters_go_to_stdout_as_one_line_and_to_out(tmp_path, capsys):
    out = tmp_path / "out.json"
    report_counters({"mode": "recv", "packets": 3}, str(out))
    line = capsys.readouterr().out
    assert line == '{"mode":"recv","packets":3}\n'
    assert json.loads(out.read_text()) == {"mode": "recv", "packets": 3}
    write_counters(None, {"ignored": True})


def test_snapshot_server_only_with_a_path(tmp_path):
    assert serve_snapshots(None, dict) is None
    path = str(tmp_path / "ctl.sock")
    server = serve_snapshots(path, lambda: {"packets": 7})
    assert server is not None
    try:
        assert read_snapshot(path) == {"packets": 7}
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        server.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize(("parse", "text"), [
    (argtypes.positive_int, "0"), (argtypes.nonneg_int, "-1"), (argtypes.port, "65536"),
    (argtypes.dscp, "64"), (argtypes.probability, "1"), (argtypes.json_object, "[1]"),
])
def test_argtypes_refuse_out_of_range_values(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)
