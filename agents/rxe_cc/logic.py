"""DCQCN around kernel Soft-RoCE, as pure logic with an injected clock.

rdma_rxe has no congestion control: it ignores ECN, sends no CNPs and ignores
CNPs. The rxe_cc agent emulates the NIC's DCQCN from outside:

- `NotificationPoint` (receiver): from snapshots of the per-QP CE counters
  the NIC's BPF program keeps (CE-marked RoCEv2 packets per BTH DestQP), which
  QPs earn a CNP now. One `agents.rdma.cc.DcqcnNp` per QP decides, with the
  run's DCQCN interval and mode: at most one CNP per interval per QP.
- `ReactionPoint` (sender): from snapshots of the CNP counters of the same
  program (CNPs that arrived at this host), one `agents.rdma.cc.DcqcnRp`
  for the whole host: each new CNP is a CNP event of the state machine, its
  timers run in fabric time. The rate applies per HOST CLASS (the lossless
  class of the host's NIC), not per QP: every QP of the host shares it.
- `ClassRateLimiter`: when the host class's HTB rate should change (a bounded
  update rate and a minimum relative change), and to what.
- `build_cnp_frame`: the CNP as an Ethernet frame (IPv4/UDP 4791, BTH 0x81,
  BECN, 16 zero bytes, ICRC), for an AF_PACKET socket.

Times are fabric ns (passed in as `now_ns`), rates fabric bit/s, except where
a name says wall. Polling quantizes the NP: a CE packet earns its CNP at the
poll that sees it, so a CNP is up to one poll period late (the agent polls
several times per CNP interval).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from agents.rdma.cc import DcqcnNp, DcqcnParams, DcqcnRp
from agents.wire.icrc import (
    IPPROTO_UDP,
    IPV4_HEADER_BYTES,
    ROCE_UDP_PORT,
    UDP_HEADER_BYTES,
    IcrcContext,
    ipv4_header_for_icrc,
)
from agents.wire.roce import BTH_BYTES, CNP_RESERVED_BYTES, ICRC_BYTES, build_cnp

ETH_P_IP = 0x0800
ETH_HEADER = struct.Struct("!6s6sH")
CNP_UDP_PAYLOAD_BYTES = BTH_BYTES + CNP_RESERVED_BYTES + ICRC_BYTES


# --- notification point --------------------------------------------------------------


@dataclass
class NpQp:
    """One local QP the NP has seen CE marks for."""

    np: DcqcnNp
    ce_seen: int = 0            # CE count at the last snapshot (the program's counter)
    ce_packets: int = 0         # CE packets accounted here (counter resets included)
    cnps_due: int = 0           # CNPs decided


class NotificationPoint:
    """Which local QPs earn a CNP, from snapshots of their CE counters.

    `observe(ce_counts, now_ns)` takes {local QPN: CE packets counted so far} and
    returns the QPNs to send a CNP for now, each at most once per `cnp_interval_ns`
    (per DcqcnNp's mode). A counter lower than before (the program's entry was made
    anew) counts from zero again. A QP's first snapshot counts from zero: the
    program starts with the run.
    """

    def __init__(self, cnp_interval_ns: float,
                 mode: Literal["interval", "timer"] = "interval") -> None:
        DcqcnNp(cnp_interval_ns, mode)      # check the arguments once
        self.cnp_interval_ns = cnp_interval_ns
        self.mode = mode
        self.qps: dict[int, NpQp] = {}

    def observe(self, ce_counts: Mapping[int, int], now_ns: float) -> list[int]:
        due = []
        for qpn, count in sorted(ce_counts.items()):
            qp = self.qps.get(qpn)
            if qp is None:
                qp = self.qps[qpn] = NpQp(DcqcnNp(self.cnp_interval_ns, self.mode))
            new = count - qp.ce_seen if count >= qp.ce_seen else count
            qp.ce_seen = count
            if new <= 0:
                continue
            qp.ce_packets += new
            # The new CE packets arrived since the last poll; the first one seen now
            # may earn a CNP, the others are coalesced into it (same poll time).
            if qp.np.on_packet(True, now_ns):
                qp.cnps_due += 1
                due.append(qpn)
        return due

    @property
    def ce_packets(self) -> int:
        return sum(q.ce_packets for q in self.qps.values())

    @property
    def cnps_due(self) -> int:
        return sum(q.cnps_due for q in self.qps.values())


# --- reaction point ------------------------------------------------------------------


class ReactionPoint:
    """The DCQCN reaction point of one host class, fed from CNP counter snapshots.

    `observe(cnp_total, now_ns)`: the host's CNPs received so far (summed over its
    QPs); each new one is an `on_cnp` of the one DcqcnRp. `advance(now_ns)` runs its
    timers. `on_bytes_sent(total_bytes, now_ns)` feeds the byte counter from the
    class's sent-bytes counter (a snapshot, not a delta). The rate is the class's.
    """

    def __init__(self, params: DcqcnParams, line_rate_bps: float, now_ns: float) -> None:
        self.rp = DcqcnRp(params, line_rate_bps, now_ns)
        self.cnps_seen = 0          # counter value at the last snapshot
        self.cnps_received = 0      # CNPs fed to the state machine
        self.bytes_seen: int | None = None

    @property
    def rate_bps(self) -> float:
        return self.rp.rate_bps

    @property
    def rate_cuts(self) -> int:
        return int(self.rp.snapshot()["counters"]["rate_decreases"])

    def observe(self, cnp_total: int, now_ns: float) -> float:
        new = cnp_total - self.cnps_seen if cnp_total >= self.cnps_seen else cnp_total
        self.cnps_seen = cnp_total
        for _ in range(max(0, new)):
            self.rp.on_cnp(now_ns)
        self.cnps_received += max(0, new)
        return self.rp.advance(now_ns)

    def on_bytes_sent(self, total_bytes: int, now_ns: float) -> float:
        if self.bytes_seen is None or total_bytes < self.bytes_seen:
            self.bytes_seen = total_bytes
            return self.rp.advance(now_ns)
        delta, self.bytes_seen = total_bytes - self.bytes_seen, total_bytes
        return self.rp.on_bytes_sent(delta, now_ns)

    def advance(self, now_ns: float) -> float:
        return self.rp.advance(now_ns)


@dataclass(frozen=True)
class ClassRate:
    """One HTB class change: the class's new rate and ceil (wall bit/s)."""

    wall_rate_bps: int
    wall_ceil_bps: int
    fabric_rate_bps: float      # the DCQCN rate it applies (fabric)
    restore: bool               # back to the planned rate and ceil


@dataclass
class ClassRateLimiter:
    """When and how the host class's HTB rate follows the DCQCN rate.

    The planned class has a guaranteed `planned_wall_rate_bps` and may borrow up to
    `planned_wall_ceil_bps`. A DCQCN rate below the line rate becomes the ceil (and
    the rate, where it is lower than the guarantee); the line rate restores the plan.
    Changes are sent at most once per `min_interval_ns` (fabric) and only when the
    rate moved by `min_change` (relative) since the last one applied; a restore and
    the first cut always go out (when the interval allows).
    """

    dilation_factor: int
    line_rate_bps: float            # fabric: the NIC's rate
    planned_wall_rate_bps: int
    planned_wall_ceil_bps: int
    min_interval_ns: float
    min_change: float = 0.02
    applied_bps: float | None = None    # fabric rate of the last change (None: as planned)
    last_ns: float | None = None
    updates: int = 0
    suppressed: int = 0
    history: list[tuple[float, float]] = field(default_factory=list)

    def decide(self, rate_bps: float, now_ns: float) -> ClassRate | None:
        at_line = rate_bps >= self.line_rate_bps
        current = self.line_rate_bps if self.applied_bps is None else self.applied_bps
        if at_line and self.applied_bps is None:
            return None
        if not at_line and abs(rate_bps - current) < self.min_change * current:
            return None
        if self.last_ns is not None and now_ns - self.last_ns < self.min_interval_ns:
            self.suppressed += 1
            return None
        self.last_ns = now_ns
        self.updates += 1
        self.history.append((now_ns, rate_bps))
        if at_line:
            self.applied_bps = None
            return ClassRate(self.planned_wall_rate_bps, self.planned_wall_ceil_bps,
                             self.line_rate_bps, True)
        self.applied_bps = rate_bps
        wall = max(8, round(rate_bps / self.dilation_factor))
        ceil = min(wall, self.planned_wall_ceil_bps)
        return ClassRate(min(self.planned_wall_rate_bps, ceil), ceil, rate_bps, False)


# --- the CNP on the wire -------------------------------------------------------------


def mac_bytes(mac: str) -> bytes:
    raw = bytes.fromhex(mac.replace(":", ""))
    if len(raw) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return raw


def build_cnp_frame(src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, dest_qp: int,
                    dscp: int, sport: int = ROCE_UDP_PORT) -> bytes:
    """An Ethernet frame carrying a RoCEv2 CNP to QP `dest_qp` of `dst_ip`.

    IPv4 with ID 0 and DF, TTL 64, TOS = DSCP << 2 (Not-ECT), UDP checksum 0 (a
    RoCEv2 sender may leave it 0; the ICRC covers the datagram), BTH opcode 0x81 with
    BECN set, PSN 0, 16 reserved zero bytes, then the ICRC over the IP header this
    function writes.
    """
    if not 0 <= dscp <= 63:
        raise ValueError(f"dscp must be 0..63, got {dscp}")
    udp_len = UDP_HEADER_BYTES + CNP_UDP_PAYLOAD_BYTES
    ctx = IcrcContext(src_ip, dst_ip, sport, ROCE_UDP_PORT, ip_id=0, df=True)
    payload = bytes(build_cnp(bytearray(CNP_UDP_PAYLOAD_BYTES), ctx, dest_qp))
    ip = ipv4_header_for_icrc(src_ip, dst_ip, IPV4_HEADER_BYTES + udp_len, tos=dscp << 2,
                              protocol=IPPROTO_UDP)
    udp = struct.pack("!HHHH", sport, ROCE_UDP_PORT, udp_len, 0)
    eth = ETH_HEADER.pack(mac_bytes(dst_mac), mac_bytes(src_mac), ETH_P_IP)
    return eth + ip + udp + payload


ROCE_SPORT_BASE = 0xC000
GOLDEN_RATIO_32 = 0x61C88647


def cnp_sport(dest_qp: int) -> int:
    """UDP source port of a CNP: rxe's rule for a QP (0xC000 | hash_32(qpn, 14)), applied
    to the QP the CNP goes to, so CNPs of different QPs spread like their data. The same
    rule as agents.rdma.transport.rxe_sport (a test keeps them equal), written out here so
    the agent does not import the whole transport: its start-up under TCG is minutes."""
    return ROCE_SPORT_BASE | (((dest_qp * GOLDEN_RATIO_32) & 0xFFFFFFFF) >> 18)
