"""One host's flows over the Ultra Ethernet transport (`--transport uet`): the same
schedule, timing and output as `agents.flows.host.FlowHost`, with each flow one UET WRITE
instead of an RDMA WRITE on a QP of its own.

The host has one `agents.uet.nic.UetNic` (UDP 4793, one PDC per peer host, every flow
between two hosts on that PDC, its packets sprayed over the NIC's entropies). Flow f is
a WRITE to memory key f + 1 at offset 0: the receiver registers that key for each flow
the schedule says comes to it, every key on one discarding sink (a flow's bytes are
placed, counted and overwritten by the next), so a flow is received when the NIC reports
its WRITE complete. A flow is done at the sender when every packet of its WRITE is
acknowledged (`on_done`), which is its completion time, as for RoCE.

Per-flow packet counts are not kept: UET's PDC carries every flow to one peer, and what
it counts (packets, retransmissions, NACKs, timeouts) is per PDC, in the final output's
`uet` counters and summed in the totals. The per-flow columns `packets`,
`retransmissions`, `timeouts` and `cnps_received` are therefore null, `sport` is the
first entropy, and `first_ns` of a received flow is when its WRITE completed.
"""

from __future__ import annotations

import mmap
from argparse import Namespace
from collections.abc import Callable

from agents.flows.host import UNFINISHED, InFlow, OutFlow, ScheduledHost
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import Lifecycle
from agents.timebase import Dilation
from agents.uet.nic import UetNic, UetOptions

RX_BUFFER_BYTES = 32 << 20        # SO_RCVBUF of the NIC's receive socket (doubled)


def uet_options(args: Namespace) -> UetOptions:
    """The NIC's options from the agent's command line (fabric units)."""
    return UetOptions(
        dscp=args.dscp, cc=args.uet_cc, entropy=args.entropy, entropies=args.entropies,
        payload_bytes=args.payload_bytes, line_rate_bps=float(args.line_rate_bps),
        base_rtt_ns=float(args.base_rtt_ns), trim_dscp=args.trim_dscp,
        rto_ns=float(args.timeout_ns), window_packets=args.window_packets or 256,
        spin_ns=args.spin_ns, rcvbuf_bytes=RX_BUFFER_BYTES, seed=args.seed)


class UetFlowHost(ScheduledHost):
    """A host's UET senders and receiver, on one NIC driven from one thread."""

    def __init__(self, args: Namespace, out: list[OutFlow], inc: dict[int, InFlow],
                 life: Lifecycle) -> None:
        self._schedule_init(args, out, inc, life)
        self.opts = uet_options(args)
        self._spin_ns = self.opts.spin_ns
        self.nic = UetNic(self.local_ip, self.clock, self.dilation, self.opts,
                          should_stop=life.should_stop)
        self.nic.on_write = self._on_write
        biggest_in = max((f.size_bytes for f in inc.values()), default=1)
        self.sink = mmap.mmap(-1, biggest_in)
        sink_view = memoryview(self.sink)
        for f in inc.values():
            self.nic.register(f.flow_id + 1, sink_view[:f.size_bytes])
        self.sending: dict[int, float] = {}        # flow id -> posted (ns after t0)

    def _step(self) -> bool:
        busy = self.nic.step()
        self._failed_pdcs()
        return busy

    def _wait(self, wall_ns: int) -> None:
        self.nic.wait(wall_ns)

    def _start(self, f: OutFlow) -> None:
        self.nic.write(f.dst_ip, f.flow_id + 1, 0, self.source_view[:f.size_bytes],
                       on_done=self._done_callback(f))
        self.sending[f.flow_id] = self.rel_ns()
        self.totals.started += 1

    def _done_callback(self, f: OutFlow) -> Callable[[int], None]:
        return lambda _message_id: self._sent(f)

    def _sent(self, f: OutFlow) -> None:
        posted = self.sending.pop(f.flow_id, None)
        if posted is None:
            return
        self.totals.completed += 1
        self.totals.bytes_completed += f.size_bytes
        self._record_sent(f, posted, self.rel_ns(), None)

    def _failed_pdcs(self) -> None:
        """Flows to a peer whose PDC failed (its retries ran out) fail with its error."""
        if not self.nic.errors or not self.sending:
            return
        dead = {peer for peer, pdc in self.nic.pdcs.items() if pdc.error is not None}
        for f in self.out[:self.next_out]:
            if f.flow_id in self.sending and f.dst_ip in dead:
                posted = self.sending.pop(f.flow_id)
                self.totals.failed += 1
                self._record_sent(f, posted, None, self.nic.pdcs[f.dst_ip].error)

    def _on_write(self, peer: str, key: int, _offset: int, _length: int) -> None:
        flow = self.expect.get(key - 1)
        if flow is None or peer != flow.src_ip:
            self.totals.unexpected_packets += 1
            return
        del self.expect[flow.flow_id]
        rel = round(self.rel_ns())
        self.totals.rx_started += 1
        self.totals.rx_completed += 1
        for k, v in (("flow_id", flow.flow_id), ("first_ns", rel), ("done_ns", rel),
                     ("packets", None), ("ce_packets", None), ("cnps_sent", None),
                     ("ooo_drops", None), ("duplicates", None)):
            self.received[k].append(v)

    def _record_sent(self, f: OutFlow, posted_ns: float, done_ns: float | None,
                     error: str | None) -> None:
        for k, v in (("flow_id", f.flow_id), ("sport", self.nic.sports[0]),
                     ("posted_ns", round(posted_ns)),
                     ("done_ns", None if done_ns is None else round(done_ns)),
                     ("packets", None), ("retransmissions", None), ("timeouts", None),
                     ("cnps_received", None), ("error", error)):
            self.sent[k].append(v)

    def finish(self) -> None:
        """Record what is still in progress (a stop) and close the NIC."""
        by_id = {f.flow_id: f for f in self.out}
        for fid, posted in list(self.sending.items()):
            self._record_sent(by_id[fid], posted, None, UNFINISHED)
        self.sending.clear()
        self.nic.close()
        self.source_view.release()
        self.source.close()

    # -- counters

    def _live_sums(self) -> dict:
        t = self.nic.counters().get("totals", {})
        rx_packets = int(t.get("rx_packets", 0))
        rx_bytes = int(t.get("rx_bytes", 0))
        tx_packets = int(t.get("tx_packets", 0))
        return {"packets_sent": tx_packets,
                "wire_bytes_sent": int(t.get("tx_bytes", 0)) + tx_packets * WIRE_OVERHEAD_BYTES,
                "retransmissions": int(t.get("retransmissions", 0)),
                "timeouts": int(t.get("timeouts", 0)), "cnps_received": 0,
                "rx_packets": rx_packets, "rx_bytes": rx_bytes,
                "rx_ce_packets": int(t.get("ecn_received", 0)), "cnps_sent": 0,
                "rx_wire_bytes": rx_bytes + rx_packets * WIRE_OVERHEAD_BYTES,
                "nacks_received": int(t.get("nacks_received", 0)),
                "trims_received": int(t.get("trims_received", 0))}

    def snapshot(self) -> dict:
        """As FlowHost.snapshot: the run's `recv.<field>` series."""
        t = self.totals
        sums = self._live_sums()
        return {"mode": "recv", "phase": self.phase, "bytes": sums["rx_bytes"],
                "wire_bytes": sums["rx_wire_bytes"], "packets": sums["rx_packets"],
                "flows_started": t.started, "flows_completed": t.completed,
                "flows_failed": t.failed, "flows_active": len(self.sending),
                "bytes_completed": t.bytes_completed,
                "rx_flows_completed": t.rx_completed, "rx_flows_active": 0, **sums}

    def counters(self, dilation: Dilation, cc_record: Callable[[], dict]) -> dict:
        t = self.totals
        nic = self.nic.counters()
        return {"role": "flows", "transport": "uet", "local_ip": self.local_ip,
                "port": self.nic.port, "dilation": dilation.factor, **cc_record(),
                "line_rate_bps": self.args.line_rate_bps,
                "flows_out": len(self.out), "flows_in": self.in_total,
                "flows_started": t.started, "flows_completed": t.completed,
                "flows_failed": t.failed, "bytes_completed": t.bytes_completed,
                "rx_flows_started": t.rx_started, "rx_flows_completed": t.rx_completed,
                "rx_flows_never_seen": len(self.expect),
                "rx_socket_drops": int(nic.get("sockets", {}).get("overflow_drops") or 0),
                "unexpected_packets": t.unexpected_packets, **self._live_sums(),
                "uet": nic, "tx_sockets": nic.get("sockets", {}),
                "sent": self.sent, "received": self.received}
