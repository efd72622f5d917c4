"""A capture that missed packets says so: tcpdump's closing counts reach pcap/capture.json
and the run's fidelity notes (no root)."""

from __future__ import annotations

import json
import subprocess
import sys

from testbed.run.capture import parse_tcpdump_stats, stop_captures
from testbed.run.procs import AgentProcess

TCPDUMP_STDERR = """\
tcpdump: listening on eth0, link-type EN10MB (Ethernet), snapshot length 262144 bytes
941 packets captured
944 packets received by filter
3 packets dropped by kernel
"""


def test_tcpdumps_closing_counts_are_read():
    assert parse_tcpdump_stats(TCPDUMP_STDERR) == {
        "captured": 941, "received_by_filter": 944, "dropped_by_kernel": 3}
    assert parse_tcpdump_stats("1 packet captured\n") == {"captured": 1}
    assert parse_tcpdump_stats("tcpdump: eth9: No such device exists\n") == {}


def _fake_tcpdump(name: str, stderr: str, code: int = 0) -> AgentProcess:
    # waits for SIGTERM like tcpdump, then prints its counts to stderr
    script = ("import signal, sys, time\n"
              "def bye(*_):\n"
              f"    sys.stderr.write({stderr!r}); sys.exit({code})\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "print('ready', flush=True)\n"
              "time.sleep(30)\n")
    popen = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert popen.stdout.readline().strip() == "ready"
    return AgentProcess(name=name, netns="-", popen=popen)


def test_a_capture_that_missed_packets_is_a_fidelity_note_and_counted(tmp_path):
    (tmp_path / "pcap").mkdir()
    procs = [_fake_tcpdump("tcpdump-h3-eth0", TCPDUMP_STDERR),
             _fake_tcpdump("tcpdump-gpu-1-eth0", "5 packets captured\n5 packets received by "
                                              "filter\n0 packets dropped by kernel\n"),
             _fake_tcpdump("tcpdump-h2-eth0", "tcpdump: eth0: That device is not up\n", 1)]
    notes = stop_captures(procs, tmp_path)
    assert len(notes) == 2
    assert "the capture on h3:eth0 missed 3 packets" in notes[0]
    assert "h2:eth0 did not report what it caught" in notes[1] and "not up" in notes[1]
    stats = json.loads((tmp_path / "pcap" / "capture.json").read_text())
    assert stats["h3:eth0"] == {"captured": 941, "received_by_filter": 944,
                                "dropped_by_kernel": 3, "exit_code": 0}
    assert stats["gpu-1:eth0"]["dropped_by_kernel"] == 0
    assert stats["h2:eth0"] == {"exit_code": 1}
