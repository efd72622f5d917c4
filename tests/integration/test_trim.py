"""Packet trimming at a real switch port: UET packets over the threshold are cut and sent
in the strict class; other packets of the class are tail-dropped.

A lab of h1 - sw1 - h2 built from a config (config -> plan -> port programs, as a run
builds it): h1's link is 16 times faster than h2's, so a burst from h1 queues at sw1's
port toward h2, in a lossy class with `trim: true` and a small threshold (port class
`edge`; h1's NIC keeps the default 1 MB buffer, so nothing is lost before the switch).
MTU 1500 keeps HTB's burst (two frames) small, so the queue builds from the first
packets on. A receiver in
h2 reads every frame that arrives at its NIC on an AF_PACKET socket (before the IP
stack), so it sees the trimmed packets exactly as the switch left them, and any PFC
frame.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents import portmaps
from testbed.net import counters as kernel_counters
from testbed.net import portprog
from testbed.net.sampler import KernelSampler
from testbed.results.store import Store
from testbed.results.tables import port_rows, totals
from tests.integration.bpfrun import TC_ACT_OK, TC_ACT_SHOT, Program, frame
from tests.integration.conftest import built_lab

pytestmark = pytest.mark.root

TC_ACT_REDIRECT = 7                  # the program's verdict for a trimmed packet

UET_PORT = 4793
OTHER_PORT = 4794
DATA_TC, DATA_DSCP = 2, 18
TRIM_TC, TRIM_DSCP = 6, 48
THRESHOLD = 12_000
BUFFER = 24_000
TRIM_SIZE = 128
PAYLOAD = 1000                       # UDP payload: IP 1028 B, frame 1042 B
FRAME = 14 + 20 + 8 + PAYLOAD
BURST = 40
ECT0 = 2

CONFIG = """
name: {name}
dilation: 2500
mtu: 1500
roce_mtu: 1024
traffic_classes:
  - {{tc: 2, name: uet, dscp: [18], trim: true}}
  - {{tc: 6, name: cnp, dscp: [48], strict: true}}
  - {{tc: 0, name: default, default: true}}
qos:
  edge:
    buffer: {{2: 24KB}}
    trim: {{threshold: 12KB, size: 128}}
nodes:
  - {{name: h1, role: host}}
  - {{name: h2, role: host}}
  - {{name: sw1, role: switch}}
links:
  - {{a: h1, b: sw1, port: 400GBASE-CR4, length: 2m}}
  - {{a: sw1, b: h2, port: 25GBASE-CR, length: 2m, qos: edge}}
"""

RECEIVER = r"""
import json, signal, socket, sys
ifname, out, ready = sys.argv[1], sys.argv[2], sys.argv[3]
raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
raw.setsockopt(socket.SOL_SOCKET, 33, 1 << 24)      # SO_RCVBUFFORCE
raw.bind((ifname, 0))
raw.settimeout(0.05)
sinks = []
for port in (4793, 4794):                            # so h2 sends no ICMP unreachable
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    sinks.append(s)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
open(ready, "w").close()
frames = []
while True:
    try:
        data, addr = raw.recvfrom(65535)
    except (socket.timeout, InterruptedError):
        if stop:
            break
        continue
    if addr[2] == socket.PACKET_OUTGOING:
        continue
    frames.append(data.hex())
with open(out, "w") as fh:
    json.dump(frames, fh)
"""

SENDER = r"""
import json, socket, struct, sys
dst = sys.argv[1]
dport, count, size, tos = (int(a) for a in sys.argv[2:6])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 11, 1)               # SO_NO_CHECK: UDP checksum 0
s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
s.setsockopt(socket.IPPROTO_IP, 10, 2)               # IP_MTU_DISCOVER = IP_PMTUDISC_DO
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
s.bind(("0.0.0.0", 40000 + dport % 1000))
data = [struct.pack("!I", seq) + bytes((seq * 7 + i) & 0xFF for i in range(size - 4))
        for seq in range(count)]
for d in data:                                       # back to back: a burst
    s.sendto(d, (dst, dport))
print(json.dumps({"sent": count}))
"""


def payload(seq: int) -> bytes:
    return struct.pack("!I", seq) + bytes((seq * 7 + i) & 0xFF for i in range(PAYLOAD - 4))


def ip_checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


class Capture:
    def __init__(self, netns: str, ifname: str, tmp: Path) -> None:
        self.out = tmp / "frames.json"
        ready = tmp / "ready"
        self.proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c",
                                      RECEIVER, ifname, str(self.out), str(ready)])
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert self.proc.poll() is None, "receiver died"
            assert time.monotonic() < deadline, "receiver did not start"
            time.sleep(0.01)

    def stop(self) -> list[bytes]:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        return [bytes.fromhex(f) for f in json.loads(self.out.read_text())]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def send(netns: str, dst: str, dport: int, count: int) -> None:
    res = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", SENDER, dst,
                          str(dport), str(count), str(PAYLOAD), str(DATA_DSCP << 2 | ECT0)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def udp_frames(frames: list[bytes], dport: int) -> list[bytes]:
    """The IPv4 packets (IP header on) of `frames` that are UDP to `dport`."""
    out = []
    for f in frames:
        if struct.unpack_from("!H", f, 12)[0] != 0x0800:
            continue
        ip = f[14:]
        if ip[9] == 17 and struct.unpack_from("!H", ip, 22)[0] == dport:
            out.append(ip[:struct.unpack_from("!H", ip, 2)[0]])
    return out


def drained(pin: Path, tcs: tuple[int, ...], timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        c = portprog.read_counters(pin)
        if all(c[tc].vq_bytes == 0 for tc in tcs) or time.monotonic() > deadline:
            return c
        time.sleep(0.02)


def test_uet_packets_over_the_threshold_are_trimmed_into_the_strict_class(tmp_path):
    with built_lab(CONFIG, "trim") as plan:
        sw1, h1, h2 = plan.node("sw1"), plan.node("h1"), plan.node("h2")
        port = next(i for i in sw1.interfaces if i.peer.node == "h2")
        data = next(c for c in port.egress.classes if c.tc == DATA_TC)
        assert data.trim is not None and data.trim.threshold_bytes == THRESHOLD
        assert (data.trim.size_bytes, data.trim.tc, data.trim.dscp) == (TRIM_SIZE, TRIM_TC,
                                                                        TRIM_DSCP)
        assert all(c.trim is None for i in h1.interfaces for c in i.egress.classes)
        assert all(c.pfc is None for n in plan.nodes for i in n.interfaces
                   for c in i.egress.classes), "a lossy fabric: no PFC anywhere"
        pin = portprog.pin_dir_of(plan.lab, "sw1", port.ifname)
        dst = h2.interfaces[0].address.split("/")[0]
        # ARP and route warm-up at the default class, then counters from zero
        send(h1.netns, dst, 9, 2)
        drained(pin, (DATA_TC, TRIM_TC, 0))
        portprog.reset_state(pin)
        _before, before_classes = kernel_counters.read_counters(plan)

        capture = Capture(h2.netns, h2.interfaces[0].ifname, tmp_path)
        try:
            send(h1.netns, dst, UET_PORT, BURST)
            after_uet = drained(pin, (DATA_TC, TRIM_TC))
            sampler = KernelSampler(plan)           # what a run's collector stores
            try:
                sampled = sampler.sample()
            finally:
                sampler.close()
            send(h1.netns, dst, OTHER_PORT, BURST)
            after_other = drained(pin, (DATA_TC, TRIM_TC))
            time.sleep(0.2)
            frames = capture.stop()
            _after, after_classes = kernel_counters.read_counters(plan)
        finally:
            capture.kill()

    uet = udp_frames(frames, UET_PORT)
    full = [p for p in uet if len(p) == 20 + 8 + PAYLOAD]
    short = [p for p in uet if len(p) != 20 + 8 + PAYLOAD]
    c, t = after_uet[DATA_TC], after_uet[TRIM_TC]
    seqs = [struct.unpack_from("!I", p, 28)[0] if len(p) >= 32 else -1 for p in uet]
    # nothing of the UET burst is lost: every packet arrives whole or trimmed
    assert len(uet) == BURST and c.tail_drops == 0 and c.trim_errors == 0, (c, t)
    assert c.trims == len(short) > BURST // 2, (c, seqs)
    # the first packets fill the queue up to the threshold whole, then trimming begins
    admitted_first = THRESHOLD // FRAME
    assert sorted(struct.unpack_from("!I", p, 28)[0] for p in full)[:admitted_first] == \
        list(range(admitted_first)), seqs
    assert c.max_vq_bytes <= THRESHOLD + FRAME
    assert c.enq_packets == len(full)
    for p in short:
        assert len(p) == TRIM_SIZE, "a trimmed packet keeps exactly trim.size bytes of IP"
        assert struct.unpack_from("!H", p, 2)[0] == TRIM_SIZE
        assert p[1] == TRIM_DSCP << 2 | ECT0, "the trim class's DSCP, the ECN bits kept"
        assert ip_checksum(p[:20]) == 0xFFFF, "a valid IP header checksum"
        assert struct.unpack_from("!HH", p, 24) == (TRIM_SIZE - 20, 0), "UDP length, csum 0"
        seq = struct.unpack_from("!I", p, 28)[0]
        assert p[28:] == payload(seq)[:TRIM_SIZE - 28], "the first bytes as they were sent"
        assert struct.unpack_from("!H", p, 22)[0] == UET_PORT
    # the trim class's accounting balances: every short packet admitted and departed
    assert t.enq_packets == t.dep_packets == len(short)
    assert t.enq_bytes == t.dep_bytes == len(short) * (14 + TRIM_SIZE)
    assert t.dep_mismatch == t.dep_unmatched == 0 and t.tail_drops == 0
    assert c.dep_mismatch == c.dep_unmatched == 0
    # HTB classified the rewritten packets by their new DSCP: the strict class sent them
    def sent(classes, tc: int) -> int:
        return next(k.packets for k in classes
                    if (k.node, k.ifname, k.tc) == ("sw1", port.ifname, tc))
    assert sent(after_classes, TRIM_TC) - sent(before_classes, TRIM_TC) == len(short)
    # ... and charged them their new length (the qdisc length the kernel sets before the
    # egress hook is set again: the program re-enqueues the short packet)
    def sent_bytes(classes, tc: int) -> int:
        return next(k.bytes for k in classes
                    if (k.node, k.ifname, k.tc) == ("sw1", port.ifname, tc))
    assert sent_bytes(after_classes, TRIM_TC) - sent_bytes(before_classes, TRIM_TC) == \
        len(short) * (14 + TRIM_SIZE)

    # sampled into the store like ECN marks, and summed into the summary's port row
    with Store(tmp_path / "counters.sqlite", create=True) as store:
        store.add_samples(0, 0, sampled, final=True)
        rows = port_rows(plan, store)
    row = next(r for r in rows if (r["node"], r["port"], r["tclass"]) ==
               ("sw1", port.ifname, DATA_TC))
    assert row["trims"] == c.trims and row["drops"] == 0
    assert totals(rows, 0)["trims"] == c.trims
    assert {r["trims"] for r in rows if r is not row} == {0}

    # other packets of the class are tail-dropped at the buffer, never trimmed
    other = udp_frames(frames, OTHER_PORT)
    o = after_other[DATA_TC]
    assert o.trims == c.trims and o.trim_errors == 0
    assert o.tail_drops > 0 and len(other) == BURST - o.tail_drops
    assert all(len(p) == 20 + 8 + PAYLOAD for p in other)
    assert o.max_vq_bytes <= BUFFER
    # no PFC frame reached h2
    assert not [f for f in frames if struct.unpack_from("!H", f, 12)[0] == 0x8808]


def test_trimming_decisions_packet_by_packet_on_synthetic_frames():
    """BPF_PROG_TEST_RUN on one port instance: exact threshold, exact bytes out, the trim
    class's accounting, and what is never trimmed (tests/integration/bpfrun.py)."""
    lab = f"bpftrim{os.getpid()}"
    pin = portprog.pin_dir_of(lab, "sw", "swp1")
    portprog.load_programs([pin])
    egress = Program(pin / "progs" / "port_egress")
    departure = Program(pin / "progs" / "port_departure")
    maps = portmaps.PortMaps(pin)
    node = portmaps.NodeMaps(portprog.node_dir_of(lab, "sw"))
    try:
        node.write_params(portmaps.NodeParams(mode="static"))      # a switch, nothing tracked
        node.reset()
        maps.write_params(portmaps.PortParams(
            dscp_to_tc={DATA_DSCP: DATA_TC, TRIM_DSCP: TRIM_TC}, default_tc=0,
            classes={DATA_TC: portmaps.ClassParams(limit_bytes=BUFFER),
                     TRIM_TC: portmaps.ClassParams(limit_bytes=3 * (14 + TRIM_SIZE))},
            trims={DATA_TC: portmaps.TrimParams(THRESHOLD, TRIM_SIZE, TRIM_TC, TRIM_DSCP)}))
        maps.reset()

        def uet(seq: int, **kw) -> bytes:
            f = bytearray(frame(FRAME, dscp=DATA_DSCP, ecn=ECT0, dport=UET_PORT, **kw))
            struct.pack_into("!I", f, 42, seq)
            ip = f[14:34]
            struct.pack_into("!H", ip, 10, 0)
            struct.pack_into("!H", ip, 10, 0xFFFF - ip_checksum(bytes(ip)))
            f[14:34] = ip
            return bytes(f)

        fit = THRESHOLD // FRAME
        for seq in range(fit):                      # queue + len <= threshold: admitted
            verdict, out = egress.run(uet(seq))
            assert (verdict, len(out)) == (TC_ACT_OK, FRAME)
        sent = uet(fit)
        verdict, out = egress.run(sent)             # the next one would pass the threshold
        # cut, and redirected to the port's egress: the kernel enqueues it afresh, with
        # its new length, and the program sees it again as an arrival of the trim class
        assert verdict == TC_ACT_REDIRECT and len(out) == 14 + TRIM_SIZE
        assert out[:14] == sent[:14] and out[14 + 1] == TRIM_DSCP << 2 | ECT0
        assert struct.unpack_from("!H", out, 16)[0] == TRIM_SIZE
        assert ip_checksum(out[14:34]) == 0xFFFF
        assert struct.unpack_from("!HH", out, 14 + 24) == (TRIM_SIZE - 20, 0)
        assert out[14 + 28:] == sent[14 + 28:14 + TRIM_SIZE]
        c = maps.read()
        assert (c[DATA_TC].trims, c[DATA_TC].enq_packets, c[DATA_TC].vq_bytes) == (
            1, fit, fit * FRAME)
        assert c[TRIM_TC].packets == 0
        assert egress.run(out) == (TC_ACT_OK, out)  # the second pass: admitted to TC6
        assert (c := maps.read())[TRIM_TC].enq_packets == 1
        assert (c[TRIM_TC].packets, c[TRIM_TC].vq_bytes) == (1, 14 + TRIM_SIZE)
        # the trim class's own buffer: 3 short packets fit, the 4th is tail-dropped there
        for seq in range(fit + 1, fit + 4):
            verdict, short = egress.run(uet(seq))
            assert verdict == TC_ACT_REDIRECT
            egress.run(short)
        c = maps.read()
        assert c[DATA_TC].trims == 4 and c[TRIM_TC].enq_packets == 3
        assert c[TRIM_TC].tail_drops == 1 and c[DATA_TC].trim_errors == 0
        # departures of the short packets, classified by their DSCP, leave the trim class
        departure.run(out)
        c = maps.read()
        assert c[TRIM_TC].dep_packets == 1 and c[TRIM_TC].dep_unmatched == 0
        assert c[DATA_TC].dep_packets == 0
        # never trimmed: another port, a short packet, a fragment; they tail-drop as before
        other, _ = egress.run(frame(FRAME, dscp=DATA_DSCP, dport=OTHER_PORT))
        small, _ = egress.run(frame(14 + TRIM_SIZE, dscp=DATA_DSCP, dport=UET_PORT))
        frag = bytearray(uet(99))
        frag[14 + 6] |= 0x20                       # more fragments
        fragment, _ = egress.run(bytes(frag))
        c = maps.read()
        assert c[DATA_TC].trims == 4
        assert (other, fragment) == (TC_ACT_OK, TC_ACT_OK)    # below the buffer: admitted
        assert small == TC_ACT_OK
        while maps.read()[DATA_TC].vq_bytes + FRAME <= BUFFER:
            egress.run(frame(FRAME, dscp=DATA_DSCP, dport=OTHER_PORT))
        dropped, _ = egress.run(frame(FRAME, dscp=DATA_DSCP, dport=OTHER_PORT))
        assert dropped == TC_ACT_SHOT and maps.read()[DATA_TC].tail_drops == 1
        c = maps.read()[DATA_TC]
        assert c.packets == c.enq_packets + c.tail_drops + c.trims
    finally:
        egress.close()
        departure.close()
        maps.close()
        node.close()
        portprog.detach_lab(lab)
    assert not (portprog.PIN_ROOT / lab).exists()
