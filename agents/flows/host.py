"""One host's flows: start each of its flows at its time, receive the flows sent to it,
and time each flow from its scheduled start to the sender's completion.

Queue pairs need no set-up exchange: every agent of a run reads the same schedule, so
both ends of flow f know its QPN (f + 1 on both sides), its first PSNs (0), the
receiver's memory region (one discarding sink, R_Key SINK_RKEY at VA 0) and the sender's
address. The receiver makes a flow's responder when the flow's first packet arrives
(`Endpoint.on_unknown_qp`), from the address that packet came from, so the sender's
source port need not be known in advance; a packet for a flow that is not expected, or
from another host than the flow's source, is counted and dropped.

Times: `t0` is the run's common start (`--start-at-mono-ns`), as fabric time on this
agent's clock; a flow's start and completion are fabric ns after it. A completion is
stamped after the engine step that took the last ACK, so it is late by at most one step
(tens of wall microseconds: tens of fabric nanoseconds at D = 1000).
"""

from __future__ import annotations

import errno
import mmap
from argparse import Namespace
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agents.rdma.cc import NoCc
from agents.rdma.options import cc_params, cc_settings, make_np, make_rate_controller, qp_attrs
from agents.rdma.qp import MemoryRegion, QpAttrs, RcQp, WcStatus
from agents.rdma.transport import MAX_SLEEP_NS, Binding, Endpoint, Engine, rxe_sport
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import Lifecycle
from agents.timebase import Dilation, FabricClock
from agents.wire.roce import icrc_context

SINK_RKEY = 0x5151
MAX_FLOW_ID = 0xFFFFFE - 1        # QPN = flow id + 1 must fit 24 bits (and not be 0xFFFFFF)
# A finished flow's responder stays attached this many QP timeouts, so a retransmission
# that crossed the last ACK is answered as a duplicate instead of counted unknown.
LINGER_TIMEOUTS = 4
RX_BUFFER_BYTES = 32 << 20        # SO_RCVBUF of the receive socket (the kernel doubles it)
UNFINISHED = "unfinished"         # a flow's error when a stop cut it short


@dataclass(frozen=True)
class OutFlow:
    flow_id: int
    dst_ip: str
    dport: int
    size_bytes: int
    start_ns: int
    dscp: int


@dataclass(frozen=True)
class InFlow:
    flow_id: int
    src_ip: str
    size_bytes: int


def parse_schedule(doc: dict) -> tuple[list[OutFlow], dict[int, InFlow]]:
    """The host's part of the run's schedule: {"out": [[id, dst_ip, dport, size, start_ns,
    dscp], ...], "in": [[id, src_ip, size], ...]} (ValueError naming what is wrong)."""
    try:
        out = [OutFlow(int(f[0]), str(f[1]), int(f[2]), int(f[3]), int(f[4]), int(f[5]))
               for f in doc.get("out", [])]
        inc = {int(f[0]): InFlow(int(f[0]), str(f[1]), int(f[2])) for f in doc.get("in", [])}
    except (TypeError, IndexError, ValueError) as e:
        raise ValueError(f"schedule: a malformed flow ({e})") from None
    for f in out:
        if not 0 <= f.flow_id <= MAX_FLOW_ID or not 1 <= f.size_bytes < 1 << 31:
            raise ValueError(f"schedule: flow {f.flow_id}: id or size out of range")
    out.sort(key=lambda f: (f.start_ns, f.flow_id))
    return out, inc


@dataclass
class _Sending:
    flow: OutFlow
    endpoint: Endpoint
    binding: Binding
    posted_ns: float


@dataclass
class _Receiving:
    flow: InFlow
    binding: Binding
    first_ns: float
    done_ns: float | None = None


@dataclass
class Totals:
    """What the live snapshot and the final counters sum over every flow so far."""

    started: int = 0
    completed: int = 0
    failed: int = 0
    bytes_completed: int = 0
    packets_sent: int = 0
    wire_bytes_sent: int = 0
    retransmissions: int = 0
    timeouts: int = 0
    naks: int = 0
    cnps_received: int = 0
    rx_started: int = 0
    rx_completed: int = 0
    rx_packets: int = 0
    rx_bytes: int = 0
    rx_ce_packets: int = 0
    cnps_sent: int = 0
    duplicates: int = 0
    ooo_drops: int = 0
    unexpected_packets: int = 0
    sport_retries: int = 0
    # what the flows' own sockets counted, summed as each closes (Endpoint.counters)
    tx_sockets: dict = field(default_factory=dict)


SENT_COLUMNS = ("flow_id", "sport", "posted_ns", "done_ns", "packets", "retransmissions",
                "timeouts", "cnps_received", "error")
RECEIVED_COLUMNS = ("flow_id", "first_ns", "done_ns", "packets", "ce_packets", "cnps_sent",
                    "ooo_drops", "duplicates")


class ScheduledHost:
    """What a host's flows share whatever carries them (RoCE QPs here, a UET NIC in
    agents/flows/uet_host.py): the schedule, the common start t0, the flows' source
    bytes, the per-flow columns of the output, and the loop that starts each flow at its
    time and drives the transport until every flow is done. A transport gives `_step()`
    (one round; True if busy), `_wait(wall_ns)`, `_spin_ns` and `_start(flow)`, and
    fills `sending`."""

    sending: dict

    def _schedule_init(self, args: Namespace, out: list[OutFlow], inc: dict[int, InFlow],
                       life: Lifecycle) -> None:
        self.args = args
        self.life = life
        self.dilation = Dilation(args.dilation)
        self.clock = FabricClock(self.dilation)
        self.local_ip = args.bind
        self.out = out
        self.expect = dict(inc)
        self.in_total = len(inc)
        biggest = max((f.size_bytes for f in out), default=1)
        # Untouched anonymous pages all read as the one zero page: a 1 GB flow's source
        # costs address space, not memory.
        self.source = mmap.mmap(-1, biggest, prot=mmap.PROT_READ)
        self.source_view = memoryview(self.source)
        self.next_out = 0
        self.t0_ns = 0.0
        self.totals = Totals()
        # per flow, in the order they finish: the final counters' columns
        self.sent: dict[str, list] = {k: [] for k in SENT_COLUMNS}
        self.received: dict[str, list] = {k: [] for k in RECEIVED_COLUMNS}
        self.phase = "setup"

    def start(self, start_at_mono_ns: int | None) -> None:
        """Fix t0: the common start, on this agent's fabric clock."""
        self.t0_ns = (self.clock.at_wall_clock_ns(start_at_mono_ns) if start_at_mono_ns
                      else self.clock.now_ns())
        self.phase = "running"

    def rel_ns(self) -> float:
        return self.clock.now_ns() - self.t0_ns

    def done(self) -> bool:
        return (self.next_out == len(self.out) and not self.sending
                and self.totals.rx_completed >= self.in_total)

    def run(self) -> None:
        """Until every flow of this host is done, or a stop."""
        spin_ns = self._spin_ns
        while not self.life.should_stop():
            self._start_due()
            busy = self._step()
            if self.done():
                break
            if busy:
                continue
            wall = MAX_SLEEP_NS
            if self.next_out < len(self.out):
                to_start = self.dilation.to_wall_ns(
                    self.out[self.next_out].start_ns - self.rel_ns())
                if to_start <= spin_ns:
                    continue
                wall = min(wall, to_start - spin_ns)
            self._wait(wall)
        self.phase = "done"

    def _start_due(self) -> None:
        rel = self.rel_ns()
        out = self.out
        while self.next_out < len(out) and out[self.next_out].start_ns <= rel:
            self._start(out[self.next_out])
            self.next_out += 1

    # the transport's part
    _spin_ns: int

    def _step(self) -> bool:
        raise NotImplementedError

    def _wait(self, wall_ns: int) -> None:
        raise NotImplementedError

    def _start(self, flow: OutFlow) -> None:
        raise NotImplementedError


class FlowHost(ScheduledHost):
    """A host's senders and its receiver, driven by one engine from one thread."""

    def __init__(self, args: Namespace, out: list[OutFlow], inc: dict[int, InFlow],
                 life: Lifecycle) -> None:
        self._schedule_init(args, out, inc, life)
        self.cc = cc_settings(args)
        self.params = cc_params(args, self.cc)
        self.attrs: QpAttrs = qp_attrs(args, args.mtu)
        self.engine = Engine(self.clock, self.dilation, spin_ns=args.spin_ns)
        self._spin_ns = self.engine.spin_ns
        # One socket takes every flow into this host. Its buffer is large: a receiving
        # agent short of CPU must delay ACKs, not drop datagrams a real NIC would have
        # taken (what it still drops, SO_RXQ_OVFL counts).
        self.rx = Endpoint(self.local_ip, args.port, dscp=args.dscp, cnp_dscp=args.cnp_dscp,
                           should_stop=life.should_stop, rcvbuf_bytes=RX_BUFFER_BYTES,
                           count_overflow=True)
        self.rx.on_unknown_qp = self._first_packet
        self.engine.add(self.rx)
        self.sink = MemoryRegion.sink(1 << 31, 0, SINK_RKEY)
        self.sending: dict[int, _Sending] = {}
        self.receiving: dict[int, _Receiving] = {}
        self.lingering: deque[tuple[float, int]] = deque()   # (detach at fabric ns, qpn)

    def _step(self) -> bool:
        busy = self.engine.step()
        self._reap()
        return busy

    def _wait(self, wall_ns: int) -> None:
        self.engine.wait(wall_ns)

    def _endpoint_for(self, flow: OutFlow) -> Endpoint:
        """A socket on the flow's own rxe-style source port (another if that one is taken)."""
        qpn = flow.flow_id + 1
        for k in range(64):
            sport = rxe_sport((qpn + k * 0x9E3779B1) & 0xFFFFFF)
            try:
                return Endpoint(self.local_ip, sport, dscp=flow.dscp, cnp_dscp=self.args.cnp_dscp,
                                should_stop=self.life.should_stop,
                                sndbuf_bytes=self.args.sndbuf_bytes or None)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                self.totals.sport_retries += 1
        # every candidate taken: let the kernel pick one
        return Endpoint(self.local_ip, 0, dscp=flow.dscp, cnp_dscp=self.args.cnp_dscp,
                        should_stop=self.life.should_stop,
                        sndbuf_bytes=self.args.sndbuf_bytes or None)

    def _start(self, flow: OutFlow) -> None:
        ep = self._endpoint_for(flow)
        qpn = flow.flow_id + 1
        ctx = icrc_context(self.local_ip, flow.dst_ip, ep.port, flow.dport)
        qp = RcQp(qpn, qpn, ctx, self.attrs,
                  make_rate_controller(self.args, self.cc, self.clock.now_ns()),
                  clock=self.clock)
        b = ep.attach(qp, (flow.dst_ip, flow.dport))
        self.engine.add(ep)
        # the post is the flow's start as the fabric sees it: its QP and socket exist
        now = self.clock.now_ns()
        qp.requester.post_write_imm(flow.flow_id, self.source_view[:flow.size_bytes], 0,
                                    SINK_RKEY, flow.flow_id & 0xFFFFFFFF)
        self.sending[flow.flow_id] = _Sending(flow, ep, b, now - self.t0_ns)
        self.totals.started += 1

    # -- receiving

    def _first_packet(self, qpn: int, addr: tuple[str, int]) -> Binding | None:
        flow = self.expect.get(qpn - 1)
        if flow is None or addr[0] != flow.src_ip:
            self.totals.unexpected_packets += 1
            return None
        del self.expect[flow.flow_id]
        now = self.clock.now_ns()
        ctx = icrc_context(self.local_ip, addr[0], self.rx.port, addr[1])
        qp = RcQp(qpn, qpn, ctx, self.attrs, NoCc(self.args.line_rate_bps, now),
                  np=make_np(self.args, self.cc[0], self.params),
                  mrs={SINK_RKEY: self.sink}, clock=self.clock)
        qp.responder.post_recv(flow.flow_id)
        b = self.rx.attach(qp, addr)
        self.receiving[flow.flow_id] = _Receiving(flow, b, now - self.t0_ns)
        self.totals.rx_started += 1
        return b

    # -- completions

    def _reap(self) -> None:
        now = self.clock.now_ns()
        rel = now - self.t0_ns
        t = self.totals
        for fid, s in list(self.sending.items()):
            r = s.binding.qp.requester
            if not r.completions:
                continue
            c = r.completions.popleft()
            ok = c.status == WcStatus.SUCCESS
            self._record_sent(s, rel if ok else None, None if ok else (r.error or c.status))
            self._close(s)
            del self.sending[fid]
        for fid, rv in list(self.receiving.items()):
            rs = rv.binding.qp.responder
            if rv.done_ns is None and rs.completions:
                rs.completions.popleft()
                rv.done_ns = rel
                self._record_received(rv)
                t.rx_completed += 1
                self.lingering.append((now + LINGER_TIMEOUTS * self.attrs.timeout_ns,
                                       rv.binding.qp.qpn))
                del self.receiving[fid]
        while self.lingering and self.lingering[0][0] <= now:
            _, qpn = self.lingering.popleft()
            self.rx.detach(qpn)

    def _close(self, s: _Sending) -> None:
        """Close a finished flow's socket, keeping what it counted: a send that waited
        out SO_SNDTIMEO (a full NIC queue: a paused port), ENOBUFS, ICMP errors, and
        packets it could not use."""
        self.engine.remove(s.endpoint)
        sums = self.totals.tx_sockets
        for key, value in s.endpoint.counters().items():
            if isinstance(value, int):
                sums[key] = sums.get(key, 0) + value
            elif isinstance(value, dict):
                inner = sums.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
        s.endpoint.close()

    def _record_sent(self, s: _Sending, done_ns: float | None, error: str | None) -> None:
        """A flow's sender is done: completed (error None), failed, or cut short by a
        stop (error "unfinished", which is not a failure)."""
        c = s.binding.qp.requester
        t = self.totals
        if error is None:
            t.completed += 1
            t.bytes_completed += s.flow.size_bytes
        elif error != UNFINISHED:
            t.failed += 1
        t.packets_sent += c.packets_sent
        t.wire_bytes_sent += c.wire_bytes_sent
        t.retransmissions += c.retransmissions
        t.timeouts += c.timeouts
        t.naks += c.naks_received + c.rnr_naks_received + c.fatal_naks_received
        t.cnps_received += c.cnps_received
        for k, v in (("flow_id", s.flow.flow_id), ("sport", s.endpoint.port),
                     ("posted_ns", round(s.posted_ns)),
                     ("done_ns", None if done_ns is None else round(done_ns)),
                     ("packets", c.packets_sent), ("retransmissions", c.retransmissions),
                     ("timeouts", c.timeouts), ("cnps_received", c.cnps_received),
                     ("error", error)):
            self.sent[k].append(v)

    def _record_received(self, rv: _Receiving) -> None:
        rs = rv.binding.qp.responder
        t = self.totals
        t.rx_packets += rs.packets_received
        t.rx_bytes += rs.payload_bytes_received
        t.rx_ce_packets += rs.ce_packets_received
        t.cnps_sent += rs.cnps_sent
        t.duplicates += rs.duplicates
        t.ooo_drops += rs.ooo_drops
        for k, v in (("flow_id", rv.flow.flow_id), ("first_ns", round(rv.first_ns)),
                     ("done_ns", None if rv.done_ns is None else round(rv.done_ns)),
                     ("packets", rs.packets_received), ("ce_packets", rs.ce_packets_received),
                     ("cnps_sent", rs.cnps_sent), ("ooo_drops", rs.ooo_drops),
                     ("duplicates", rs.duplicates)):
            self.received[k].append(v)

    def finish(self) -> None:
        """Record what is still in progress (a stop) and close every socket."""
        for s in list(self.sending.values()):
            self._record_sent(s, None, UNFINISHED)
            self._close(s)
        self.sending.clear()
        for rv in list(self.receiving.values()):
            self._record_received(rv)
        self.receiving.clear()
        self.rx.close()
        self.source_view.release()
        self.source.close()

    # -- counters

    def _live_sums(self) -> dict:
        """Totals including the flows in progress (for time series)."""
        t = self.totals
        sums = {"packets_sent": t.packets_sent, "wire_bytes_sent": t.wire_bytes_sent,
                "retransmissions": t.retransmissions, "timeouts": t.timeouts,
                "cnps_received": t.cnps_received, "rx_packets": t.rx_packets,
                "rx_bytes": t.rx_bytes, "rx_ce_packets": t.rx_ce_packets,
                "cnps_sent": t.cnps_sent}
        for s in list(self.sending.values()):
            c = s.binding.qp.requester
            sums["packets_sent"] += c.packets_sent
            sums["wire_bytes_sent"] += c.wire_bytes_sent
            sums["retransmissions"] += c.retransmissions
            sums["timeouts"] += c.timeouts
            sums["cnps_received"] += c.cnps_received
        for rv in list(self.receiving.values()):
            rs = rv.binding.qp.responder
            sums["rx_packets"] += rs.packets_received
            sums["rx_bytes"] += rs.payload_bytes_received
            sums["rx_ce_packets"] += rs.ce_packets_received
            sums["cnps_sent"] += rs.cnps_sent
        sums["rx_wire_bytes"] = sums["rx_bytes"] + sums["rx_packets"] * WIRE_OVERHEAD_BYTES
        return sums

    def snapshot(self) -> dict:
        """Numbers for the run's time series `recv.<field>`: "recv" because the run's
        delivered bytes and receive-rate plot read every receiving agent's recv.bytes
        (here: RDMA payload accepted in order), recv.wire_bytes and recv.packets; the
        sending side's sums and the flow counts ride along under their own names."""
        t = self.totals
        sums = self._live_sums()
        return {"mode": "recv", "phase": self.phase, "bytes": sums["rx_bytes"],
                "wire_bytes": sums["rx_wire_bytes"], "packets": sums["rx_packets"],
                "flows_started": t.started,
                "flows_completed": t.completed, "flows_failed": t.failed,
                "flows_active": len(self.sending), "bytes_completed": t.bytes_completed,
                "rx_flows_completed": t.rx_completed, "rx_flows_active": len(self.receiving),
                **sums}

    def counters(self, dilation: Dilation, cc_record: Callable[[], dict]) -> dict:
        t = self.totals
        return {"role": "flows", "local_ip": self.local_ip, "port": self.rx.port,
                "dilation": dilation.factor, "mtu": self.args.mtu, **cc_record(),
                "line_rate_bps": self.args.line_rate_bps, "qp_attrs": self.attrs.to_dict(),
                "flows_out": len(self.out), "flows_in": self.in_total,
                "flows_started": t.started, "flows_completed": t.completed,
                "flows_failed": t.failed, "bytes_completed": t.bytes_completed,
                "rx_flows_started": t.rx_started, "rx_flows_completed": t.rx_completed,
                "rx_flows_never_seen": len(self.expect),
                "rx_socket_drops": self.rx.overflow_drops,
                "unexpected_packets": t.unexpected_packets, "sport_retries": t.sport_retries,
                "duplicates": t.duplicates, "ooo_drops": t.ooo_drops,
                **self._live_sums(),
                "rx_endpoint": self.rx.counters(), "tx_sockets": t.tx_sockets,
                "fast_path": dict(self.rx.fast_path),       # agents.fast: which path ran
                "engine": {"steps": self.engine.steps, "waits": self.engine.waits},
                "sent": self.sent, "received": self.received}
