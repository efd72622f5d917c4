"""`python -m agents.rxe_cc`: DCQCN around kernel Soft-RoCE for one rxe host.

Started inside the host's namespace with `nsenter --net` (bpffs stays visible).
rdma_rxe ignores ECN, sends no CNPs and ignores CNPs; this agent does both NIC
halves of DCQCN from outside, reading the counters of the host NIC's rxe_cc
program (testbed/net/bpf/rxe_cc.bpf.c, pinned at /sys/fs/bpf/tb/<lab>/<node>/_rxe_cc):

- notification point (`--np`): polls the CE-marked RoCEv2 packets per local QP;
  a QP that earns a CNP (agents.rxe_cc.logic.NotificationPoint: at most one per
  DCQCN CNP interval, fabric time) gets a real CNP: IPv4/UDP 4791, BTH 0x81,
  BECN, dest QP = the SENDER's QPN (the local QP's remote QPN, from
  `rdma -j res show qp`), 16 zero bytes, ICRC, DSCP of the CNP class. It goes
  out of the NIC on an AF_PACKET socket THROUGH the NIC's qdisc, so it takes
  the CNP class like any other packet of the host;
- reaction point (`--rp`): polls the CNPs that arrived at the NIC (all QPs
  together) and feeds each new one to one DCQCN reaction point
  (agents.rdma.cc.DcqcnRp, the run's DCQCN parameters); the resulting rate
  becomes the HTB ceil (and rate) of the host's LOSSLESS CLASS on the NIC's
  egress, changed by netlink at most once per --min-update-ns (fabric). The rate
  applies per host class, not per QP. The class's TBF leaf (the PFC agent's
  pause gate) is never touched.

Serves counters on --control-sock (mode "rxe_cc"): ce_packets, cnps_sent,
cnps_received, rate_bps, rate_cuts, ... (docs/run-format.md); appends rate
changes and CNPs as JSON lines to --events. On stop the class gets its planned
rate back.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import time

from agents.portmaps import STATE_FIELDS, PortMaps
from agents.rdma.cc import DcqcnParams, effective_params
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.rxe_cc.logic import (
    ClassRate,
    ClassRateLimiter,
    NotificationPoint,
    ReactionPoint,
    build_cnp_frame,
    cnp_sport,
)
from agents.rxe_cc.maps import PIN_ROOT, RxeCcMaps, Totals, pin_dir_of
from agents.timebase import Dilation
from agents.wire.netlink import Requester

ETH_P_IP = 0x0800
ENQ_BYTES = STATE_FIELDS.index("enq_bytes")
QP_REFRESH_WALL_NS = 200_000_000     # rdma res show at most this often on an unknown QP
QP_MAX_AGE_WALL_NS = 1_000_000_000   # ... and again once its table is this old
MAX_POLL_WALL_NS = 20_000_000
MIN_POLL_WALL_NS = 200_000


def parse_qps(text: str, device: str | None) -> dict[int, int]:
    """{local QPN: remote QPN} of `rdma -j res show qp` output, for one device (or all).
    Only connected QPs (state RTR or RTS) count: a GSI QP has no remote QPN, and rdma
    also lists a QP's RESET-state twin with rqpn 0 (seen on Linux 6.1)."""
    out = {}
    for row in json.loads(text or "[]"):
        if device is not None and row.get("ifname") != device:
            continue
        if "lqpn" in row and row.get("rqpn") and row.get("state") in ("RTR", "RTS"):
            out[int(row["lqpn"])] = int(row["rqpn"])
    return out


def read_qps(device: str | None) -> dict[int, int]:
    res = subprocess.run(["rdma", "-j", "res", "show", "qp"], capture_output=True, text=True,
                         timeout=10)
    if res.returncode != 0:
        raise OSError(f"rdma res show qp failed: {res.stderr.strip()}")
    return parse_qps(res.stdout, device)


def class_message(ifindex: int, classid: int, parent: int, rate: ClassRate, prio: int,
                  burst_bytes: int, overhead_bytes: int, quantum_bytes: int) -> bytes:
    """An RTM_NEWTCLASS "change" of the HTB class, compiled by pyroute2 (sends nothing)."""
    from pyroute2 import IPBatch

    ipb = IPBatch()
    try:
        ipb.tc("change-class", "htb", ifindex, classid, parent=parent,
               rate=max(1, rate.wall_rate_bps // 8), ceil=max(1, rate.wall_ceil_bps // 8),
               prio=prio, burst=burst_bytes, cburst=burst_bytes, overhead=overhead_bytes,
               quantum=quantum_bytes)
        return bytes(ipb.batch)
    finally:
        ipb.close()


def _import_pyroute2() -> None:
    import pyroute2  # noqa: F401


def handle(text: str) -> int:
    major, _, minor = text.partition(":")
    return (int(major, 16) << 16) | (int(minor, 16) if minor else 0)


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dilation = Dilation(args.dilation)
        self.t0 = time.monotonic_ns()
        self.maps = RxeCcMaps(pin_dir_of(args.lab, args.node))
        self.ifindex = socket.if_nametoindex(args.ifname)
        self.events = open(args.events, "a") if args.events else None
        self.counters = {"cnps_sent": 0, "cnp_send_errors": 0, "cnps_unresolved": 0,
                         "cnps_deferred": 0, "cnps_after_close": 0,
                         "class_updates": 0, "class_errors": 0, "polls": 0, "qp_reads": 0}
        params = effective_params("dcqcn", args.dcqcn_preset, args.line_rate_bps,
                                  json.loads(args.cc_params) if args.cc_params else None)
        assert isinstance(params, DcqcnParams)      # the preset of a DCQCN kind
        self.params = params
        self.np = NotificationPoint(params.cnp_interval_ns, params.np_mode) if args.np else None
        self.rp = ReactionPoint(params, args.line_rate_bps, 0.0) if args.rp else None
        self.limiter = ClassRateLimiter(
            args.dilation, args.line_rate_bps, args.wall_rate_bps, args.wall_ceil_bps,
            args.min_update_ns) if args.rp else None
        self.sock = None
        if self.np is not None:
            # protocol 0: the socket receives nothing (sending only; a socket of ETH_P_IP
            # would get a copy of every packet of the NIC). No PACKET_QDISC_BYPASS: the CNP
            # goes through the NIC's egress tree, into the CNP class.
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
            self.sock.bind((args.ifname, 0))
            self.src_mac = ":".join(f"{b:02x}" for b in self.sock.getsockname()[4][:6])
        self.netlink = None
        if self.rp is not None:
            # pyroute2 (the message compiler) is imported and a class message compiled
            # once before the agent says it is ready: in a TCG guest that takes tens of
            # seconds, and done lazily (or in a thread) it held the first rate cut back
            # past the end of a short run (the lane saw a cut decided and never applied).
            _import_pyroute2()
            class_message(self.ifindex, handle(args.classid), handle(args.parent),
                          ClassRate(args.wall_rate_bps, args.wall_ceil_bps, args.line_rate_bps,
                                    True), args.prio, args.burst_bytes, args.overhead_bytes,
                          args.quantum_bytes)
            self.netlink = Requester()
        self.qp_peers: dict[int, int] = {}
        # CNPs due for a QP the table did not know yet: sent once it does (one per QP)
        self.held_cnps: dict[int, object] = {}
        self.seen_qps: set[int] = set()          # every QP a table read has listed
        self.next_qp_read = 0
        self.qp_read_at = 0
        self.port_maps: PortMaps | None = None
        pin = PIN_ROOT / args.lab / args.node / args.ifname
        if self.rp is not None and args.lossless_tc is not None and (pin / "maps").exists():
            self.port_maps = PortMaps(pin)
        self.last_totals: Totals | None = None
        interval_wall = self.dilation.to_wall_ns(params.cnp_interval_ns)
        self.poll_wall_ns = args.poll_wall_ns or min(
            MAX_POLL_WALL_NS, max(MIN_POLL_WALL_NS, interval_wall // 4))

    def now_ns(self) -> float:
        return self.dilation.to_fabric_ns(time.monotonic_ns() - self.t0)

    def log(self, kind: str, **detail: object) -> None:
        """One event as a JSON line (the collector imports them into counters.sqlite)."""
        if self.events is not None:
            self.events.write(json.dumps({"mono_ns": time.monotonic_ns(), "kind": kind,
                                          "node": self.args.node, "port": self.args.ifname,
                                          "tclass": self.args.lossless_tc if
                                          self.args.lossless_tc is not None else -1,
                                          **detail}) + "\n")

    def peer_qpn(self, lqpn: int) -> int | None:
        """The remote QPN of local QP `lqpn`. rxe reuses QP numbers (every new perftest
        run's first QP is 17), so the table is read again when it is older than
        QP_MAX_AGE_WALL_NS, and at once (at most every QP_REFRESH_WALL_NS) for a QP it
        does not know."""
        peer = self.qp_peers.get(lqpn)
        now = time.monotonic_ns()
        stale = now - self.qp_read_at > QP_MAX_AGE_WALL_NS
        if (peer is None or stale) and now >= self.next_qp_read:
            self.qp_read_at = now
            self.next_qp_read = time.monotonic_ns() + QP_REFRESH_WALL_NS
            try:
                self.qp_peers = read_qps(self.args.rxe_dev)
                self.seen_qps.update(self.qp_peers)
                self.counters["qp_reads"] += 1
            except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
                self.log("rxe_cc_error", what="qp_read", error=str(exc))
            peer = self.qp_peers.get(lqpn)
        return peer

    def poll(self) -> None:
        now = self.now_ns()
        qps = self.maps.qps()
        self.counters["polls"] += 1
        if self.np is not None:
            if self.held_cnps and time.monotonic_ns() >= self.next_qp_read:
                self.send_held_cnps()
            for lqpn in self.np.observe({q: c.ce_packets for q, c in qps.items()}, now):
                self.send_cnp(qps[lqpn])
        if self.rp is not None and self.limiter is not None:
            if self.port_maps is not None:
                self.rp.on_bytes_sent(int(self.port_maps.row(self.args.lossless_tc)[ENQ_BYTES]),
                                      now)
            before = self.rp.rate_cuts
            rate = self.rp.observe(sum(c.cnps for c in qps.values()), now)
            change = self.limiter.decide(rate, now)
            if change is not None:
                self.apply(change, cuts=self.rp.rate_cuts - before)

    def send_cnp(self, q) -> None:
        peer = self.peer_qpn(q.dest_qp)
        if peer is None and q.dest_qp in self.seen_qps:
            # listed before, gone now: its QP closed while marked packets were still in
            # flight; there is no sender to slow down (a NIC would drop it too)
            self.counters["cnps_after_close"] += 1
            return
        if peer is None:
            # A new QP is marked before the table lists it (the first marks of a run come
            # within one table refresh on a slow machine): hold the CNP and send it once
            # the QP is known. A newer one for the same QP replaces it: that one is lost.
            if q.dest_qp in self.held_cnps:
                self.counters["cnps_unresolved"] += 1
            else:
                self.counters["cnps_deferred"] += 1
            self.held_cnps[q.dest_qp] = q
            return
        self._send_cnp_to(q, peer)

    def send_held_cnps(self) -> None:
        for lqpn, q in list(self.held_cnps.items()):
            peer = self.peer_qpn(lqpn)
            if peer is not None:
                del self.held_cnps[lqpn]
                self._send_cnp_to(q, peer)

    def _send_cnp_to(self, q, peer: int) -> None:
        assert self.sock is not None
        frame = build_cnp_frame(self.src_mac, self.args.gw_mac, q.dst_ip, q.src_ip, peer,
                                self.args.cnp_dscp, cnp_sport(peer))
        try:
            # the address names the protocol: skb->protocol must be IPv4 for the NIC's
            # DSCP filters (protocol ip) and the port program to classify the CNP
            self.sock.sendto(frame, (self.args.ifname, ETH_P_IP))
            self.counters["cnps_sent"] += 1
        except OSError as exc:
            self.counters["cnp_send_errors"] += 1
            self.log("rxe_cc_error", what="cnp_send", error=str(exc))

    def apply(self, change: ClassRate, cuts: int = 0) -> None:
        assert self.netlink is not None
        a = self.args
        msg = class_message(self.ifindex, handle(a.classid), handle(a.parent), change, a.prio,
                            a.burst_bytes, a.overhead_bytes, a.quantum_bytes)
        try:
            self.netlink.request(msg)
            self.counters["class_updates"] += 1
        except OSError as exc:
            self.counters["class_errors"] += 1
            self.log("rxe_cc_error", what="class_change", error=str(exc))
            return
        self.log("rxe_cc_rate", rate_bps=round(change.fabric_rate_bps),
                 wall_rate_bps=change.wall_rate_bps, wall_ceil_bps=change.wall_ceil_bps,
                 restore=change.restore, cuts=cuts)

    def snapshot(self) -> dict:
        totals: Totals | None
        try:
            totals = self.maps.totals()
            self.last_totals = totals
        except OSError:
            totals = self.last_totals
        counters = dict(self.counters)
        # held CNPs whose QP never became known are lost: unresolved, as of now
        counters["cnps_unresolved"] += len(self.held_cnps)
        snap: dict = {"mode": "rxe_cc", "node": self.args.node, **counters,
                      "np": int(self.np is not None), "rp": int(self.rp is not None)}
        if totals is not None:
            snap.update(roce_packets_rx=totals.roce_packets, ce_packets_rx=totals.ce_packets,
                        cnps_rx=totals.cnps, untracked_packets=totals.untracked)
        if self.np is not None:
            snap.update(ce_packets=self.np.ce_packets, cnps_due=self.np.cnps_due,
                        np_qps=len(self.np.qps))
        if self.rp is not None and self.limiter is not None:
            rp = self.rp.rp.snapshot()
            snap.update(cnps_received=self.rp.cnps_received, rate_bps=self.rp.rate_bps,
                        target_rate_bps=rp["rt_bps"], alpha=rp["alpha"],
                        rate_cuts=self.rp.rate_cuts, line_rate_bps=self.args.line_rate_bps,
                        applied_rate_bps=(self.limiter.applied_bps
                                          if self.limiter.applied_bps is not None
                                          else self.args.line_rate_bps),
                        updates_suppressed=self.limiter.suppressed)
        return snap

    def run(self, life: Lifecycle) -> None:
        while not life.should_stop():
            self.poll()
            if self.events is not None:
                self.events.flush()
            select.select([], [], [], self.poll_wall_ns / 1e9)

    def close(self) -> None:
        if self.limiter is not None and self.limiter.applied_bps is not None:
            a = self.args
            try:
                self.apply(ClassRate(a.wall_rate_bps, a.wall_ceil_bps, a.line_rate_bps, True))
            except Exception:       # noqa: BLE001 - best effort while stopping
                pass
        if self.netlink is not None:
            self.netlink.close()
        if self.sock is not None:
            self.sock.close()
        if self.port_maps is not None:
            self.port_maps.close()
        self.maps.close()
        if self.events is not None:
            self.events.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.rxe_cc",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--lab", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--ifname", required=True, help="the host's NIC (in this namespace)")
    p.add_argument("--np", action="store_true", help="notification point: send CNPs")
    p.add_argument("--rp", action="store_true", help="reaction point: cut the class rate")
    p.add_argument("--dilation", type=int, required=True)
    p.add_argument("--dcqcn-preset", default="hpcc-ns3-paper")
    p.add_argument("--cc-params", help="DcqcnParams overrides as JSON (absolute values)")
    p.add_argument("--line-rate-bps", type=int, required=True, help="the NIC's fabric rate")
    p.add_argument("--rxe-dev", help="the host's rxe device (its QPs only)")
    p.add_argument("--gw-mac", help="destination MAC of CNPs (the NIC's peer)")
    p.add_argument("--cnp-dscp", type=int, default=48)
    p.add_argument("--classid", help="the lossless class's HTB class, e.g. 1:13")
    p.add_argument("--parent", default="1:1")
    p.add_argument("--prio", type=int, default=1)
    p.add_argument("--wall-rate-bps", type=int, help="the class's planned wall rate")
    p.add_argument("--wall-ceil-bps", type=int, help="the class's planned wall ceil")
    p.add_argument("--burst-bytes", type=int, default=9000)
    p.add_argument("--overhead-bytes", type=int, default=0)
    p.add_argument("--quantum-bytes", type=int, default=9000)
    p.add_argument("--lossless-tc", type=int, help="class number (byte counter from the "
                                                   "port program's sent bytes)")
    p.add_argument("--min-update-ns", type=float, default=0.0,
                   help="fabric ns between two class changes (0: one CNP interval)")
    p.add_argument("--poll-wall-ns", type=int, default=0,
                   help="wall ns between polls (0: a quarter CNP interval, 0.2..20 ms)")
    p.add_argument("--control-sock")
    p.add_argument("--events")
    p.add_argument("--ready-file")
    p.add_argument("--no-parent-watch", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.np and not args.gw_mac:
        raise SystemExit("--np needs --gw-mac")
    if args.rp and (args.classid is None or args.wall_rate_bps is None
                    or args.wall_ceil_bps is None):
        raise SystemExit("--rp needs --classid, --wall-rate-bps and --wall-ceil-bps")
    life = Lifecycle(watch_parent=not args.no_parent_watch)
    life.install_signal_handlers()
    agent = Agent(args)
    if args.rp and not args.min_update_ns:
        args.min_update_ns = agent.params.cnp_interval_ns or 50_000
        assert agent.limiter is not None
        agent.limiter.min_interval_ns = args.min_update_ns
    server = serve_snapshots(args.control_sock, agent.snapshot)
    mark_ready(args.ready_file)
    try:
        agent.run(life)
    finally:
        if server is not None:
            server.close()
        agent.close()
    report_counters(agent.snapshot())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
