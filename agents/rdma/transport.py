"""Sockets for the user-space RoCEv2 transport: UDP 4791, DF, DSCP/ECN, pacing, timers.

An `Endpoint` is one UDP socket and the RC QPs (`agents.rdma.qp.RcQp`) that send
and receive through it; an `Engine` drives any number of endpoints from one
thread: receive, fire timers, send what the pacers allow, sleep until the next
event. Everything the QPs see is fabric time (`agents.timebase.FabricClock`);
the engine converts a fabric wait into a wall sleep through the `Dilation` and
nowhere else.

Sockets:

- IPv4 UDP, UNCONNECTED, IP_MTU_DISCOVER = IP_PMTUDISC_DO: DF is set, and Linux
  gives a DF datagram IPv4 ID 0 unless its socket is connected
  (ip_select_ident_segs); the ICRC the sender computes assumes ID 0, since the
  ICRC covers the IP header's ID (`agents.wire.icrc`).
- The responder side (the perftest server) binds port 4791. Each requester QP
  binds its own source port 0xC000 | hash_32(QPN, 14), as rxe does, so ECMP
  spreads QPs; the next QPN is tried when that port is taken. Requests go to
  port 4791; responses (ACK/NAK, CNP, and data the server sends back) go from
  4791 to the requester's source port (real RoCE sends them to 4791 too; see
  docs/roce.md).
- TOS: data and ACK/NAK packets DSCP << 2 | ECT(0) (default DSCP 26); CNPs DSCP
  48, Not-ECT (per packet, with an IP_TOS control message). IP_RECVTOS shows the
  receiver each packet's TOS, so a CE mark (0b11) reaches the QP's notification
  point.
- Sends BLOCK (SO_SNDTIMEO 100 ms, retried until sent or stopped), so a paused
  port fills the socket buffer and holds the sender back instead of dropping;
  ENOBUFS is retried after 50 us, and a send that reports an earlier datagram's
  ICMP error is counted (rx_errors) and retried, CNPs like data
  (`agents.runtime.sockets.SendErrors`). The perftest tool keeps SO_SNDBUF small
  (NIC_SNDBUF_BYTES): what waits in the NIC's queue is what an RNIC's FIFO holds,
  and the rest of a paused QP's data stays unsent, under its rate limiter.
- Receive errors never stop the engine: a datagram `parse_packet` rejects is
  counted per `MalformedReason`; one for an unknown QP or from the wrong peer
  is counted too.

Wire bytes per packet (what the pacer charges and `cc.on_bytes_sent` sees):
len(UDP payload) + 66 (`agents.runtime.framing.WIRE_OVERHEAD_BYTES`) = BTH 12
[+ RETH 16] + payload + pad + ICRC 4 + UDP 8 + IPv4 20 + Ethernet 14 + FCS 4 +
preamble/SFD 8 + inter-frame gap 12.
"""

from __future__ import annotations

import os
import random
import select
import socket
import struct
import time
from collections.abc import Callable

from agents import fast as _fast
from agents.rdma.qp import PKT_CNP, RcQp, RcRequester
from agents.runtime.sockets import (
    CE,
    ECT0,
    SO_RXQ_OVFL,
    SendErrors,
    set_recv_buffer,
    set_send_buffer,
    set_send_timeout,
    tos_byte,
)
from agents.timebase import Dilation, FabricClock
from agents.wire import BytesLike
from agents.wire.roce import (
    IP_MTU_DISCOVER,
    IP_PMTUDISC_DO,
    ROCE_UDP_PORT,
    Aeth,
    Bth,
    IcrcContext,
    MalformedPacket,
    MalformedReason,
    Parsed,
    Reth,
    icrc_context,
    parse_packet,
)

__all__ = [
    "CNP_DSCP",
    "DEFAULT_DSCP",
    "NIC_SNDBUF_BYTES",
    "ROCE_SPORT_BASE",
    "Binding",
    "Endpoint",
    "Engine",
    "fast_send_round",
    "rxe_sport",
]

ROCE_SPORT_BASE = 0xC000
DEFAULT_DSCP = 26
CNP_DSCP = 48
GOLDEN_RATIO_32 = 0x61C88647

SEND_TIMEOUT_NS = 100_000_000
# SO_SNDBUF the perftest tool asks for (the kernel doubles it): with 4 KB packets at most
# two wait in the NIC's qdisc, as in an RNIC's transmit FIFO. The kernel default (~26
# packets) let a PFC-paused host park 100+ KB per QP that went out at line rate on
# resume, past the DCQCN rate limiter (docs/roce.md, "The NIC's queue").
NIC_SNDBUF_BYTES = 8192
RECV_BATCH = 64            # datagrams drained per endpoint per step
# Datagrams per recvmmsg on the fast path. Each slot is 64 KiB of address space (any UDP
# datagram fits) of which only the pages a datagram touches become resident: 16 slots
# hold at most ~150 KB of a 4 KB-MTU flow, per endpoint (an agent may have many).
FAST_RECV_SLOTS = 16
SEND_BATCH = 16            # packets per QP per step, at most
SPIN_NS = 150_000          # wall: closer than this to the next event, spin instead of select
MAX_SLEEP_NS = 20_000_000  # wall: longest single select, so stop requests stay prompt
MAX_RX_CONTEXTS = 4096
_ANC = socket.CMSG_SPACE(4) * 3
_SOL_SOCKET = socket.SOL_SOCKET
_U32 = struct.Struct("=I")
_IPPROTO_IP = socket.IPPROTO_IP
_IP_TOS = socket.IP_TOS
_INT = struct.Struct("@i")
_REASON_NAMES = {int(r): r.name for r in MalformedReason}


def rxe_sport(qpn: int) -> int:
    """rxe's UDP source port for a QP: 0xC000 | hash_32(qpn, 14) (Linux's golden-ratio hash)."""
    return ROCE_SPORT_BASE | (((qpn * GOLDEN_RATIO_32) & 0xFFFFFFFF) >> 18)


def fast_send_round(r: RcRequester, batch, now: float, limit: int,
                    send_batch: Callable[[object], None],
                    send_one: Callable[[memoryview], None]) -> int:
    """Up to `limit` packets of requester `r` at `now`, the fast way: runs of packets built
    in C (`RcRequester.build_batch`) handed to `send_batch` (one sendmmsg each), and a
    packet a run cannot promise (its rate may change) built by `poll_send` and handed to
    `send_one`. The same packets, in the same order, with the same state after, as
    `limit` calls of `poll_send` (tests/unit/test_fastpath.py holds them equal).
    Returns how many packets went."""
    k = 0
    while k < limit:
        m = r.build_batch(now, batch, limit - k)
        if m > 0:
            try:
                send_batch(batch)
            except Stopped:
                r.unsend([batch.packet(i) for i in range(m - batch.pending, m)])
                raise
            finally:
                if batch.pending:
                    batch.clear()
            k += m
            if r.paced_out(now):        # what the next build_batch would find
                break
            continue
        if m == 0:
            break
        view = r.poll_send(now)
        if view is None:
            break
        try:
            send_one(view)
        except Stopped:
            r.unsend([view])
            raise
        k += 1
    return k


class Stopped(Exception):
    """A blocked send gave up because a stop was requested."""


class Binding:
    """One QP on an endpoint: its peer address, and test-only injected loss."""

    __slots__ = ("qp", "peer", "endpoint", "drop_every", "drop_prob", "_rng", "_n",
                 "injected_drops", "sport", "tx_batch")

    def __init__(self, qp: RcQp, peer: tuple[str, int], endpoint: Endpoint, *,
                 drop_every: int = 0, drop_prob: float = 0.0, drop_seed: int = 1) -> None:
        self.qp = qp
        self.peer = peer
        self.endpoint = endpoint
        self.sport = endpoint.port
        self.drop_every = drop_every
        self.drop_prob = drop_prob
        self._rng = random.Random(drop_seed)
        self._n = 0
        self.injected_drops = 0
        # the fast path's packet batch (agents.fast TxBatch); None: the per-packet path
        fast = endpoint.fast
        self.tx_batch = fast.TxBatch() if fast is not None else None

    def send_data(self, view: memoryview, retransmission: bool = False) -> None:
        """Put one data packet on the wire, unless the test-only loss says it is lost.

        `drop_every` N loses every Nth FIRST transmission (a deterministic pattern that also
        hit retransmissions could line up with go-back-N rounds and lose the same PSN every
        round); `drop_prob` loses any transmission, retransmissions included, at random.
        """
        if self.drop_every and not retransmission:
            self._n += 1
            if self._n % self.drop_every == 0:
                self.injected_drops += 1
                return
        if self.drop_prob and self._rng.random() < self.drop_prob:
            self.injected_drops += 1
            return
        self.endpoint.send(view, self.peer)

    def send_ctl(self, view: memoryview, kind: int) -> None:
        """The QP's tx callback: ACK/NAK with the data TOS, CNPs with the CNP TOS."""
        if kind == PKT_CNP:
            self.endpoint.send_cnp(view, self.peer)
        else:
            self.endpoint.send(view, self.peer)

    def counters(self) -> dict:
        return {**self.qp.counters(), "sport": self.sport, "peer": f"{self.peer[0]}:{self.peer[1]}",
                "injected_drops": self.injected_drops}


class Endpoint:
    """A UDP socket on (local_ip, port) and the QPs that use it (demultiplexed by QPN)."""

    def __init__(self, local_ip: str, port: int = ROCE_UDP_PORT, *, dscp: int = DEFAULT_DSCP,
                 cnp_dscp: int = CNP_DSCP, ecn: bool = True, rcvbuf_bytes: int | None = 4 << 20,
                 sndbuf_bytes: int | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 count_overflow: bool = False, fast_path: bool = True) -> None:
        self.local_ip = local_ip
        self.data_tos = tos_byte(dscp, ECT0 if ecn else 0)
        self.cnp_tos = tos_byte(cnp_dscp, 0)
        self._cnp_cmsg = [(_IPPROTO_IP, _IP_TOS, _INT.pack(self.cnp_tos))]
        self._should_stop = should_stop or (lambda: False)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(_IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
            sock.setsockopt(_IPPROTO_IP, _IP_TOS, self.data_tos)
            sock.setsockopt(_IPPROTO_IP, socket.IP_RECVTOS, 1)
            set_send_timeout(sock, SEND_TIMEOUT_NS)
            set_recv_buffer(sock, rcvbuf_bytes)
            set_send_buffer(sock, sndbuf_bytes)
            if count_overflow:     # the datagrams this socket dropped, full (SO_RXQ_OVFL)
                sock.setsockopt(_SOL_SOCKET, SO_RXQ_OVFL, 1)
            sock.bind((local_ip, port))
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.port = sock.getsockname()[1]
        self._qps: dict[int, Binding] = {}
        self._rx_ctx: dict[tuple[str, int], IcrcContext] = {}
        self._buf = bytearray(65536)
        self._view = memoryview(self._buf)
        self.malformed = {r.name: 0 for r in MalformedReason}
        self.unknown_qp = 0
        self.wrong_peer = 0
        self.rx_errors = 0
        self.datagrams_received = 0
        self.overflow_drops = 0      # count_overflow: dropped here before they were read
        self.send_errors = SendErrors()
        # The compiled fast path (agents.fast), unless turned off here or unavailable:
        # `fast_path` (the status agents report) says which path this endpoint runs.
        if fast_path:
            self.fast = _fast.extension()
            self.fast_path = _fast.status()
        else:
            self.fast = None
            self.fast_path = {"on": False, "reason": "turned off by the agent's option"}
        self._hot: Binding | None = None   # fast path: the QP C may place packets for
        self._rx = None if self.fast is None else self.fast.RxBatch(
            FAST_RECV_SLOTS, local_ip, self.port, Parsed, Bth, Reth, Aeth)
        # Called with a packet for a QPN no QP here has, and its source address: a QP it
        # attaches (a receiver that makes a flow's responder when the flow's first packet
        # comes, agents.flows) is returned and takes the packet; None counts it unknown.
        self.on_unknown_qp: Callable[[int, tuple[str, int]], Binding | None] | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def disable_fast_path(self, reason: str) -> None:
        """Run the Python path from now on (the C path reads and writes the socket's fd
        itself, past anything that wraps `sock`); `fast_path` then says why."""
        self.fast = None
        self._rx = None
        self._hot = None
        self.fast_path = {"on": False, "reason": f"turned off: {reason}"}
        for b in self._qps.values():
            b.tx_batch = None

    def close(self) -> None:
        self.sock.close()

    @property
    def bindings(self) -> list[Binding]:
        return list(self._qps.values())

    def attach(self, qp: RcQp, peer: tuple[str, int], *, drop_every: int = 0,
               drop_prob: float = 0.0, drop_seed: int = 1) -> Binding:
        """Serve `qp` on this socket; its packets go to `peer` = (ip, port)."""
        if qp.qpn in self._qps:
            raise ValueError(f"QPN {qp.qpn:#x} is already on this endpoint")
        b = Binding(qp, (peer[0], int(peer[1])), self, drop_every=drop_every,
                    drop_prob=drop_prob, drop_seed=drop_seed)
        qp.tx = b.send_ctl
        self._qps[qp.qpn] = b
        return b

    def detach(self, qpn: int) -> Binding | None:
        """Stop serving QP `qpn` here (its packets then count as unknown); its binding."""
        if self._hot is not None and self._hot.qp.qpn == qpn:
            self._hot = None
        return self._qps.pop(qpn, None)

    # -- send

    def send(self, view: BytesLike, addr: tuple[str, int]) -> None:
        """Blocking sendto; retries a send timeout (EAGAIN) and ENOBUFS until a stop."""
        sock = self.sock
        while True:
            try:
                sock.sendto(view, addr)
                return
            except OSError as e:
                self.send_failed(e)

    def send_batch(self, batch, addr: tuple[str, int]) -> None:
        """Blocking send of a fast-path batch (one sendmmsg while all go): each packet
        that did not go is accounted and retried as `send` does, in order."""
        fd = self.sock.fileno()
        while True:
            # on an exception the batch keeps what did not go: the caller takes it back
            # (fast_send_round: RcRequester.unsend) and clears it
            _went, err = batch.send(fd, addr)
            if not err:
                return
            self.send_failed(OSError(err, os.strerror(err)))   # EAGAIN: BlockingIOError

    def send_failed(self, e: OSError) -> None:
        """Account a failed send before it is retried; raise what a retry cannot fix."""
        self.send_errors.absorb(e)
        if self._should_stop():
            raise Stopped()

    def send_cnp(self, view: BytesLike, addr: tuple[str, int]) -> None:
        """Blocking send of a CNP with the CNP TOS; retried like `send`."""
        sock = self.sock
        while True:
            try:
                sock.sendmsg([view], self._cnp_cmsg, 0, addr)
                return
            except OSError as e:
                self.send_failed(e)

    # -- receive

    def receive(self, now_ns: float, budget: int = RECV_BATCH) -> int:
        """Handle up to `budget` waiting datagrams without blocking; returns how many."""
        if self._rx is not None:
            return self._receive_fast(now_ns, budget)
        sock = self.sock
        buf = self._buf
        view = self._view
        ctxs = self._rx_ctx
        qps = self._qps
        done = 0
        while done < budget:
            try:
                n, anc, _flags, addr = sock.recvmsg_into((buf,), _ANC, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.rx_errors += 1
                continue
            done += 1
            ce = False
            for level, ctype, data in anc:
                if ctype == _IP_TOS and level == _IPPROTO_IP and data:
                    ce = (data[0] & 3) == CE
                elif ctype == SO_RXQ_OVFL and level == _SOL_SOCKET and len(data) >= 4:
                    self.overflow_drops = _U32.unpack_from(data)[0]
            ctx = ctxs.get(addr)
            if ctx is None:
                ctx = icrc_context(addr[0], self.local_ip, addr[1], self.port)
                if len(ctxs) < MAX_RX_CONTEXTS:
                    ctxs[addr] = ctx
            try:
                p = parse_packet(view[:n], ctx)
            except MalformedPacket as e:
                self.malformed[e.reason.name] += 1
                continue
            b = qps.get(p.bth.dest_qp)
            if b is None and self.on_unknown_qp is not None:
                b = self.on_unknown_qp(p.bth.dest_qp, addr)
            if b is None:
                self.unknown_qp += 1
                continue
            if addr != b.peer:
                self.wrong_peer += 1
                continue
            b.qp.on_packet(p, ce, now_ns, n)
        self.datagrams_received += done
        return done

    def _receive_fast(self, now_ns: float, budget: int) -> int:
        """`receive` through the fast path: recvmmsg, parse and ICRC check in C, the
        same accounting and dispatch as the Python path, datagram by datagram."""
        rx = self._rx
        assert rx is not None
        fd = self.sock.fileno()
        qps = self._qps
        malformed = self.malformed
        done = 0
        while done < budget:
            # the QP that took the last in-order data packet: C may place its next ones
            hot = self._hot
            hint = hot.qp.responder.fast_hint(hot.peer) if hot is not None else None
            results, errors, overflow = rx.recv(fd, min(budget - done, FAST_RECV_SLOTS), hint)
            self.rx_errors += errors
            if overflow >= 0:
                self.overflow_drops = overflow
            if not results:
                break
            for p, ce, addr, n in results:
                if p.__class__ is int:
                    if p <= 0:      # (0 | -1: ACK due, packets, UDP bytes, payload bytes)
                        assert hot is not None      # a run C placed for the hot QP
                        hot.qp.on_fast_run(ce, addr, n, p < 0)
                        done += ce
                        continue
                    done += 1
                    malformed[_REASON_NAMES[p]] += 1
                    continue
                done += 1
                b = qps.get(p.bth.dest_qp)
                if b is None and self.on_unknown_qp is not None:
                    b = self.on_unknown_qp(p.bth.dest_qp, addr)
                if b is None:
                    self.unknown_qp += 1
                    continue
                if addr != b.peer:
                    self.wrong_peer += 1
                    continue
                b.qp.on_packet(p, ce, now_ns, n)
                self._hot = b
        self.datagrams_received += done
        return done

    def counters(self) -> dict:
        # (which packet path ran is `fast_path`, not a counter: callers sum these)
        return {"local": f"{self.local_ip}:{self.port}", "datagrams_received":
                self.datagrams_received, "malformed": dict(self.malformed),
                "unknown_qp": self.unknown_qp, "wrong_peer": self.wrong_peer,
                # an ICMP error reported on a send is the socket's receive side at work
                "rx_errors": self.rx_errors + self.send_errors.icmp_errors,
                "overflow_drops": self.overflow_drops,
                "send_eagain": self.send_errors.eagain,
                "send_enobufs": self.send_errors.enobufs}


class Engine:
    """Drives endpoints from one thread: receive, timers, paced sends, wait for the next event."""

    def __init__(self, clock: FabricClock, dilation: Dilation,
                 wall_ns: Callable[[], int] = time.monotonic_ns,
                 spin_ns: int = SPIN_NS) -> None:
        self.clock = clock
        self.dilation = dilation
        self._wall_ns = wall_ns
        # wall ns before an event in which `wait` busy-polls instead of sleeping; 0 never
        # spins (many agents sharing few cores, or a dilation that makes select precise enough)
        self.spin_ns = spin_ns
        self.endpoints: list[Endpoint] = []
        self.bindings: list[Binding] = []
        self.extra_fds: list = []
        self.steps = 0
        self.waits = 0
        # Which endpoints have datagrams waiting: one poll(0) per step, instead of a
        # recvmsg per endpoint that mostly fails with EAGAIN (0.4 vs 1.2 us each).
        self._readable = select.poll()
        self._by_fd: dict[int, Endpoint] = {}

    def add(self, endpoint: Endpoint) -> Endpoint:
        if endpoint not in self.endpoints:
            self.endpoints.append(endpoint)
            self._by_fd[endpoint.fileno()] = endpoint
            self._readable.register(endpoint.fileno(), select.POLLIN)
        self.refresh()
        return endpoint

    def remove(self, endpoint: Endpoint) -> None:
        """Stop driving `endpoint` (call before closing it)."""
        if endpoint in self.endpoints:
            self.endpoints.remove(endpoint)
            fd = endpoint.fileno()
            self._by_fd.pop(fd, None)
            self._readable.unregister(fd)
        self.refresh()

    def refresh(self) -> None:
        """Pick up QPs attached to the endpoints since the last call."""
        self.bindings = [b for ep in self.endpoints for b in ep.bindings]

    def step(self) -> bool:
        """One round: receive, fire due timers, send what the pacers allow. True if busy."""
        self.steps += 1
        now_fn = self.clock.now_ns
        busy = False
        now = now_fn()
        ready = self._readable.poll(0)
        if ready:
            by_fd = self._by_fd
            for fd, _events in ready:
                if by_fd[fd].receive(now):
                    busy = True
        now = now_fn()
        for b in self.bindings:
            r = b.qp.requester
            t = r.next_timer_ns()
            if t is not None and t <= now:
                r.on_timer(now)
            k = 0
            if b.drop_every or b.drop_prob:
                k = self._send_with_drops(b, r, now)
            elif b.tx_batch is not None:
                k = self._send_fast(b, r, now)
            else:
                # the common case, a call level shallower: ~0.3 us of a ~9 us packet
                sendto, peer = b.endpoint.sock.sendto, b.peer
                while k < SEND_BATCH:
                    view = r.poll_send(now)
                    if view is None:
                        break
                    try:
                        sendto(view, peer)
                    except OSError as e:    # a send timeout, ENOBUFS, ICMP: the slow path
                        try:
                            b.endpoint.send_failed(e)
                            b.endpoint.send(view, peer)
                        except Stopped:
                            r.unsend([view])
                            raise
                    k += 1
            if k:
                busy = True
        return busy

    @staticmethod
    def _send_with_drops(b: Binding, r: RcRequester, now: float) -> int:
        """Up to SEND_BATCH packets of one QP through the test-only loss (`send_data`)."""
        k = 0
        while k < SEND_BATCH:
            view = r.poll_send(now)
            if view is None:
                break
            try:
                b.send_data(view, r.last_was_retransmission)
            except Stopped:
                r.unsend([view])
                raise
            k += 1
        return k

    @staticmethod
    def _send_fast(b: Binding, r: RcRequester, now: float) -> int:
        """Up to SEND_BATCH packets of one QP through the fast path (`fast_send_round`)."""
        ep = b.endpoint
        peer = b.peer
        return fast_send_round(r, b.tx_batch, now, SEND_BATCH,
                               lambda batch: ep.send_batch(batch, peer),
                               lambda view: ep.send(view, peer))

    def next_event_ns(self) -> float | None:
        """Fabric time of the next send or timer any QP has, or None."""
        best = None
        for b in self.bindings:
            r = b.qp.requester
            for t in (r.send_due_ns(), r.next_timer_ns()):
                if t is not None and (best is None or t < best):
                    best = t
        return best

    def wait(self, max_wall_ns: int = MAX_SLEEP_NS) -> None:
        """Sleep until a socket is readable or the next event is near (spin the last bit)."""
        nxt = self.next_event_ns()
        if nxt is None:
            wall = max_wall_ns
        else:
            wall = self.dilation.to_wall_ns(nxt - self.clock.now_ns())
            if wall <= self.spin_ns:
                return
            wall = min(wall - self.spin_ns, max_wall_ns)
        self.waits += 1
        select.select(self.endpoints + self.extra_fds, [], [], wall / 1e9)

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
