"""Packet captures of a run (`--capture`): tcpdump on every host NIC, and what each
capture missed.

A capture is a witness, not part of the fabric: when tcpdump's kernel ring fills (a
busy 2-core VM can starve it for a moment), the kernel drops the copy, not the packet.
The run must say so, or a pcap with a hole reads as a fabric that lost packets. tcpdump
prints its own count when it stops ("N packets dropped by kernel"); this module keeps
it in `pcap/capture.json` and turns a nonzero count into a fidelity note.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

from agents.timebase import wall_timeout_s
from testbed.plan import Plan
from testbed.run.procs import AgentProcess, start_process

# 64 MiB per capture (tcpdump -B counts KiB): the default 2 MiB ring holds ~500 frames
# of 4 KB RoCE payload, which a scheduler hiccup of a few ms overflows.
CAPTURE_BUFFER_KIB = 65536

_STAT = re.compile(r"^(\d+) packets? (captured|received by filter|dropped by kernel)$")
_STAT_KEYS = {"captured": "captured", "received by filter": "received_by_filter",
              "dropped by kernel": "dropped_by_kernel"}


def start_captures(plan: Plan, run_dir: Path, snaplen: int = 0) -> list[AgentProcess]:
    """tcpdump on every host NIC. Whole frames by default: a RoCE packet's ICRC is its
    last four bytes, and a truncated capture cannot show it (tcpdump -s 0 = 262144).
    --immediate-mode: without it libpcap hands packets over a ring block at a time (up
    to a second late) and tcpdump stopped at the end of a run lost the last block.
    -Z root: the files stay root's, like the rest of the run directory."""
    pcap = run_dir / "pcap"
    pcap.mkdir(mode=0o700)
    procs = []
    for host in plan.hosts():
        for iface in host.interfaces:
            out = pcap / f"{host.name}-{iface.ifname}.pcap"
            procs.append(start_process(
                plan.lab, host.netns,
                ["tcpdump", "-q", "--immediate-mode", "-U", "-Z", "root",
                 "-B", str(CAPTURE_BUFFER_KIB), "-i", iface.ifname, "-s", str(snaplen),
                 "-w", str(out)], f"tcpdump-{host.name}-{iface.ifname}",
                stdout=subprocess.DEVNULL))
    time.sleep(0.5)   # tcpdump needs a moment before it sees packets
    return procs


def parse_tcpdump_stats(stderr: str) -> dict[str, int]:
    """tcpdump's closing counts, {captured, received_by_filter, dropped_by_kernel};
    the keys it did not print are absent."""
    out = {}
    for line in stderr.splitlines():
        m = _STAT.match(line.strip())
        if m:
            out[_STAT_KEYS[m.group(2)]] = int(m.group(1))
    return out


def stop_captures(procs: list[AgentProcess], run_dir: Path) -> list[str]:
    """Stop every capture, keep its counts in pcap/capture.json and return a fidelity
    note for each one that missed packets or did not say how many it caught."""
    stats: dict[str, dict] = {}
    notes = []
    for proc in procs:
        proc.stop()
        try:
            _out, err = proc.popen.communicate(timeout=wall_timeout_s(5))
        except subprocess.TimeoutExpired:
            err = ""
        # the plan's interface names have no '-' (eth0, swp3); a host's name may
        port = ":".join(proc.name.removeprefix("tcpdump-").rsplit("-", 1))
        counts = parse_tcpdump_stats(err or "")
        stats[port] = {**counts, "exit_code": proc.popen.returncode}
        dropped = counts.get("dropped_by_kernel")
        if dropped is None:
            notes.append(f"the capture on {port} did not report what it caught (tcpdump "
                         f"exited {proc.popen.returncode}: {(err or '').strip()[-200:]!r}); "
                         "its pcap may be incomplete")
        elif dropped:
            notes.append(f"the capture on {port} missed {dropped} packets (tcpdump's kernel "
                         "ring was full; the kernel dropped the copies, not the packets): "
                         "its pcap has holes the fabric did not make")
    if procs:
        (run_dir / "pcap" / "capture.json").write_text(json.dumps(stats, indent=1,
                                                                  sort_keys=True) + "\n")
    return notes
