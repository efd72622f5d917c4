"""The UET NIC in user space: UDP sockets, PDCs, and the engine that drives them.

A `UetNic` is one host's Ultra Ethernet endpoint. It owns:

- one RECEIVE socket on (local_ip, 4793): every UET packet to this host arrives there,
  requests, ACKs, NACKs and CONTROL (credit) alike; IP_RECVTOS shows each packet's TOS
  byte (CE marks, and the DSCP a trimming switch rewrote);
- one SEND socket per entropy: UDP source ports entropy_base + i (a port already taken
  on the host is skipped, the next one tried), `entropies` of them. The source port IS
  the entropy: a switch's ECMP hash of the 5-tuple picks the path. Every send socket is
  unconnected, DF (IP_MTU_DISCOVER = IP_PMTUDISC_DO), UDP checksum 0 (SO_NO_CHECK, so
  a switch may trim a packet without fixing a checksum), TOS = DSCP << 2 | ECT(0) (Not-ECT
  with `ecn=False`), SO_SNDTIMEO 100 ms, SO_SNDBUF `sndbuf_bytes`. Sends BLOCK as in
  `agents.rdma.transport`: a full queue (a paused port) holds the engine back; EAGAIN and
  ENOBUFS are counted and retried until sent or a stop is requested;
- one PDC per peer IP, made on first use on either side (a `write`/`send` to the peer,
  or the peer's first packet). Requests, and the ACKs/NACKs/credit answering them, all go
  to the peer's port 4793; the target answers from one fixed entropy per PDC (a send
  socket chosen from the peer's address).

A PDC holds both halves: the initiator (`agents.uet.pds.RudSender`,
`agents.uet.ses.SesInitiator`, an `EntropyPicker`, the congestion control) for the
requests this host sends to the peer, and the target (`RudReceiver`, `SesTarget`) for
the peer's requests to this host. PDC ids and initial PSNs are derived so both ends
agree without a handshake (a deviation from UEC 1.0's SYN establishment, see
docs/uet-transport.md): this host's PDC id for peer P is the low 16 bits of P's IPv4
address, so a request carries spdcid = low16(target IP) and dpdcid = low16(initiator IP)
and the target checks both; the initial PSN of the requests from I to T is
crc32("I>T").

Sending (`step`): retransmissions first (NACKed, SACK holes, timeouts; they pass the CC
window, which already counts them in flight, and overdraw credit), then new packets of
the oldest message, one PDC after the other, while the PDS window, the congestion
control (`cc`: "nscc" `Nscc` window + optional pacing, "credit" `CreditSender` +
`CreditReceiver`, "none" `NoCc`) and the NIC's line-rate pacer allow. Every packet costs
its wire size: len(datagram) + 66 (`agents.runtime.framing.WIRE_OVERHEAD_BYTES`); that
is what the pacer and the CC are charged. In credit mode each request is a RUD_CC_REQ
carrying credit_target (wire bytes still wanted); the target grants with CONTROL CREDIT
packets paced by `CreditReceiver.next_grant_ns`; a sender blocked on credit asks again
with CONTROL CREDIT_REQ when, for two base RTTs, nothing it sent carried its demand and
no credit came (each CREDIT_REQ also runs the receiver's write-off of credit lost with
lost packets).

ackreq is set on the last packet of each message, on every retransmission, and on a
packet after which the window or the CC window is closed; and a target ACKs whatever it
holds unacknowledged once the peer has sent nothing new for `ack_delay_ns` (a CC window
that shrank after a packet was sent can leave up to ack_every - 1 packets waiting), so
ACK coalescing never holds back the ACK a blocked sender waits for.

Receiving: a request whose IP DSCP is `trim_dscp`, or whose payload is shorter than its
SES header says, was trimmed by a switch: NACK(TRIMMED) at once, not delivered. Other
requests go to the PDS receiver (duplicates dropped and re-ACKed) and, when new, to SES,
whose completed messages reach `on_write` / `on_message`. ACKs are ACK_CC (32 bytes:
cumulative PSN + 64-bit SACK bitmap; cc_type NSCC, or CREDIT in credit mode, whose
credit field is 0 here: grants travel as CONTROL CREDIT).

Times: the NIC reads fabric ns from its `FabricClock` and gives them to the pure state
machines; `wait` converts the fabric time to the next event into a wall sleep with the
`Dilation`, nowhere else.

`drop_prob` (tests only) loses data transmissions (first and re-) at random before they
reach the socket, counted as injected_drops; `trim_prob` (tests only) cuts them to 100
bytes of UDP payload (128 bytes of IP, a switch's default trim size), counted as
injected_trims, so the target sees what a trimming switch would deliver.
"""

from __future__ import annotations

import random
import select
import socket
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.sockets import (
    CE,
    ECT0,
    SO_NO_CHECK,
    SO_RXQ_OVFL,
    SendErrors,
    set_recv_buffer,
    set_send_buffer,
    set_send_timeout,
    tos_byte,
)
from agents.timebase import Dilation, FabricClock
from agents.uet.cc import CreditParams, CreditReceiver, CreditSender, NoCc, Nscc, NsccParams
from agents.uet.entropy import ENTROPY_MODES, EntropyPicker
from agents.uet.pds import PSN_MASK, RudReceiver, RudSender, TxRecord
from agents.uet.ses import (
    OP_SEND,
    MessageDone,
    Segment,
    SesInitiator,
    SesTarget,
    expected_payload_bytes,
)
from agents.wire.icrc import IP_MTU_DISCOVER, IP_PMTUDISC_DO
from agents.wire.uet import (
    PDS_CC_REQUEST_BYTES,
    PDS_REQUEST_BYTES,
    SES_STD_BYTES,
    UET_UDP_PORT,
    Ack,
    CcType,
    Control,
    CtlType,
    MalformedUet,
    Nack,
    NackCode,
    NextHdr,
    PdsType,
    Request,
    SesRequest,
    pack_ack,
    pack_control,
    pack_nack,
    parse,
)

__all__ = ["CC_MODES", "MAX_SLEEP_NS", "SEND_TIMEOUT_NS", "Stopped", "UetNic", "UetOptions",
           "initial_psn", "pack_segment", "pdc_id", "ses_request"]

CC_MODES: tuple[str, ...] = ("nscc", "credit", "none")
SEND_TIMEOUT_NS = 100_000_000
RECV_BATCH = 64            # datagrams handled per step, at most
SEND_BATCH = 16            # packets per PDC per step, at most
SPIN_NS = 150_000          # wall: closer than this to the next event, spin instead of select
MAX_SLEEP_NS = 20_000_000  # wall: longest single select, so stop requests stay prompt
MAX_PORT_TRIES = 1024      # ports tried beyond `entropies` before giving up
TRIMMED_UDP_BYTES = 100    # trim_prob keeps this much UDP payload: a switch's 128 B of IP
_ANC = socket.CMSG_SPACE(4) * 3
_SOL_SOCKET = socket.SOL_SOCKET
_U32 = struct.Struct("=I")
_IPPROTO_IP = socket.IPPROTO_IP
_IP_TOS = socket.IP_TOS
_TRIM_CODES = frozenset({int(NackCode.TRIMMED), int(NackCode.TRIMMED_LASTHOP),
                         int(NackCode.TRIMMED_ACK)})


# The sender's fast path writes a request's PDS + SES headers with two pack_into calls
# (about a fifth of building Request and SesRequest and packing them); a unit test holds
# its bytes equal to agents.wire.uet.pack_request(Request(...), ses_request(seg), payload).
_PDS_HDR = struct.Struct("!HHIHH")          # prologue, clear_psn_offset, psn, spdcid, dpdcid
_PDS_CC_HDR = struct.Struct("!HHIHHI")      # + ccc_id << 24 | credit_target
_SES_HDR = struct.Struct("!BBHIHHQIQQI")    # the SES standard request header, 44 bytes
_P_RUD = int(PdsType.RUD_REQ) << 11 | int(NextHdr.REQUEST_STD) << 7
_P_RUD_CC = int(PdsType.RUD_CC_REQ) << 11 | int(NextHdr.REQUEST_STD) << 7
_F_RETRANS, _F_ACKREQ = 0x10, 0x08          # PDS request flags
_S_SOM, _S_EOM, _S_HDR_DATA = 0x01, 0x02, 0x04   # SES flags


def ses_request(seg: Segment) -> SesRequest:
    """The SES header of a segment: a SEND's SOM packet carries its per-tag sequence in
    header_data (hdr_data_present, so no payload_length); every other packet carries
    payload_length and (non-SOM) its message offset."""
    hdr = seg.opcode == OP_SEND and seg.som
    return SesRequest(seg.opcode, seg.som, seg.eom, seg.message_id, seg.request_length,
                      seg.buffer_offset, seg.memory_key, seg.header_data if hdr else 0,
                      seg.message_offset, 0 if hdr else len(seg.payload),
                      hdr_data_present=hdr)


def pack_segment(buf: bytearray, psn: int, spdcid: int, dpdcid: int, retrans: bool,
                 ackreq: bool, credit_target: int | None, seg: Segment) -> int:
    """Write the request carrying `seg` into `buf` (RUD_CC_REQ with ccc_id 0 when
    `credit_target` is not None); returns its length. Same bytes as pack_request."""
    flags = (_F_RETRANS if retrans else 0) | (_F_ACKREQ if ackreq else 0)
    if credit_target is None:
        _PDS_HDR.pack_into(buf, 0, _P_RUD | flags, 0, psn, spdcid, dpdcid)
        off = 12
    else:
        _PDS_CC_HDR.pack_into(buf, 0, _P_RUD_CC | flags, 0, psn, spdcid, dpdcid,
                              credit_target)
        off = 16
    payload = seg.payload
    n = len(payload)
    som = seg.som
    if som and seg.opcode == OP_SEND:
        sflags = _S_SOM | _S_HDR_DATA
        tail = seg.header_data
    else:
        sflags = _S_SOM if som else 0
        tail = n << 32 | seg.message_offset
    if seg.eom:
        sflags |= _S_EOM
    _SES_HDR.pack_into(buf, off, seg.opcode, sflags, seg.message_id, 0, 0, 0,
                       seg.buffer_offset, 0, seg.memory_key, tail, seg.request_length)
    off += 44
    buf[off:off + n] = payload
    return off + n


class Stopped(Exception):
    """A blocked send gave up because a stop was requested."""


_INT_RANGES = (("entropies", 1, 4096), ("entropy_base", 1, 0xFFFF),
               ("payload_bytes", 1, 0x3FFF), ("window_packets", 1, 0x8000),
               ("max_retries", 0, 1 << 20), ("ack_every", 1, 1 << 20))


@dataclass(frozen=True)
class UetOptions:
    """How a UET NIC sends. Times fabric ns, rates fabric bit/s (docs/uet-transport.md)."""

    dscp: int
    ecn: bool = True                      # send ECT(0) (else Not-ECT)
    cc: Literal["nscc", "credit", "none"] = "nscc"
    entropy: Literal["spray", "oblivious", "reps"] = "spray"
    entropies: int = 16                   # send sockets = distinct UDP source ports
    entropy_base: int = 0xD000            # first source port tried
    payload_bytes: int = 4096             # payload per packet (both ends must agree)
    window_packets: int = 256             # PDS send window per PDC
    rto_ns: float = 1_000_000.0           # retransmission timeout
    max_retries: int = 7                  # timeouts of one PSN before the PDC fails
    line_rate_bps: float = 100e9          # NIC pacer; CC line rate
    base_rtt_ns: float = 10_000.0         # CC base RTT; first RTT estimate
    trim_dscp: int | None = None          # DSCP a switch writes into a trimmed packet
    ack_every: int = 4                    # target: one ACK per this many packets at most
    ack_delay_ns: float = 5_000.0         # target: ACK what is pending after this quiet
    drop_prob: float = 0.0                # test only: injected loss of data transmissions
    trim_prob: float = 0.0                # test only: data transmissions cut as a switch trims
    seed: int = 1
    sndbuf_bytes: int | None = 8192       # SO_SNDBUF of each send socket (kernel doubles)
    rcvbuf_bytes: int | None = 4 << 20    # SO_RCVBUF of the receive socket
    max_burst_bytes: int = 16384          # pacer: wire bytes back to back to catch up
    spin_ns: int = SPIN_NS                # wall ns to busy-poll before an event; 0 never
    nscc_pacing: bool = False             # Nscc paces at cwnd / srtt as well

    def __post_init__(self) -> None:
        problems = []
        for name in ("dscp", "trim_dscp"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 63:
                problems.append(f"{name} must be 0..63, got {v}")
        if self.trim_dscp == self.dscp:
            problems.append(f"trim_dscp must differ from dscp ({self.dscp}): every packet "
                            "would look trimmed")
        for name, modes in (("cc", CC_MODES), ("entropy", ENTROPY_MODES)):
            if getattr(self, name) not in modes:
                problems.append(f"{name} must be one of {', '.join(modes)}, "
                                f"got {getattr(self, name)!r}")
        for name, lo, hi in _INT_RANGES:
            v = getattr(self, name)
            if not lo <= v <= hi:
                problems.append(f"{name} must be {lo}..{hi}, got {v}")
        for name in ("rto_ns", "line_rate_bps", "base_rtt_ns", "ack_delay_ns"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("drop_prob", "trim_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if problems:
            raise ValueError("UET options: " + "; ".join(problems))


def pdc_id(peer_ip: str) -> int:
    """A host's PDC id for its PDC with `peer_ip`: the low 16 bits of the peer's address."""
    return int.from_bytes(socket.inet_aton(peer_ip)[2:], "big")


def initial_psn(initiator_ip: str, target_ip: str) -> int:
    """The first PSN of the requests `initiator_ip` sends `target_ip`: both ends compute it."""
    return zlib.crc32(f"{initiator_ip}>{target_ip}".encode())


def _wire(nbytes: int) -> int:
    return nbytes + WIRE_OVERHEAD_BYTES


class _Pdc:
    """Both halves of the PDC with one peer, and what the NIC counts of it."""

    def __init__(self, nic: UetNic, peer: str, now_ns: float) -> None:
        o = nic.opts
        self.peer = peer
        self.addr = (peer, nic.port)
        self.local_id = pdc_id(peer)
        self.peer_id = pdc_id(nic.local_ip)
        self.tx = RudSender(start_psn=initial_psn(nic.local_ip, peer),
                            window_packets=o.window_packets, rto_ns=o.rto_ns,
                            max_retries=o.max_retries, rtt_ns=o.base_rtt_ns)
        self.rx = RudReceiver(start_psn=initial_psn(peer, nic.local_ip), ack_every=o.ack_every)
        self.ini = SesInitiator(o.payload_bytes)
        self.tgt = SesTarget(nic.regions)
        salt = zlib.crc32(peer.encode())
        self.picker = EntropyPicker(o.entropy, nic.sports, seed=o.seed ^ salt)
        self.ack_sock = nic.socks[salt % len(nic.socks)]
        self.nscc: Nscc | NoCc | None = None
        self.credit: CreditSender | None = None
        mtu = _wire(nic.hdr_bytes + o.payload_bytes)
        if o.cc == "nscc":
            self.nscc = Nscc(NsccParams(line_rate_bps=o.line_rate_bps, base_rtt_ns=o.base_rtt_ns,
                                        mtu_bytes=mtu, pacing=o.nscc_pacing), now_ns)
        elif o.cc == "none":
            self.nscc = NoCc(None, now_ns)
        else:
            self.credit = CreditSender(nic.credit_params)
        self.last_demand_ns = float("-inf")   # last request that carried our credit demand
        self.last_credit_ns = float("-inf")   # last credit received
        self.last_rx_ns = float("-inf")       # last request accepted from the peer
        self.error: str | None = None
        self.c = dict.fromkeys(
            ("tx_packets", "tx_bytes", "rx_packets", "rx_bytes", "acks_sent", "nacks_sent",
             "trims_received", "ecn_received", "ecn_acks", "credits_granted",
             "credit_bytes_granted", "credits_received", "credit_bytes_received",
             "credit_reqs_sent", "delayed_acks", "injected_drops", "injected_trims",
             "bad_pdcid",
             "nacks_out_of_window"), 0)

    def busy(self) -> bool:
        return self.error is None and (self.ini.has_data() or not self.tx.idle())


class UetNic:
    """One host's UET endpoint: sockets, PDCs per peer, and the engine (docstring above)."""

    def __init__(self, local_ip: str, clock: FabricClock, dilation: Dilation,
                 opts: UetOptions, *, port: int = UET_UDP_PORT,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.local_ip = local_ip
        self.clock = clock
        self.dilation = dilation
        self.opts = opts
        self.port = port
        self._should_stop = should_stop or (lambda: False)
        self.tos = tos_byte(opts.dscp, ECT0 if opts.ecn else 0)
        self.hdr_bytes = (PDS_CC_REQUEST_BYTES if opts.cc == "credit" else PDS_REQUEST_BYTES) \
            + SES_STD_BYTES
        self.regions: dict[int, memoryview] = {}
        self.on_message: Callable[[str, int, int, memoryview], None] | None = None
        self.on_write: Callable[[str, int, int, int], None] | None = None
        self.on_error: Callable[[str, str], None] | None = None
        self.errors: list[str] = []
        self.pdcs: dict[str, _Pdc] = {}
        self._order: list[_Pdc] = []
        self._rr = 0
        self._rng = random.Random(opts.seed)
        self._pkt = bytearray(PDS_CC_REQUEST_BYTES + SES_STD_BYTES + opts.payload_bytes)
        self._pkt_view = memoryview(self._pkt)
        self.send_errors = SendErrors()
        self.malformed: dict[str, int] = {}
        self.rx_errors = 0
        self.overflow_drops = 0      # SO_RXQ_OVFL: dropped before they were read
        self.datagrams_received = 0
        self.steps = 0
        self.waits = 0
        self._pace_due = float("-inf")
        self._pace_burst_ns = opts.max_burst_bytes * 8e9 / opts.line_rate_bps
        self.credit_params = CreditParams(line_rate_bps=opts.line_rate_bps,
                                          mtu_bytes=_wire(self.hdr_bytes + opts.payload_bytes),
                                          base_rtt_ns=opts.base_rtt_ns)
        self.credit_rx = CreditReceiver(self.credit_params, clock.now_ns()) \
            if opts.cc == "credit" else None
        self.socks: list[socket.socket] = []
        self.sports: list[int] = []
        self.skipped_ports: list[int] = []
        self._buf = bytearray(65536)
        self._view = memoryview(self._buf)
        try:
            self.rx_sock = self._rx_socket()
            self._tx_sockets()
        except BaseException:
            self.close()
            raise
        self._sock_of = dict(zip(self.sports, self.socks, strict=True))
        self._poll = select.poll()
        self._poll.register(self.rx_sock.fileno(), select.POLLIN)

    # -- sockets

    def _rx_socket(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(_IPPROTO_IP, socket.IP_RECVTOS, 1)
            s.setsockopt(_SOL_SOCKET, SO_RXQ_OVFL, 1)   # datagrams dropped, buffer full
            set_recv_buffer(s, self.opts.rcvbuf_bytes)
            s.bind((self.local_ip, self.port))
        except BaseException:
            s.close()
            raise
        return s

    def _tx_sockets(self) -> None:
        o = self.opts
        port = o.entropy_base
        tries = 0
        while len(self.socks) < o.entropies:
            if port > 0xFFFF or tries > o.entropies + MAX_PORT_TRIES:
                raise OSError(f"could bind only {len(self.socks)} of {o.entropies} entropy "
                              f"source ports from {o.entropy_base}")
            tries += 1
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                s.setsockopt(_IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
                s.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
                s.setsockopt(_IPPROTO_IP, _IP_TOS, self.tos)
                set_send_timeout(s, SEND_TIMEOUT_NS)
                set_send_buffer(s, o.sndbuf_bytes)
                s.bind((self.local_ip, port))
            except OSError as e:
                s.close()
                if e.errno not in (98, 13):      # EADDRINUSE, EACCES: try the next port
                    raise
                self.skipped_ports.append(port)
                port += 1
                continue
            self.socks.append(s)
            self.sports.append(port)
            port += 1

    def fileno(self) -> int:
        return self.rx_sock.fileno()

    def close(self) -> None:
        for s in self.socks:
            s.close()
        rx = getattr(self, "rx_sock", None)
        if rx is not None:
            rx.close()

    def _send(self, sock: socket.socket, view: Any, addr: tuple[str, int]) -> None:
        """Blocking sendto; retries a send timeout (EAGAIN) and ENOBUFS until a stop."""
        while True:
            try:
                sock.sendto(view, addr)
                return
            except OSError as e:
                self.send_errors.absorb(e)
                if self._should_stop():
                    raise Stopped() from None

    # -- API

    def register(self, key: int, buf: Any) -> None:
        """Make `buf` (bytes-like, writable) the WRITE target for memory key `key`."""
        mv = memoryview(buf)
        if mv.readonly:
            raise ValueError("a WRITE target must be writable")
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        self.regions[key] = mv

    def pdc(self, peer_ip: str) -> _Pdc:
        p = self.pdcs.get(peer_ip)
        if p is None:
            socket.inet_aton(peer_ip)     # an IPv4 address, or OSError
            p = _Pdc(self, peer_ip, self.clock.now_ns())
            self.pdcs[peer_ip] = p
            self._order.append(p)
        return p

    def write(self, peer_ip: str, key: int, offset: int, data: Any, *,
              on_done: Callable[[int], None] | None = None) -> int:
        """Queue a WRITE of `data` (kept by reference until on_done) to the peer's memory
        key `key` at `offset`; returns the message id."""
        return self.pdc(peer_ip).ini.write(key, offset, data, on_done).message_id

    def send(self, peer_ip: str, match_bits: int, data: Any, *,
             on_done: Callable[[int], None] | None = None) -> int:
        """Queue a SEND of `data` (kept by reference until on_done) with `match_bits`."""
        return self.pdc(peer_ip).ini.send(match_bits, data, on_done).message_id

    def idle(self) -> bool:
        """Nothing queued or unacknowledged (a failed PDC counts as idle: see `errors`)."""
        return not any(p.busy() for p in self._order)

    # -- sending

    def _packet(self, p: _Pdc, psn: int, seg: Segment, retrans: bool, ackreq: bool) -> Any:
        target = None
        if p.credit is not None:
            backlog = p.ini.backlog_bytes
            npk = -(-backlog // self.opts.payload_bytes)
            target = p.credit.credit_target(backlog + npk * _wire(self.hdr_bytes))
        n = pack_segment(self._pkt, psn & PSN_MASK, p.local_id, p.peer_id, retrans, ackreq,
                         target, seg)
        return self._pkt_view[:n]

    def _data_out(self, p: _Pdc, sport: int, view: Any, now: float) -> None:
        n = len(view)
        p.c["tx_packets"] += 1
        p.c["tx_bytes"] += n
        w = _wire(n)
        base = self._pace_due
        floor = now - self._pace_burst_ns
        self._pace_due = (base if base > floor else floor) + w * 8e9 / self.opts.line_rate_bps
        if p.credit is not None:
            p.credit.on_sent(w)
            p.last_demand_ns = now
        elif p.nscc is not None:
            p.nscc.on_sent(now, w)
        if self.opts.drop_prob and self._rng.random() < self.opts.drop_prob:
            p.c["injected_drops"] += 1
            return
        if self.opts.trim_prob and self._rng.random() < self.opts.trim_prob:
            p.c["injected_trims"] += 1
            view = view[:TRIMMED_UDP_BYTES]
        self._send(self._sock_of[sport], view, p.addr)

    def _gate(self, p: _Pdc, now: float, wire: int) -> bool:
        """The CC lets a new packet of `wire` bytes go now."""
        if p.credit is not None:
            return p.credit.can_send(wire)
        cc = p.nscc
        assert cc is not None
        if not cc.can_send(p.tx.inflight_bytes, wire):
            return False
        due = cc.send_due_ns(now)
        return due is None or due <= now

    def _send_one(self, p: _Pdc, now: float) -> bool:
        """Send this PDC's next packet if everything allows it; True if one went."""
        tx = p.tx
        if tx.has_retransmit():
            psn = tx.pop_retransmit()
            if psn is not None:
                rec = tx.unacked[psn]
                seg = rec.item[0]
                ent = p.picker.pick(now)
                view = self._packet(p, psn, seg, True, True)
                tx.resent(psn, now, ent)
                self._data_out(p, ent, view, now)
                return True
        if not p.ini.has_data() or not tx.window_open():
            return False
        head = p.ini.queue[0]
        n = min(self.opts.payload_bytes, head.length - head.next_offset)
        wire = _wire(self.hdr_bytes + n)
        if not self._gate(p, now, wire):
            return False
        nxt = p.ini.next_segment()
        assert nxt is not None
        seg, _msg = nxt
        ent = p.picker.pick(now)
        closes = (tx.next_psn + 1 - tx.base >= tx.window_packets
                  or (p.nscc is not None
                      and not p.nscc.can_send(tx.inflight_bytes + wire, wire)))
        psn = tx.send_new(now, nxt, wire, ent)
        view = self._packet(p, psn, seg, False, seg.eom or closes)
        self._data_out(p, ent, view, now)
        return True

    def _send_credit_req(self, p: _Pdc, now: float) -> None:
        assert p.credit is not None
        backlog = p.ini.backlog_bytes
        npk = -(-backlog // self.opts.payload_bytes)
        want = p.credit.credit_target(backlog + npk * _wire(self.hdr_bytes))
        p.last_demand_ns = now            # also when nothing is wanted: no busy re-check
        if want <= 0:
            return
        p.c["credit_reqs_sent"] += 1
        self._send(p.ack_sock, pack_control(Control(int(CtlType.CREDIT_REQ), 0, p.local_id,
                                                    p.peer_id, payload=want)), p.addr)

    def _credit_req_due(self, p: _Pdc) -> float:
        """When a PDC blocked on credit asks again: two base RTTs after the later of its
        last demand and its last grant (grants still flowing need no reminder)."""
        return max(p.last_demand_ns, p.last_credit_ns) + 2 * self.opts.base_rtt_ns

    def _credit_blocked(self, p: _Pdc) -> bool:
        if p.credit is None or not p.ini.has_data() or not p.tx.window_open():
            return False
        head = p.ini.queue[0]
        n = min(self.opts.payload_bytes, head.length - head.next_offset)
        return not p.credit.can_send(_wire(self.hdr_bytes + n))     # the next packet's size

    # -- receiving

    def _receive(self, now: float) -> int:
        sock = self.rx_sock
        buf = self._buf
        view = self._view
        done = 0
        while done < RECV_BATCH:
            try:
                n, anc, _flags, addr = sock.recvmsg_into((buf,), _ANC, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.rx_errors += 1
                continue
            done += 1
            tos = 0
            for level, ctype, data in anc:
                if ctype == _IP_TOS and level == _IPPROTO_IP and data:
                    tos = data[0]
                elif ctype == SO_RXQ_OVFL and level == _SOL_SOCKET and len(data) >= 4:
                    self.overflow_drops = _U32.unpack_from(data)[0]
            try:
                pk = parse(view[:n])
            except MalformedUet as e:
                self.malformed[e.reason] = self.malformed.get(e.reason, 0) + 1
                continue
            pds = pk.pds
            p = self.pdc(addr[0])
            if pds.dpdcid != p.local_id or pds.spdcid != p.peer_id:
                p.c["bad_pdcid"] += 1
                continue
            kind = type(pds)
            if kind is Request:
                self._on_request(p, pds, pk.ses, pk.payload, tos, n, now)  # type: ignore[arg-type]
            elif kind is Ack:
                self._on_ack(p, pds, now)  # type: ignore[arg-type]
            elif kind is Nack:
                self._on_nack(p, pds, now)  # type: ignore[arg-type]
            else:
                self._on_control(p, pds, now)  # type: ignore[arg-type]
        self.datagrams_received += done
        return done

    def _on_request(self, p: _Pdc, req: Request, ses: SesRequest | None, payload: memoryview,
                    tos: int, n: int, now: float) -> None:
        if ses is None:
            self.malformed["no_ses_header"] = self.malformed.get("no_ses_header", 0) + 1
            return
        c = p.c
        c["rx_packets"] += 1
        c["rx_bytes"] += n
        ce = (tos & 3) == CE
        if ce:
            c["ecn_received"] += 1
        o = self.opts
        if ses.som and ses.hdr_data_present:
            want = expected_payload_bytes(True, ses.eom, ses.request_length, 0, 0,
                                          o.payload_bytes)
        else:
            want = ses.payload_length
        if (o.trim_dscp is not None and tos >> 2 == o.trim_dscp) or len(payload) < want:
            c["trims_received"] += 1
            if self.credit_rx is not None:    # its credit was spent: account it as arrived
                self.credit_rx.on_data(now, p.peer, _wire(n - len(payload) + want))
            psn = p.rx.on_trimmed(req.psn)
            self._nack(p, int(NackCode.TRIMMED), psn, ce, req.retrans)
            return
        if self.credit_rx is not None:
            if req.credit_target is not None:
                self.credit_rx.on_demand(now, p.peer, req.credit_target)
            self.credit_rx.on_data(now, p.peer, _wire(n))
        v = p.rx.on_packet(req.psn, ackreq=req.ackreq, ecn=ce)
        if v.out_of_window:
            c["nacks_out_of_window"] += 1
            self._nack(p, int(NackCode.PSN_OOR_WINDOW), v.psn, ce, req.retrans)
            return
        if v.new:
            p.last_rx_ns = now
            done = p.tgt.on_packet(ses.opcode, ses.som, ses.eom, ses.message_id,
                                   ses.request_length, ses.buffer_offset, ses.memory_key,
                                   ses.header_data, 0 if ses.som else ses.message_offset,
                                   payload)
            for d in done:
                if type(d) is MessageDone:
                    if self.on_message is not None:
                        self.on_message(p.peer, d.match_bits, d.message_id, d.data)
                elif self.on_write is not None:
                    self.on_write(p.peer, d.key, d.offset, d.length)  # type: ignore[union-attr]
        if v.ack_now:
            self._ack(p, v.psn, ce, req.retrans)

    def _ack(self, p: _Pdc, trigger: int, ce: bool, retrans: bool) -> None:
        info = p.rx.ack_info(trigger)
        if self.credit_rx is not None:
            a = Ack(info.cack_psn, info.ack_psn_offset, p.local_id, p.peer_id, ecn_marked=ce,
                    retrans=retrans, cc_type=int(CcType.CREDIT),
                    sack_psn_offset=info.sack_psn_offset, sack_bitmap=info.sack_bitmap,
                    ooo_count=p.rx.out_of_order & 0xFFFF)
        else:
            a = Ack(info.cack_psn, info.ack_psn_offset, p.local_id, p.peer_id, ecn_marked=ce,
                    retrans=retrans, cc_type=int(CcType.NSCC),
                    sack_psn_offset=info.sack_psn_offset, sack_bitmap=info.sack_bitmap,
                    rcvd_bytes=p.c["rx_bytes"] & 0xFFFFFF, ooo_count=p.rx.out_of_order & 0xFFFF)
        p.c["acks_sent"] += 1
        self._send(p.ack_sock, pack_ack(a), p.addr)

    def _nack(self, p: _Pdc, code: int, psn: int, ce: bool, retrans: bool) -> None:
        p.c["nacks_sent"] += 1
        self._send(p.ack_sock, pack_nack(Nack(code, psn & PSN_MASK, p.local_id, p.peer_id,
                                              ecn_marked=ce, retrans=retrans)), p.addr)

    def _on_ack(self, p: _Pdc, a: Ack, now: float) -> None:
        tx = p.tx
        res = tx.on_ack(now, a.cack_psn, a.ack_psn_offset,
                        (a.cack_psn + a.sack_psn_offset) & PSN_MASK, a.sack_bitmap)
        ecn = a.ecn_marked
        if ecn:
            p.c["ecn_acks"] += 1
        acked_bytes = 0
        trigger = res.trigger
        ini = p.ini
        feedback = p.picker.feedback
        for psn, rec in res.acked:
            acked_bytes += rec.nbytes
            ini.acked(rec.item[1])
            feedback(rec.entropy, ecn and psn == trigger, False, False)
        cc = p.nscc
        for _psn, rec in res.lost:
            feedback(rec.entropy, False, False, True)
            if cc is not None:
                cc.on_loss(now, rec.nbytes)
        if cc is not None and (acked_bytes or ecn):
            cc.on_ack(now, acked_bytes, res.rtt_ns, ecn)
        if a.credit and p.credit is not None:
            p.last_credit_ns = now
            p.credit.on_credit(a.credit)
            p.c["credits_received"] += 1
            p.c["credit_bytes_received"] += a.credit

    def _on_nack(self, p: _Pdc, nk: Nack, now: float) -> None:
        if nk.nack_code in _TRIM_CODES:
            rec = p.tx.on_nack_trimmed(nk.nack_psn)
            if rec is not None:
                p.picker.feedback(rec.entropy, nk.ecn_marked, True, False)
                if p.nscc is not None:
                    p.nscc.on_trim(now, rec.nbytes)
        else:
            p.tx.on_nack_other()

    def _on_control(self, p: _Pdc, ctl: Control, now: float) -> None:
        if ctl.ctl_type == CtlType.CREDIT and p.credit is not None:
            p.last_credit_ns = now
            p.credit.on_credit(ctl.payload)
            p.c["credits_received"] += 1
            p.c["credit_bytes_received"] += ctl.payload
        elif ctl.ctl_type == CtlType.CREDIT_REQ and self.credit_rx is not None:
            self.credit_rx.on_demand(now, p.peer, ctl.payload)
            # grants() also writes off credit a PDC has held unused (or lost with its
            # packets) for the credit timeout; with that PDC the only one wanting credit,
            # next_grant_ns() stays None until it is written off, so a CREDIT_REQ (which
            # a blocked sender repeats every base RTT) is what runs it
            self._grant(now)

    # -- engine

    def _fail(self, p: _Pdc, why: str) -> None:
        p.error = f"PDC {self.local_ip} -> {p.peer} failed: {why}"
        self.errors.append(p.error)
        if self.on_error is not None:
            self.on_error(p.peer, p.error)

    def _timers(self, now: float) -> None:
        delay = self.opts.ack_delay_ns
        for p in self._order:
            if p.rx.ack_pending() and now - p.last_rx_ns >= delay:
                p.c["delayed_acks"] += 1          # the peer went quiet: ACK what it sent
                self._ack(p, p.rx.cack, False, False)
            tx = p.tx
            t = tx.next_timer_ns()
            if t is not None and t <= now:
                fired = tx.on_timer(now)
                if fired is not None:
                    rec: TxRecord = fired[1]
                    p.picker.feedback(rec.entropy, False, False, True)
                    if p.nscc is not None:
                        p.nscc.on_timeout(now)
                elif tx.failed and p.error is None:
                    self._fail(p, tx.failed)
            if p.credit is not None and now >= self._credit_req_due(p) \
                    and self._credit_blocked(p):
                self._send_credit_req(p, now)
        crx = self.credit_rx
        if crx is not None:
            t = crx.next_grant_ns()
            if t is not None and t <= now:
                self._grant(now)

    def _grant(self, now: float) -> None:
        """Send the credit grants due now (CONTROL CREDIT, from each PDC's ACK entropy)."""
        assert self.credit_rx is not None
        for peer, nbytes in self.credit_rx.grants(now):
            q = self.pdcs[str(peer)]
            q.c["credits_granted"] += 1
            q.c["credit_bytes_granted"] += nbytes
            self._send(q.ack_sock, pack_control(Control(
                int(CtlType.CREDIT), 0, q.local_id, q.peer_id, payload=nbytes)), q.addr)

    def step(self) -> bool:
        """One round: receive, fire due timers and grants, send what everything allows.
        True if anything happened."""
        self.steps += 1
        now_fn = self.clock.now_ns
        busy = False
        if self._poll.poll(0) and self._receive(now_fn()):
            busy = True
        now = now_fn()
        self._timers(now)
        order = self._order
        n = len(order)
        if not n:
            return busy
        sent = 0
        for i in range(n):
            p = order[(self._rr + i) % n]
            if p.error is not None:
                continue
            k = 0
            while k < SEND_BATCH and self._pace_due <= now and self._send_one(p, now):
                k += 1
            sent += k
        self._rr = (self._rr + 1) % n
        return busy or sent > 0

    def _sendable(self, p: _Pdc, now: float) -> bool:
        if p.error is not None:
            return False
        if p.tx.has_retransmit():
            return True
        if not p.ini.has_data() or not p.tx.window_open():
            return False
        head = p.ini.queue[0]
        wire = _wire(self.hdr_bytes + min(self.opts.payload_bytes,
                                          head.length - head.next_offset))
        if p.credit is not None:
            return p.credit.can_send(wire)
        assert p.nscc is not None
        return p.nscc.can_send(p.tx.inflight_bytes, wire)

    def next_event_ns(self) -> float | None:
        """Fabric time of the next send, timer or grant, or None (then only a packet can
        wake the NIC)."""
        best: float | None = None
        now = self.clock.now_ns()
        for p in self._order:
            cands = [p.tx.next_timer_ns()]
            if p.rx.ack_pending():
                cands.append(p.last_rx_ns + self.opts.ack_delay_ns)
            if self._sendable(p, now):
                cands.append(self._pace_due)
                if p.nscc is not None:
                    cands.append(p.nscc.send_due_ns(now))
            elif p.credit is not None and self._credit_blocked(p):
                cands.append(self._credit_req_due(p))
            for t in cands:
                if t is not None and (best is None or t < best):
                    best = t
        if self.credit_rx is not None:
            t = self.credit_rx.next_grant_ns()
            if t is not None and (best is None or t < best):
                best = t
        return best

    def wait(self, max_wall_ns: int = MAX_SLEEP_NS) -> None:
        """Sleep until a packet arrives or the next event is near (spin the last bit)."""
        nxt = self.next_event_ns()
        if nxt is None:
            wall = max_wall_ns
        else:
            wall = self.dilation.to_wall_ns(nxt - self.clock.now_ns())
            if wall <= self.opts.spin_ns:
                return
            wall = min(wall - self.opts.spin_ns, max_wall_ns)
        self.waits += 1
        select.select([self.rx_sock], [], [], wall / 1e9)

    def run(self, done: Callable[[], bool], stop: Callable[[], bool] | None = None,
            hook: Callable[[], None] | None = None) -> None:
        """Step until `done()` or `stop()`; `hook()` runs after every step."""
        while True:
            busy = self.step()
            if hook is not None:
                hook()
            if done() or (stop is not None and stop()):
                return
            if not busy:
                self.wait()

    # -- counters

    def _pdc_counters(self, p: _Pdc) -> dict:
        tx, rx = p.tx.counters(), p.rx.counters()
        out: dict = dict(p.c)
        out.update(retransmissions=tx["retransmissions"],
                   nack_retransmissions=tx["nack_retransmissions"],
                   sack_retransmissions=tx["sack_retransmissions"],
                   rto_retransmissions=tx["rto_retransmissions"], timeouts=tx["timeouts"],
                   spurious_retransmissions=tx["spurious_retransmissions"],
                   acks_received=tx["acks_received"], nacks_received=tx["nacks_received"],
                   duplicates=rx["duplicates"], out_of_order=rx["out_of_order"],
                   sports=p.picker.counters()["sports"], error=p.error,
                   sender=tx, receiver=rx, initiator=p.ini.counters(), target=p.tgt.counters(),
                   entropy=p.picker.counters())
        if isinstance(p.nscc, Nscc):
            out["cwnd_bytes"] = p.nscc.cwnd_bytes
        if p.nscc is not None:
            out["cc"] = p.nscc.counters()
        if p.credit is not None:
            out["cc"] = p.credit.counters()
        return out

    def counters(self) -> dict:
        """{"local", "pdcs": {peer: {...}}, "totals": {...}, "sockets": {...}}
        (every key: docs/uet-transport.md)."""
        pdcs = {p.peer: self._pdc_counters(p) for p in self._order}
        totals: dict = {}
        sports: dict[int, int] = {}
        for c in pdcs.values():
            for k, v in c.items():
                if k == "sports":
                    for port, m in v.items():
                        sports[port] = sports.get(port, 0) + m
                elif isinstance(v, int | float) and not isinstance(v, bool):
                    totals[k] = totals.get(k, 0) + v
        totals["sports"] = sports
        totals["malformed"] = sum(self.malformed.values())
        totals["send_eagain"] = self.send_errors.eagain
        totals["send_enobufs"] = self.send_errors.enobufs
        totals["errors"] = len(self.errors)
        sockets = {"rx_port": self.port, "sports": list(self.sports),
                   "skipped_ports": list(self.skipped_ports),
                   "datagrams_received": self.datagrams_received,
                   "malformed": dict(self.malformed), "rx_errors": self.rx_errors,
                   "overflow_drops": self.overflow_drops,
                   "icmp_errors": self.send_errors.icmp_errors,
                   "send_eagain": self.send_errors.eagain,
                   "send_enobufs": self.send_errors.enobufs,
                   "steps": self.steps, "waits": self.waits}
        out = {"local": f"{self.local_ip}:{self.port}", "pdcs": pdcs, "totals": totals,
               "sockets": sockets}
        if self.credit_rx is not None:
            out["credit_receiver"] = self.credit_rx.counters()
        return out


