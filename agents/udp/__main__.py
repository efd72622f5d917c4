"""UDP traffic agent: paced sender, counting receiver, echo server and ping.

Synopsis (rates and durations in FABRIC units; `--dilation D` converts them
through `agents.timebase.Dilation`, the only place that does)::

    python -m agents.udp send --dst IP --dport PORT [--sport PORT] --rate-bps FABRIC_BPS
        --size PAYLOAD_BYTES (--duration-ns FABRIC_NS | --count N) [--flows K]
        [--dscp N] [--ecn {notect,ect0,ect1,ce}] [--wire-overhead-bytes 66]
        [--max-burst-bytes 65536] [--sndbuf-bytes N] [--recverr]
    python -m agents.udp recv --port PORT [--duration-ns FABRIC_NS] [--idle-exit-ns FABRIC_NS]
        [--wire-overhead-bytes 66] [--rcvbuf-bytes N]
    python -m agents.udp echo --port PORT [--duration-ns FABRIC_NS] [--dscp N] [--ecn E]
    python -m agents.udp ping --dst IP --dport PORT [--count N] [--timeout-ns FABRIC_NS]
        [--interval-ns FABRIC_NS] [--size BYTES] [--sport PORT] [--dscp N] [--ecn E]
    common: [--dilation D] [--bind IP] [--out FILE] [--ready-file FILE] [--control-sock PATH]

Every mode prints its final counters as ONE line of JSON on stdout when it
exits (and writes them to `--out` FILE, atomically, if given). Keys common to
all modes: mode, packets, bytes (UDP payload), wire_bytes (payload + the
per-packet overhead), start_wall_ns, end_wall_ns (CLOCK_REALTIME ns of the
first and last packet), wall_bps, fabric_bps (wire rate over first->last
packet, see `interval_rate_bps`), goodput_wall_bps, goodput_fabric_bps (same
on payload bytes), dilation, stopped_by ('count', 'duration', 'duration_blocked'
(a datagram was still blocked behind a paused port at the scheduled end), 'idle',
'done', 'parent', 'signal:SIGTERM', ...), wire_overhead_bytes.

- send: set_fabric_bps, set_wall_bps, size, tos, dscp, ecn, flow_count, flows
  {flow id: {sport, packets, bytes}}, enobufs, eagain, icmp_errors,
  max_late_ns, forgiven_ns, rebases, max_burst_packets.
- recv: lost, reordered, duplicates, foreign_packets (no agent header),
  ce_packets, ect_packets, tos_counts {tos byte: packets}, socket_drops
  (dropped at this socket because the receiver fell behind: SO_RXQ_OVFL, and
  SO_MEMINFO's count at exit),
  owd_wall_ns / owd_fabric_ns {count, min, avg, max} (one-way delay from the
  sender's CLOCK_REALTIME stamp; meaningful when both ends share a clock, as
  namespaces on one machine do), flows {"ip:sport/flow": {received,
  highest_seq, lost, reordered, duplicates, bytes}}.
- echo: (common keys only).
- ping: replies, lost, late_replies, foreign_replies (datagrams from another address
  than the probed one: not a reply, counted and ignored), malformed_replies (from it, but
  not a probe header), rtt_wall_ns / rtt_fabric_ns {count, min, avg, max}, rtts_wall_ns
  (first 1000).

Pacing (send): an absolute schedule (packet i due at start + i * interval,
interval = wire time of payload + `--wire-overhead-bytes` at the wall rate),
time.sleep while more than 200 us ahead, busy-wait for the last 200 us. A
sender that falls behind sends back-to-back, but never more than
`--max-burst-bytes` of frames behind schedule; time owed beyond that is
forgiven and reported (forgiven_ns, rebases), see `agents.udp.logic.Pacer`.
`--flows K` sends round-robin from K sockets; with `--sport P` their source
ports are P, P+1, ..., P+K-1, without it the kernel picks K ports. Each flow
numbers its packets from 0.

Sockets are blocking with SO_SNDTIMEO / SO_RCVTIMEO of at most 100 ms, so a
send blocked by a paused port pushes back on the sender (counted in eagain
each time the timeout expires, then retried) yet stop requests are still seen.
ENOBUFS is retried after 50 us and counted. UDP only reports ENOBUFS (a drop
in the local qdisc) with IP_RECVERR, which `--recverr` turns on; it is off by
default because then a drop that the host's own egress emulates on purpose
(PHY loss in tc-BPF) would be retried as well.

Lifecycle (`agents.runtime.lifecycle`): SIGTERM and SIGINT stop the agent
cleanly (counters are written), and it exits by itself when its parent process
dies, checked at most every 100 ms of wall time. (A parent that dies before
the agent has started Python is not noticed; bound such agents with
--duration-ns / --count / --idle-exit-ns.)

Exit codes: 0 done, 1 ping lost a probe or a socket error (JSON then has
'error'), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import errno
import socket
import struct
import sys
import time

from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import PARENT_CHECK_NS, Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.runtime.sockets import (
    CE,
    ECN_CODEPOINTS,
    SO_RXQ_OVFL,
    SendErrors,
    set_recv_buffer,
    set_recv_timeout,
    set_send_buffer,
    set_send_timeout,
    tos_byte,
)
from agents.runtime.start import add_start_arguments, await_start
from agents.runtime.waiting import pause_step, wait_until_mono
from agents.timebase import Dilation
from agents.udp.logic import (
    DEFAULT_MAX_BURST_BYTES,
    HEADER_BYTES,
    Pacer,
    RunningStats,
    SeqTracker,
    interval_rate_bps,
    pack_header_into,
    unpack_header,
)

# Linux socket options Python's socket module does not export (asm-generic values,
# as on x86 and arm).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
MSG_ERRQUEUE = getattr(socket, "MSG_ERRQUEUE", 0x2000)
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)
SK_MEMINFO_DROPS = 8            # index in the u32 array SO_MEMINFO returns

# Longest blocking socket call: a stop request is seen within one parent check.
TICK_NS = PARENT_CHECK_NS
MAX_FLOW_KEYS = 65536  # receiver: flows tracked individually
MAX_RTT_SAMPLES = 1000
TIMESPEC = struct.Struct("@ll")
U32 = struct.Struct("@I")
ANC_BUFSIZE = socket.CMSG_SPACE(1) + socket.CMSG_SPACE(TIMESPEC.size) + socket.CMSG_SPACE(4) + 64


# --- helpers -----------------------------------------------------------------------------


class Live:
    """Counters the send/recv loops update per packet, for live snapshots."""

    __slots__ = ("mode", "packets", "bytes", "wire_bytes", "ce_packets", "ect_packets")

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.packets = self.bytes = self.wire_bytes = 0
        self.ce_packets = self.ect_packets = 0

    def snapshot(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


LIVE = Live("none")


def _rates(dilation: Dilation, wire_total: int, wire_first: int, payload_total: int,
           payload_first: int, first_ns: int | None, last_ns: int | None) -> dict:
    if first_ns is None or last_ns is None:
        wall = goodput = 0.0
    else:
        wall = interval_rate_bps(wire_total, wire_first, first_ns, last_ns)
        goodput = interval_rate_bps(payload_total, payload_first, first_ns, last_ns)
    return {
        "wall_bps": round(wall),
        "fabric_bps": round(dilation.to_fabric_bps(wall)),
        "goodput_wall_bps": round(goodput),
        "goodput_fabric_bps": round(dilation.to_fabric_bps(goodput)),
    }


def _drain_errqueue(sock: socket.socket) -> None:
    for _ in range(64):
        try:
            sock.recvmsg(1, 512, MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except OSError:
            return


def _make_tx_socket(bind_ip: str, sport: int, tos: int, sndbuf: int | None,
                    recverr: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        set_send_timeout(sock, TICK_NS)
        set_recv_timeout(sock, TICK_NS)
        if recverr:
            sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
        set_send_buffer(sock, sndbuf)
        sock.bind((bind_ip, sport))
    except BaseException:
        sock.close()
        raise
    return sock


def _send_one(sock: socket.socket, data: bytes | bytearray | memoryview, dest: tuple[str, int],
              errs: SendErrors, life: Lifecycle, deadline_mono_ns: int | None = None) -> bool:
    """Send one datagram, retrying EAGAIN (send timeout), ENOBUFS and queued ICMP errors.

    Returns False if a stop was requested, or the sender's scheduled end passed, before
    it could go out: a sender blocked behind a port that stays paused (a PFC deadlock)
    ends at its scheduled time like any other, instead of waiting to be killed.
    """
    while True:
        try:
            sock.sendto(data, dest)
            return True
        except OSError as e:
            if errs.absorb(e) == "icmp":
                _drain_errqueue(sock)
        if life.should_stop():
            return False
        if deadline_mono_ns is not None and time.monotonic_ns() >= deadline_mono_ns:
            life.stop("duration_blocked")
            return False


# --- send --------------------------------------------------------------------------------


def run_send(args: argparse.Namespace, life: Lifecycle) -> tuple[dict, int]:
    dilation = Dilation(args.dilation)
    tos = tos_byte(args.dscp, args.ecn)
    set_wall_bps = dilation.to_wall_bps(args.rate_bps)
    frame_bytes = args.size + args.wire_overhead_bytes
    dest = (args.dst, args.dport)

    socks: list[socket.socket] = []
    try:
        for k in range(args.flows):
            sport = args.sport + k if args.sport else 0
            socks.append(_make_tx_socket(args.bind or "", sport, tos, args.sndbuf_bytes,
                                         args.recverr))
        mark_ready(args.ready_file)

        buf = bytearray(args.size)
        seqs = [0] * args.flows
        flow_bytes = [0] * args.flows
        errs = SendErrors()
        packets = 0
        first_mono = last_mono = None
        first_real = last_real = None
        clock = time.monotonic_ns
        # Every sender of a workload is started early and released together
        # at an agreed CLOCK_MONOTONIC time (one clock for all namespaces).
        await_start(args, life)
        start = clock()
        end = start + dilation.to_wall_ns(args.duration_ns) if args.duration_ns else None
        pacer = Pacer(set_wall_bps, frame_bytes, start, args.max_burst_bytes)
        while True:
            now = clock()
            if life.should_stop(now):
                break
            if args.count is not None and packets >= args.count:
                life.stop("count")
                break
            wait = pacer.poll(now)
            if end is not None and now + wait >= end:
                life.stop("duration")
                break
            if wait > 0:
                pause_step(wait, now, clock, time.sleep)
                continue
            flow = packets % args.flows
            real = time.time_ns()
            pack_header_into(buf, flow, seqs[flow], real)
            if not _send_one(socks[flow], buf, dest, errs, life, end):
                break
            mono = clock()
            if first_mono is None:
                first_mono, first_real = mono, real
            last_mono, last_real = mono, real
            seqs[flow] += 1
            flow_bytes[flow] += args.size
            packets += 1
            LIVE.packets = packets
            LIVE.bytes += args.size
            LIVE.wire_bytes += frame_bytes
            pacer.sent()

        counters = {
            "mode": "send",
            "dst": args.dst,
            "dport": args.dport,
            "packets": packets,
            "bytes": packets * args.size,
            "wire_bytes": packets * frame_bytes,
            "start_wall_ns": first_real,
            "end_wall_ns": last_real,
            **_rates(dilation, packets * frame_bytes, frame_bytes if packets else 0,
                     packets * args.size, args.size if packets else 0, first_mono, last_mono),
            "dilation": dilation.factor,
            "set_fabric_bps": args.rate_bps,
            "set_wall_bps": set_wall_bps,
            "size": args.size,
            "wire_overhead_bytes": args.wire_overhead_bytes,
            "tos": tos,
            "dscp": args.dscp,
            "ecn": args.ecn,
            "flow_count": args.flows,
            "flows": {
                str(k): {"sport": s.getsockname()[1], "packets": seqs[k], "bytes": flow_bytes[k]}
                for k, s in enumerate(socks)
            },
            "enobufs": errs.enobufs,
            "eagain": errs.eagain,
            "icmp_errors": errs.icmp_errors,
            "max_late_ns": pacer.max_late_ns,
            "forgiven_ns": pacer.forgiven_ns,
            "rebases": pacer.rebases,
            "max_burst_packets": pacer.max_burst_packets,
            "stopped_by": life.stop_reason or "done",
        }
        return counters, 0
    finally:
        for s in socks:
            s.close()


# --- recv --------------------------------------------------------------------------------


class _FlowCounters:
    __slots__ = ("tracker", "bytes")

    def __init__(self) -> None:
        self.tracker = SeqTracker()
        self.bytes = 0


def _meminfo_drops(sock: socket.socket) -> int:
    """Datagrams the kernel dropped at this socket (SO_MEMINFO's SK_MEMINFO_DROPS), 0 if
    the kernel cannot tell."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (SK_MEMINFO_DROPS + 1))
    except OSError:
        return 0
    if len(raw) < 4 * (SK_MEMINFO_DROPS + 1):
        return 0
    return struct.unpack_from("=I", raw, 4 * SK_MEMINFO_DROPS)[0]


def _parse_ancillary(ancdata) -> tuple[int | None, int | None, int | None]:
    tos = ts_ns = drops = None
    for level, ctype, data in ancdata:
        if level == socket.IPPROTO_IP and ctype == socket.IP_TOS and len(data) >= 1:
            tos = data[0]
        elif level == socket.SOL_SOCKET and ctype == SO_TIMESTAMPNS and len(data) >= TIMESPEC.size:
            sec, nsec = TIMESPEC.unpack_from(data)
            ts_ns = sec * 1_000_000_000 + nsec
        elif level == socket.SOL_SOCKET and ctype == SO_RXQ_OVFL and len(data) >= 4:
            drops = U32.unpack_from(data)[0]
    return tos, ts_ns, drops


def _rx_tick_ns(*limits: int | None) -> int:
    return max(1_000_000, min([TICK_NS] + [x for x in limits if x]))


def _make_rx_socket(bind_ip: str, port: int, rcvbuf: int | None, tick_ns: int) -> socket.socket:
    """The receiver's socket: each datagram comes with its TOS byte, a kernel receive
    timestamp and the socket's drop count; blocking reads return every `tick_ns`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
        except OSError:
            pass
        set_recv_buffer(sock, rcvbuf)
        set_recv_timeout(sock, tick_ns)
        sock.bind((bind_ip, port))
    except BaseException:
        sock.close()
        raise
    return sock


class _Receiver:
    """What the receiver counts: every datagram, its ECN mark, and per flow its sequence."""

    def __init__(self, overhead: int) -> None:
        self.overhead = overhead
        self.packets = self.nbytes = 0
        self.first_bytes: int | None = None
        self.first_ns: int | None = None      # CLOCK_REALTIME of the first / last arrival
        self.last_ns: int | None = None
        self.last_arrival_mono: int | None = None
        self.foreign = self.ce = self.ect = 0
        self.socket_drops = 0
        self.untracked_flow_packets = 0
        self.tos_counts: dict[int, int] = {}
        self.flows: dict[tuple[str, int, int], _FlowCounters] = {}
        self.owd = RunningStats()

    def on_datagram(self, buf: bytearray, n: int, anc: list, addr: tuple[str, int],
                    now_mono: int) -> None:
        tos, ts_ns, drops = _parse_ancillary(anc)
        if ts_ns is None:
            ts_ns = time.time_ns()
        if drops is not None:
            self.socket_drops = drops
        self.packets += 1
        self.nbytes += n
        LIVE.packets = self.packets
        LIVE.bytes = self.nbytes
        LIVE.wire_bytes += n + self.overhead
        if self.first_ns is None:
            self.first_ns, self.first_bytes = ts_ns, n
        self.last_ns = ts_ns
        self.last_arrival_mono = now_mono
        if tos is not None:
            self._on_tos(tos)
        hdr = unpack_header(buf, n)
        if hdr is None:
            self.foreign += 1
        else:
            self._on_probe(hdr, addr, n, ts_ns)

    def _on_tos(self, tos: int) -> None:
        self.tos_counts[tos] = self.tos_counts.get(tos, 0) + 1
        if tos & 3 == CE:
            self.ce += 1
            LIVE.ce_packets = self.ce
        elif tos & 3:
            self.ect += 1
            LIVE.ect_packets = self.ect

    def _on_probe(self, hdr: tuple[int, int, int], addr: tuple[str, int], n: int,
                  ts_ns: int) -> None:
        """A datagram an agent sent: its flow's sequence accounting and one-way delay."""
        flow, seq, send_ns = hdr
        key = (addr[0], addr[1], flow)
        fc = self.flows.get(key)
        if fc is None and len(self.flows) < MAX_FLOW_KEYS:
            fc = self.flows[key] = _FlowCounters()
        if fc is None:
            self.untracked_flow_packets += 1
        else:
            fc.tracker.observe(seq)
            fc.bytes += n
        self.owd.add(ts_ns - send_ns)

    def counters(self, sock: socket.socket, dilation: Dilation, life: Lifecycle) -> dict:
        overhead = self.overhead
        # SO_RXQ_OVFL's count rides on packets queued after a drop: when the last
        # drops came after the last packet (a receiver that stalled while its queue was
        # full), only the socket itself still knows them.
        socket_drops = max(self.socket_drops, _meminfo_drops(sock))
        trackers = [fc.tracker for fc in self.flows.values()]
        packets, nbytes, first_bytes = self.packets, self.nbytes, self.first_bytes
        return {
            "mode": "recv",
            "port": sock.getsockname()[1],
            "packets": packets,
            "bytes": nbytes,
            "wire_bytes": nbytes + packets * overhead,
            "start_wall_ns": self.first_ns,
            "end_wall_ns": self.last_ns,
            **_rates(dilation, nbytes + packets * overhead,
                     (first_bytes + overhead) if first_bytes is not None else 0,
                     nbytes, first_bytes or 0, self.first_ns, self.last_ns),
            "dilation": dilation.factor,
            "wire_overhead_bytes": overhead,
            "lost": sum(t.lost for t in trackers),
            "reordered": sum(t.reordered for t in trackers),
            "duplicates": sum(t.duplicates for t in trackers),
            "foreign_packets": self.foreign,
            "untracked_flow_packets": self.untracked_flow_packets,
            "ce_packets": self.ce,
            "ect_packets": self.ect,
            "tos_counts": {str(k): v for k, v in sorted(self.tos_counts.items())},
            "socket_drops": socket_drops,
            "owd_wall_ns": self.owd.as_dict(),
            "owd_fabric_ns": self.owd.as_dict(dilation.to_fabric_ns),
            "flows": {
                f"{ip}:{port}/{flow}": {**fc.tracker.as_dict(), "bytes": fc.bytes}
                for (ip, port, flow), fc in sorted(self.flows.items())
            },
            "stopped_by": life.stop_reason or "done",
        }


def run_recv(args: argparse.Namespace, life: Lifecycle) -> tuple[dict, int]:
    dilation = Dilation(args.dilation)
    duration_wall = dilation.to_wall_ns(args.duration_ns) if args.duration_ns else None
    idle_wall = dilation.to_wall_ns(args.idle_exit_ns) if args.idle_exit_ns else None
    sock = _make_rx_socket(args.bind or "", args.port, args.rcvbuf_bytes,
                           _rx_tick_ns(duration_wall, idle_wall))
    try:
        mark_ready(args.ready_file)
        rx = _Receiver(args.wire_overhead_bytes)
        buf = bytearray(65536)
        clock = time.monotonic_ns
        end = clock() + duration_wall if duration_wall else None
        draining = False
        while True:
            try:
                n, anc, _flags, addr = sock.recvmsg_into([buf], ANC_BUFSIZE)
            except (BlockingIOError, TimeoutError, InterruptedError):
                n = None
            now = clock()
            if n is not None:
                rx.on_datagram(buf, n, anc, addr, now)
            if end is not None and now >= end:
                life.stop("duration")
            if (idle_wall and rx.last_arrival_mono is not None
                    and now - rx.last_arrival_mono >= idle_wall):
                life.stop("idle")
            if life.should_stop(now):
                # Read what is already queued in the socket before exiting: those
                # datagrams arrived; leaving them unread would count them as lost.
                if n is None and draining:
                    break
                if not draining:
                    draining = True
                    sock.setblocking(False)
        return rx.counters(sock, dilation, life), 0
    finally:
        sock.close()


# --- echo --------------------------------------------------------------------------------


def run_echo(args: argparse.Namespace, life: Lifecycle) -> tuple[dict, int]:
    dilation = Dilation(args.dilation)
    overhead = args.wire_overhead_bytes
    duration_wall = dilation.to_wall_ns(args.duration_ns) if args.duration_ns else None
    sock = _make_tx_socket(args.bind or "", args.port, tos_byte(args.dscp, args.ecn), None,
                           False)
    try:
        set_recv_timeout(sock, _rx_tick_ns(duration_wall))
        mark_ready(args.ready_file)
        errs = SendErrors()
        buf = bytearray(65536)
        view = memoryview(buf)
        clock = time.monotonic_ns
        end = clock() + duration_wall if duration_wall else None
        packets = nbytes = 0
        first_bytes = None
        first_ns = last_ns = None
        while True:
            try:
                n, addr = sock.recvfrom_into(buf)
            except (BlockingIOError, TimeoutError, InterruptedError):
                n = None
            if n is not None:
                ts = time.time_ns()
                packets += 1
                nbytes += n
                LIVE.packets = packets
                LIVE.bytes = nbytes
                LIVE.wire_bytes += n + overhead
                if first_ns is None:
                    first_ns, first_bytes = ts, n
                last_ns = ts
                _send_one(sock, view[:n], addr, errs, life)
            now = clock()
            if life.should_stop(now):
                break
            if end is not None and now >= end:
                life.stop("duration")
                break
        counters = {
            "mode": "echo",
            "port": sock.getsockname()[1],
            "packets": packets,
            "bytes": nbytes,
            "wire_bytes": nbytes + packets * overhead,
            "start_wall_ns": first_ns,
            "end_wall_ns": last_ns,
            **_rates(dilation, nbytes + packets * overhead,
                     (first_bytes + overhead) if first_bytes is not None else 0,
                     nbytes, first_bytes or 0, first_ns, last_ns),
            "dilation": dilation.factor,
            "wire_overhead_bytes": overhead,
            "enobufs": errs.enobufs,
            "eagain": errs.eagain,
            "stopped_by": life.stop_reason or "done",
        }
        return counters, 0
    finally:
        sock.close()


# --- ping --------------------------------------------------------------------------------

#: Patience for one probe when --timeout-ns is not given, in WALL time: a
#: reachability check is about whether the machine delivers the probe at all.
DEFAULT_PING_TIMEOUT_WALL_NS = 1_000_000_000


def run_ping(args: argparse.Namespace, life: Lifecycle) -> tuple[dict, int]:
    dilation = Dilation(args.dilation)
    overhead = args.wire_overhead_bytes
    timeout_wall = (dilation.to_wall_ns(args.timeout_ns) if args.timeout_ns
                    else DEFAULT_PING_TIMEOUT_WALL_NS)
    interval_wall = dilation.to_wall_ns(args.interval_ns) if args.interval_ns else 0
    dest = (args.dst, args.dport)
    sock = _make_tx_socket(args.bind or "", args.sport or 0, tos_byte(args.dscp, args.ecn),
                           None, False)
    try:
        mark_ready(args.ready_file)
        errs = SendErrors()
        buf = bytearray(args.size)
        rbuf = bytearray(65536)
        clock = time.monotonic_ns
        rtt = RunningStats()
        rtts: list[int] = []
        sent = replies = late = foreign = malformed = 0
        first_mono = last_mono = first_real = last_real = None
        start = clock()
        for seq in range(args.count):
            if life.should_stop():
                break
            wait_until_mono(start + seq * interval_wall, life)
            real = time.time_ns()
            pack_header_into(buf, 0, seq, real)
            sent_mono = clock()
            if not _send_one(sock, buf, dest, errs, life):
                break
            sent += 1
            if first_mono is None:
                first_mono, first_real = sent_mono, real
            last_mono, last_real = sent_mono, real
            deadline = sent_mono + timeout_wall
            while not life.should_stop():
                now = clock()
                if now >= deadline:
                    break
                set_recv_timeout(sock, min(deadline - now, TICK_NS))
                try:
                    n, addr = sock.recvfrom_into(rbuf)
                except (BlockingIOError, TimeoutError, InterruptedError):
                    continue
                except OSError as e:  # an ICMP error queued for this socket
                    if e.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                        errs.icmp_errors += 1
                        continue
                    raise
                got = clock()
                if addr != dest:
                    foreign += 1
                    continue
                hdr = unpack_header(rbuf, n)
                if hdr is None:
                    malformed += 1
                    continue
                if hdr[1] != seq:
                    late += 1
                    continue
                replies += 1
                rtt.add(got - sent_mono)
                if len(rtts) < MAX_RTT_SAMPLES:
                    rtts.append(got - sent_mono)
                break
        if life.stop_reason is None:
            life.stop("count")
        counters = {
            "mode": "ping",
            "dst": args.dst,
            "dport": args.dport,
            "packets": sent,
            "bytes": sent * args.size,
            "wire_bytes": sent * (args.size + overhead),
            "start_wall_ns": first_real,
            "end_wall_ns": last_real,
            **_rates(dilation, sent * (args.size + overhead),
                     (args.size + overhead) if sent else 0, sent * args.size,
                     args.size if sent else 0, first_mono, last_mono),
            "dilation": dilation.factor,
            "wire_overhead_bytes": overhead,
            "count": args.count,
            "replies": replies,
            "lost": sent - replies,
            "late_replies": late,
            "foreign_replies": foreign,
            "malformed_replies": malformed,
            "icmp_errors": errs.icmp_errors,
            "rtt_wall_ns": rtt.as_dict(),
            "rtt_fabric_ns": rtt.as_dict(dilation.to_fabric_ns),
            "rtts_wall_ns": rtts,
            "stopped_by": life.stop_reason,
        }
        return counters, 0 if replies == args.count else 1
    finally:
        sock.close()


# --- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dilation", type=argtypes.positive_int, default=1,
                        help="time-dilation factor D: the fabric runs D times slower (default 1)")
    common.add_argument("--bind", metavar="IP", default=None, help="local address to bind")
    common.add_argument("--out", metavar="FILE", help="also write the final counters JSON here")
    common.add_argument("--control-sock", metavar="PATH",
                        help="serve a live counter snapshot (one JSON line) on this UNIX socket")
    common.add_argument("--ready-file", metavar="FILE",
                        help="touch FILE once the socket(s) are bound")
    common.add_argument("--wire-overhead-bytes", type=argtypes.nonneg_int,
                        default=WIRE_OVERHEAD_BYTES,
                        help="bytes per packet on the wire beyond the UDP payload: 8 UDP + 20 "
                             "IPv4 + 14 Ethernet + 24 preamble/IFG/FCS (default %(default)s)")

    tos = argparse.ArgumentParser(add_help=False)
    tos.add_argument("--dscp", type=argtypes.dscp, default=0, help="DSCP 0..63 (default 0)")
    tos.add_argument("--ecn", choices=sorted(ECN_CODEPOINTS), default="notect",
                     help="ECN codepoint of sent packets (default notect)")

    parser = argparse.ArgumentParser(
        prog="python -m agents.udp",
        description="UDP traffic agent: paced sender, counting receiver, echo, ping. "
                    "Rates and durations are in fabric units; --dilation converts them.")
    sub = parser.add_subparsers(dest="mode", required=True)

    p = sub.add_parser("send", parents=[common, tos], help="paced sender")
    p.add_argument("--dst", required=True, metavar="IP")
    p.add_argument("--dport", required=True, type=argtypes.port)
    p.add_argument("--sport", type=argtypes.port, default=0,
                   help="first source port; flow k uses sport+k (default: kernel picks)")
    p.add_argument("--rate-bps", required=True, type=argtypes.positive_int, metavar="FABRIC_BPS",
                   help="wire rate (payload + overhead) in fabric bits per second")
    p.add_argument("--size", required=True, type=int, metavar="PAYLOAD_BYTES",
                   help=f"UDP payload bytes per packet (>= {HEADER_BYTES})")
    stop = p.add_mutually_exclusive_group(required=True)
    stop.add_argument("--duration-ns", type=argtypes.positive_int, metavar="FABRIC_NS")
    stop.add_argument("--count", type=argtypes.positive_int, metavar="N", help="total packets")
    add_start_arguments(p)
    p.add_argument("--start-at-mono-ns", type=argtypes.nonneg_int, default=0, metavar="MONO_NS",
                   help="wait until CLOCK_MONOTONIC reaches this (wall ns) before sending")
    p.add_argument("--flows", type=argtypes.positive_int, default=1, metavar="K",
                   help="K sockets, round-robin, consecutive source ports (default 1)")
    p.add_argument("--max-burst-bytes", type=argtypes.positive_int, default=DEFAULT_MAX_BURST_BYTES,
                   help="most wire bytes the sender may fall behind its schedule and catch "
                        "up back-to-back; more is forgiven (default %(default)s)")
    p.add_argument("--sndbuf-bytes", type=argtypes.positive_int, default=None)
    p.add_argument("--recverr", action="store_true",
                   help="set IP_RECVERR so local qdisc drops come back as ENOBUFS and are "
                        "retried")

    p = sub.add_parser("recv", parents=[common], help="counting receiver")
    p.add_argument("--port", required=True, type=argtypes.port)
    p.add_argument("--duration-ns", type=argtypes.positive_int, metavar="FABRIC_NS",
                   help="stop this long after binding")
    p.add_argument("--idle-exit-ns", type=argtypes.positive_int, metavar="FABRIC_NS",
                   help="stop when nothing arrived for this long (counted from the last "
                        "arrival; never before the first)")
    p.add_argument("--rcvbuf-bytes", type=argtypes.positive_int, default=4 * 1024 * 1024)

    p = sub.add_parser("echo", parents=[common, tos], help="echo every datagram back")
    p.add_argument("--port", required=True, type=argtypes.port)
    p.add_argument("--duration-ns", type=argtypes.positive_int, metavar="FABRIC_NS")

    p = sub.add_parser("ping", parents=[common, tos], help="probe an echo server")
    p.add_argument("--dst", required=True, metavar="IP")
    p.add_argument("--dport", required=True, type=argtypes.port)
    p.add_argument("--sport", type=argtypes.port, default=0)
    p.add_argument("--count", type=argtypes.positive_int, default=3)
    p.add_argument("--size", type=int, default=64, metavar="PAYLOAD_BYTES")
    p.add_argument("--timeout-ns", type=argtypes.positive_int, metavar="FABRIC_NS",
                   help="wait this long for each reply (default: 1 s of wall time)")
    p.add_argument("--interval-ns", type=argtypes.nonneg_int, default=0, metavar="FABRIC_NS",
                   help="probe i goes at start + i * interval at the earliest (default 0: "
                        "next probe right after the previous reply or timeout)")
    return parser


MODES = {"send": run_send, "recv": run_recv, "echo": run_echo, "ping": run_ping}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    size = getattr(args, "size", None)
    if size is not None and not HEADER_BYTES <= size <= 65507:
        parser.error(f"--size must be {HEADER_BYTES}..65507 bytes, got {size}")
    if args.mode == "send" and args.sport and args.sport + args.flows - 1 > 65535:
        parser.error("--sport + --flows - 1 exceeds 65535")

    life = Lifecycle()
    life.install_signal_handlers()
    LIVE.mode = args.mode
    server = serve_snapshots(args.control_sock, LIVE.snapshot)
    try:
        counters, rc = MODES[args.mode](args, life)
    except OSError as e:  # e.g. the address cannot be bound: say so on both channels
        print(f"agents.udp {args.mode}: {e}", file=sys.stderr)
        counters, rc = {"mode": args.mode, "error": str(e), "stopped_by": "error"}, 1
    finally:
        if server is not None:
            server.close()
    report_counters(counters, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
