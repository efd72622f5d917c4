"""UDP traffic agent: pure pacing/sequence logic with fake clocks, then the real
program on 127.0.0.1 (loopback only, no root)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.sockets import tos_byte
from agents.runtime.waiting import pause_step
from agents.udp.__main__ import build_parser
from agents.udp.logic import (
    HEADER_BYTES,
    Pacer,
    SeqTracker,
    interval_rate_bps,
    pack_header_into,
    unpack_header,
)
from tests.conftest import REPO

LOOPBACK = "127.0.0.1"


class FakeClock:
    """Monotonic ns clock that only moves when told; sleep() advances it (with overshoot)."""

    def __init__(self, start_ns: int = 1_000_000_000, sleep_overshoot_ns: int = 0,
                 tick_ns: int = 0) -> None:
        self.now = start_ns
        self.sleep_overshoot_ns = sleep_overshoot_ns
        self.tick_ns = tick_ns  # cost of each clock read (busy-wait progress)
        self.sleeps: list[float] = []

    def __call__(self) -> int:
        self.now += self.tick_ns
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += round(seconds * 1e9) + self.sleep_overshoot_ns


# --- pacer -------------------------------------------------------------------------------


def test_pacer_due_times_are_absolute_and_never_drift():
    # 7 Mb/s with 1066-byte frames: the interval (1218285.714... ns) is not an integer
    pacer = Pacer(wall_bps=7_000_000, frame_bytes=1066, start_ns=5_000)
    assert pacer.interval_ns == pytest.approx(1066 * 8 * 1e9 / 7e6)
    for _ in range(1_000_000):
        pacer.sent()
    assert pacer.due_ns() == 5_000 + 1_000_000 * 1066 * 8 * 1_000_000_000 // 7_000_000
    assert pacer.forgiven_ns == 0


def test_pacer_waits_when_ahead_and_sends_when_due():
    pacer = Pacer(wall_bps=8_000_000, frame_bytes=1000, start_ns=0)  # 1 ms per frame
    assert pacer.poll(0) == 0
    pacer.sent()
    assert pacer.poll(250_000) == 750_000
    assert pacer.poll(1_000_000) == 0
    pacer.sent()
    assert pacer.poll(2_400_000) == -400_000  # late but within the burst bound: send now
    assert pacer.max_late_ns == 400_000
    assert pacer.forgiven_ns == 0


def test_pacer_small_stall_is_caught_up_in_full():
    pacer = Pacer(wall_bps=8_000_000, frame_bytes=1000, start_ns=0, max_burst_bytes=10_000)
    assert pacer.max_burst_packets == 10
    now = 5_500_000  # stalled 5.5 intervals before the first send: 6 packets owed
    sent_now = 0
    while pacer.poll(now) <= 0:
        pacer.sent()
        sent_now += 1
    assert sent_now == 6
    assert pacer.forgiven_ns == 0
    assert pacer.due_ns() == 6_000_000


def test_pacer_catch_up_burst_is_bounded_and_the_rest_forgiven():
    pacer = Pacer(wall_bps=8_000_000, frame_bytes=1000, start_ns=0, max_burst_bytes=4_500)
    assert pacer.max_burst_packets == 4
    now = 100_000_000  # stalled 100 intervals
    burst = 0
    while pacer.poll(now) <= 0:
        pacer.sent()
        burst += 1
    assert burst == 4
    assert pacer.rebases == 1
    assert pacer.forgiven_ns == 100_000_000 - 3_000_000
    # the schedule resumes at the set rate from where the burst left it
    assert pacer.poll(now) == 1_000_000
    assert pacer.poll(now + 1_000_000) == 0


def test_send_loop_with_sleep_overshoot_holds_the_rate_exactly():
    # the agent's loop shape (poll, pause_step, send) against a clock whose sleeps
    # overshoot by 80 us and whose sends cost 5 us
    clock = FakeClock(sleep_overshoot_ns=80_000, tick_ns=100)
    pacer = Pacer(wall_bps=100_000_000, frame_bytes=8066, start_ns=clock.now)
    send_times = []
    while len(send_times) < 2000:
        now = clock()
        wait = pacer.poll(now)
        if wait > 0:
            pause_step(wait, now, clock, clock.sleep)
            continue
        send_times.append(clock())
        clock.now += 5_000
        pacer.sent()
    rate = interval_rate_bps(2000 * 8066, 8066, send_times[0], send_times[-1])
    assert rate == pytest.approx(100e6, rel=1e-4)
    assert pacer.forgiven_ns == 0
    jitter = max(t - (send_times[0] + i * 8066 * 80) for i, t in enumerate(send_times))
    assert jitter < 10_000  # never more than a few us late, although every sleep overshoots


def test_pause_step_sleeps_coarsely_then_spins_to_the_deadline():
    clock = FakeClock(tick_ns=1_000)
    start = clock.now
    pause_step(10_000_000, start, clock, clock.sleep, spin_ns=200_000)
    assert clock.sleeps == [pytest.approx(0.0098)]  # stops 200 us short
    clock.sleeps.clear()
    now = clock()
    pause_step(start + 10_000_000 - now, now, clock, clock.sleep, spin_ns=200_000)
    assert clock.sleeps == []  # busy-waited
    assert start + 10_000_000 <= clock.now < start + 10_000_000 + 2_000
    pause_step(10**12, clock.now, clock, clock.sleep, max_sleep_ns=50_000_000)
    assert clock.sleeps == [pytest.approx(0.05)]  # long waits come back to the caller


# --- sequence accounting -----------------------------------------------------------------


def test_seq_tracker_counts_in_order_arrivals_without_loss():
    t = SeqTracker()
    assert [t.observe(s) for s in range(5)] == ["in_order"] * 5
    assert (t.received, t.lost, t.reordered, t.duplicates, t.expected) == (5, 0, 0, 0, 5)


def test_seq_tracker_gap_is_loss_until_the_late_packet_arrives():
    t = SeqTracker()
    for s in (0, 1, 4):
        t.observe(s)
    assert t.lost == 2
    assert t.observe(2) == "reordered"
    assert (t.lost, t.reordered) == (1, 1)
    assert t.observe(2) == "duplicate"
    assert t.observe(4) == "duplicate"
    assert (t.lost, t.reordered, t.duplicates, t.received) == (1, 1, 2, 6)


def test_seq_tracker_loss_of_the_first_packets_counts():
    t = SeqTracker()
    t.observe(3)
    assert t.lost == 3


def test_seq_tracker_memory_is_bounded_but_loss_still_counted():
    t = SeqTracker(max_missing=100)
    t.observe(0)
    t.observe(1_000_001)  # a gap of a million
    assert t.lost == 1_000_000
    assert len(t._missing) == 100
    assert t.observe(1_000_000) == "reordered"  # recent gaps are still remembered
    assert t.lost == 999_999
    for s in range(1_000_002, 1_000_300, 2):  # many small gaps push old ones out
        t.observe(s)
    assert len(t._missing) <= 100
    assert t.lost == 999_999 + 148


# --- wire format and arithmetic ----------------------------------------------------------


def test_tos_byte_combines_dscp_and_ecn():
    assert tos_byte(26, "ect0") == 0x6A
    assert tos_byte(48, "notect") == 0xC0
    assert tos_byte(0, "ce") == 3
    assert tos_byte(10, "ect1") == 41
    with pytest.raises(ValueError):
        tos_byte(64)


def test_header_round_trip_and_foreign_payloads_rejected():
    buf = bytearray(100)
    pack_header_into(buf, flow=3, seq=2**40 + 5, send_ns=1_700_000_000_123_456_789)
    assert unpack_header(buf, 100) == (3, 2**40 + 5, 1_700_000_000_123_456_789)
    assert unpack_header(buf, HEADER_BYTES - 1) is None
    assert unpack_header(bytearray(100), 100) is None
    assert WIRE_OVERHEAD_BYTES == 66


def test_interval_rate_of_a_perfect_train_is_its_set_rate():
    # 3 packets of 1000 B, 1 ms apart = 8 Mb/s; the first packet only opens the interval
    assert interval_rate_bps(3000, 1000, 0, 2_000_000) == pytest.approx(8e6)
    assert interval_rate_bps(1000, 1000, 5, 5) == 0.0


def test_lifecycle_stops_when_the_parent_changes():
    ppid = [4242]
    clock = FakeClock(tick_ns=0)
    life = Lifecycle(getppid=lambda: ppid[0], clock_ns=clock)
    assert not life.should_stop()
    ppid[0] = 1  # reparented: our parent died
    clock.now += 50_000_000
    assert not life.should_stop()  # checked at most every 100 ms
    clock.now += 60_000_000
    assert life.should_stop()
    assert life.stop_reason == "parent"


def test_cli_requires_exactly_one_of_duration_and_count():
    parser = build_parser()
    base = ["send", "--dst", LOOPBACK, "--dport", "9", "--rate-bps", "1000", "--size", "100"]
    with pytest.raises(SystemExit):
        parser.parse_args(base)
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--count", "1", "--duration-ns", "5"])
    args = parser.parse_args([*base, "--count", "1", "--dilation", "10"])
    assert (args.count, args.dilation, args.wire_overhead_bytes) == (1, 10, 66)


# --- the program on loopback -------------------------------------------------------------


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _agent(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agents.udp", *argv], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(path: Path, proc: subprocess.Popen | None = None, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"agent exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear")
        time.sleep(0.01)


def _finish(proc: subprocess.Popen, timeout_s: float = 10.0) -> tuple[int, dict]:
    out, err = proc.communicate(timeout=timeout_s)
    lines = out.splitlines()
    assert len(lines) == 1, (out, err)
    return proc.returncode, json.loads(lines[0])


def test_paced_send_is_received_at_the_set_wire_rate_without_loss_with_dscp(tmp_path):
    # fabric 100 Mb/s at dilation 5 = 20 Mb/s of wall rate, for 1.5 s of wall time
    port, sport = _free_udp_port(), _free_udp_port()
    ready = tmp_path / "recv.ready"
    recv = _agent("recv", "--bind", LOOPBACK, "--port", str(port), "--ready-file", str(ready),
                  "--idle-exit-ns", "60000000", "--duration-ns", "1000000000",  # 0.3 s, 5 s wall
                  "--dilation", "5", "--out", str(tmp_path / "recv.json"))
    _wait_for(ready, recv)
    send = _agent("send", "--bind", LOOPBACK, "--dst", LOOPBACK, "--dport", str(port),
                  "--sport", str(sport), "--flows", "2", "--rate-bps", "100000000",
                  "--size", "8000", "--duration-ns", "300000000", "--dilation", "5",
                  "--dscp", "26", "--ecn", "ect0")
    rc, sent = _finish(send)
    assert rc == 0
    rc, got = _finish(recv)
    assert rc == 0
    assert json.loads((tmp_path / "recv.json").read_text()) == got

    assert sent["set_wall_bps"] == 20_000_000
    assert sent["stopped_by"] == "duration" and got["stopped_by"] == "idle"
    assert sent["packets"] == pytest.approx(1.5 * 20e6 / (8066 * 8), abs=2)
    assert got["wall_bps"] == pytest.approx(20e6, rel=0.05)
    assert got["fabric_bps"] == pytest.approx(100e6, rel=0.05)
    assert got["goodput_wall_bps"] == pytest.approx(20e6 * 8000 / 8066, rel=0.05)
    assert got["wire_bytes"] == got["bytes"] + 66 * got["packets"]
    assert (got["packets"], got["lost"], got["reordered"], got["socket_drops"]) == (
        sent["packets"], 0, 0, 0)
    assert got["tos_counts"] == {str(0x6A): got["packets"]}
    assert got["ect_packets"] == got["packets"] and got["ce_packets"] == 0
    assert sorted(got["flows"]) == [f"{LOOPBACK}:{sport}/0", f"{LOOPBACK}:{sport + 1}/1"]
    assert [f["sport"] for f in sent["flows"].values()] == [sport, sport + 1]


def test_ping_gets_every_probe_back_from_echo(tmp_path):
    port = _free_udp_port()
    ready = tmp_path / "echo.ready"
    echo = _agent("echo", "--bind", LOOPBACK, "--port", str(port), "--ready-file", str(ready))
    try:
        _wait_for(ready, echo)
        ping = _agent("ping", "--dst", LOOPBACK, "--dport", str(port), "--count", "5",
                      "--dilation", "10")
        rc, res = _finish(ping)
        assert rc == 0
        assert (res["packets"], res["replies"], res["lost"]) == (5, 5, 0)
        assert len(res["rtts_wall_ns"]) == 5
        assert 0 < res["rtt_wall_ns"]["min"] <= res["rtt_wall_ns"]["max"] < 1e9
        assert res["rtt_fabric_ns"]["avg"] == pytest.approx(res["rtt_wall_ns"]["avg"] / 10,
                                                            abs=0.1)
    finally:
        echo.send_signal(signal.SIGTERM)
        rc, served = _finish(echo)
    assert rc == 0 and served["packets"] == 5 and served["stopped_by"] == "signal:SIGTERM"


def test_ping_counts_foreign_and_malformed_datagrams_and_still_gets_its_reply():
    import threading

    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((LOOPBACK, 0))
    stranger.bind((LOOPBACK, 0))
    server.settimeout(10)

    def answer():       # junk from the probed address, the probe from another, then the echo
        probe, addr = server.recvfrom(65536)
        server.sendto(b"junk", addr)
        stranger.sendto(probe, addr)
        time.sleep(0.05)
        server.sendto(probe, addr)

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        rc, res = _finish(_agent("ping", "--dst", LOOPBACK, "--dport",
                                 str(server.getsockname()[1]), "--count", "1"))
    finally:
        t.join(5)
        server.close()
        stranger.close()
    assert rc == 0 and res["replies"] == 1
    assert (res["foreign_replies"], res["malformed_replies"]) == (1, 1)


def test_ping_without_an_echo_server_fails():
    rc, res = _finish(_agent("ping", "--dst", LOOPBACK, "--dport", str(_free_udp_port()),
                             "--count", "2", "--timeout-ns", "50000000"))
    assert rc == 1
    assert (res["packets"], res["replies"], res["lost"]) == (2, 0, 2)


def test_sigterm_stops_the_receiver_and_writes_its_counters(tmp_path):
    port = _free_udp_port()
    ready, out = tmp_path / "ready", tmp_path / "out.json"
    recv = _agent("recv", "--bind", LOOPBACK, "--port", str(port), "--ready-file", str(ready),
                  "--out", str(out))
    _wait_for(ready, recv)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"not an agent packet", (LOOPBACK, port))
    time.sleep(0.1)
    recv.send_signal(signal.SIGTERM)
    rc, got = _finish(recv, timeout_s=2)
    assert rc == 0
    assert got["stopped_by"] == "signal:SIGTERM"
    assert (got["packets"], got["foreign_packets"], got["lost"]) == (1, 1, 0)
    assert json.loads(out.read_text()) == got


def test_agent_exits_when_its_parent_dies(tmp_path):
    port = _free_udp_port()
    ready, out = tmp_path / "ready", tmp_path / "out.json"
    # a parent that starts the agent, waits until it is listening, then dies
    parent_code = (
        "import os, subprocess, sys, time\n"
        "subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL)\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
    )
    parent = subprocess.run(
        [sys.executable, "-c", parent_code, str(ready), sys.executable, "-m", "agents.udp",
         "recv", "--bind", LOOPBACK, "--port", str(port), "--ready-file", str(ready),
         "--out", str(out)], cwd=REPO, timeout=10)
    assert parent.returncode == 0
    _wait_for(out, timeout_s=3)
    assert json.loads(out.read_text())["stopped_by"] == "parent"


def test_bad_arguments_exit_with_code_2():
    proc = _agent("send", "--dst", LOOPBACK, "--dport", "9", "--rate-bps", "1000",
                  "--size", str(HEADER_BYTES - 1), "--count", "1")
    _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 2
    assert "--size" in err

