"""`python -m agents.pfc`: the PFC agent of one node (switch or host).

Started inside the node's namespace with `nsenter --net` (not `ip netns
exec`, which remounts /sys and hides the pinned BPF maps). It

- polls the node's egress queues (the port programs' virtual queues and
  per-ingress arrival counters) no later than any queue could reach XOFF,
  attributes each queue to the ingress ports that fed it, and sends real
  802.1Qbb frames out of those ingress ports: XOFF (65535 quanta, refreshed
  at half its lifetime while congested), XON (0) on resume;
- receives PFC frames on every port and pauses that port's egress class:
  the TBF gate goes to near zero and the virtual queue freezes, until the
  pause expires or XON arrives;
- with `--watchdog-ns`, declares a class paused longer than that stormed and
  forwards it regardless until the pauses stop (what switch OSes ship);
- serves per-(port, priority) counters on --control-sock and appends every
  XOFF/XON/pause/storm as a JSON line to --events.

All thresholds and times come from the plan in fabric units; the Dilation
converts. Hosts run the agent too: they obey pauses (their NIC class stops
and blocking sends push back on the application); they do not send PFC.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from agents.control import SnapshotServer
from agents.pfc.logic import PauseDecider, PauseTimer, Thresholds, safe_poll_interval_ns
from agents.portmaps import PortMaps
from agents.timebase import Dilation
from agents.udp import Lifecycle
from agents.wire import pfc as pfcwire

SOL_PACKET = 263             # not in Python's socket module
PACKET_QDISC_BYPASS = 20      # a PFC frame is a MAC control frame: it skips the port's queues
PIN_ROOT = Path("/sys/fs/bpf/tb")
# A closed gate (testbed/net/qdisc.py explains the figures): 20 kbit/s with a
# one-frame bucket, the slowest TBF the kernel accepts for 9 KB frames.
PAUSED_RATE_BPS = 20_000
NLMSG_ERROR, NLM_F_ACK = 2, 0x4
MIN_POLL_WALL_NS = 500_000
MAX_POLL_WALL_NS = 20_000_000


@dataclass
class PortCounters:
    xoff_tx: int = 0
    xon_tx: int = 0
    frames_rx: int = 0
    storms: int = 0


@dataclass
class Port:
    ifname: str
    ifindex: int
    mac: bytes
    peer_node: str
    peer_port: str
    rate_bps: int                      # fabric
    wall_rate_bps: int
    burst_bytes: int
    frame_bytes: int                   # one full frame: the bucket of a closed gate
    pfc_classes: dict[int, dict]       # tc -> ClassPlan (as JSON) with pfc settings
    sock: socket.socket
    kick: socket.socket                # same port, through its qdisc (see Gate.set)
    maps: PortMaps | None
    counters: dict[int, PortCounters] = field(default_factory=dict)
    last_ingress: dict[int, dict[int, int]] = field(default_factory=dict)


class Gate:
    """Open and close one egress class: the TBF leaf's rate and the BPF pause flag.

    The two tc requests of every (port, class) are encoded once, at start, by
    pyroute2's batch compiler; a pause then costs one raw netlink write and
    its ack (~20 us of wall time) instead of pyroute2's ~1.5 ms per request,
    which at D = 2000 is most of a microsecond of fabric time.
    """

    def __init__(self, ports: list[Port]) -> None:
        from pyroute2 import IPBatch  # a message compiler: it sends nothing

        self.messages: dict[tuple[str, int, bool], bytes] = {}
        ipb = IPBatch()
        try:
            for port in ports:
                for tc, cls in port.pfc_classes.items():
                    major, minor = cls["classid"].split(":")
                    leaf = int(cls["leaf_handle"].rstrip(":"), 16) << 16
                    for paused in (False, True):
                        rate = PAUSED_RATE_BPS if paused else port.wall_rate_bps
                        burst = port.frame_bytes if paused else port.burst_bytes
                        ipb.reset()
                        ipb.tc("change", "tbf", port.ifindex, leaf,
                               parent=(int(major, 16) << 16) | int(minor, 16),
                               rate=f"{rate}bit", burst=burst, limit=cls["limit_bytes"])
                        self.messages[(port.ifname, tc, paused)] = bytes(ipb.batch)
        finally:
            ipb.close()
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.sock.settimeout(2.0)
        self.seq = 0

    def _request(self, message: bytes) -> None:
        self.seq = (self.seq + 1) & 0x7FFFFFFF
        data = bytearray(message)
        struct.pack_into("=HI", data, 6, struct.unpack_from("=H", data, 6)[0] | NLM_F_ACK,
                         self.seq)
        self.sock.send(data)
        while True:
            reply = self.sock.recv(65536)
            offset = 0
            while offset + 16 <= len(reply):
                length, kind, _flags, seq = struct.unpack_from("=IHHI", reply, offset)
                if kind == NLMSG_ERROR and seq == self.seq:
                    code = struct.unpack_from("=i", reply, offset + 16)[0]
                    if code:
                        raise OSError(-code, f"tbf change refused: {os.strerror(-code)}")
                    return
                offset += max(16, (length + 3) & ~3)

    def set(self, port: Port, tc: int, paused: bool) -> None:
        self._request(self.messages[(port.ifname, tc, paused)])
        if port.maps is not None:
            # A TBF change refills the bucket: closing lets out up to one frame,
            # opening up to a burst, at once. The vq drains at the port rate and
            # would keep those bytes as queued, a little more each pause.
            port.maps.set_paused(tc, paused, credit_bytes=port.frame_bytes if paused
                                 else port.burst_bytes)
        if not paused:
            # A closed TBF left its watchdog armed for when the gate's slow rate
            # would allow the next packet, seconds away; changing the rate back
            # does not reschedule the port, and a sender blocked on its full
            # queue enqueues nothing that would. One frame through the port's
            # qdisc (a PFC frame that enables no priority: receivers ignore it)
            # makes it dequeue at once.
            port.kick.send(pfcwire.encode(port.mac, {}))

    def close(self) -> None:
        self.sock.close()


def _open_sock(ifname: str, bypass: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(pfcwire.ETH_P_PAUSE))
    sock.bind((ifname, pfcwire.ETH_P_PAUSE))
    if bypass:
        sock.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
    sock.setblocking(False)
    return sock


def load_ports(plan: dict, node: str, lab: str) -> tuple[dict, list[Port]]:
    me = next(n for n in plan["nodes"] if n["name"] == node)
    ports = []
    for iface in me["interfaces"]:
        egress = iface["egress"]
        pfc_classes = {c["tc"]: c for c in egress["classes"] if c.get("pfc")}
        maps = None
        pin = PIN_ROOT / lab / node / iface["ifname"]
        if pin.exists():
            maps = PortMaps(pin)
        ports.append(Port(
            ifname=iface["ifname"], ifindex=socket.if_nametoindex(iface["ifname"]),
            mac=pfcwire.mac_bytes(iface["mac"]), peer_node=iface["peer"]["node"],
            peer_port=iface["peer"]["ifname"], rate_bps=egress["rate_bps"],
            wall_rate_bps=egress["wall_rate_bps"], burst_bytes=egress["burst_bytes"],
            frame_bytes=egress["quantum_bytes"],
            pfc_classes=pfc_classes, sock=_open_sock(iface["ifname"]),
            kick=_open_sock(iface["ifname"], bypass=False), maps=maps,
            counters={tc: PortCounters() for tc in pfc_classes}))
    return me, ports


class Agent:
    def __init__(self, args) -> None:
        self.plan = json.loads(Path(args.plan).read_text())
        self.node = args.node
        self.lab = self.plan["lab"]
        self.dilation = Dilation(self.plan["dilation"]["factor"])
        self.me, self.ports = load_ports(self.plan, self.node, self.lab)
        self.by_name = {p.ifname: p for p in self.ports}
        self.by_index = {p.ifindex: p for p in self.ports}
        self.is_switch = self.me["role"] == "switch"
        self.t0 = time.monotonic_ns()
        self.events = open(args.events, "a", buffering=1) if args.events else None
        self.gate = Gate(self.ports)
        watchdog = args.watchdog_ns if args.watchdog_ns else None
        self.timer = PauseTimer(watchdog_ns=watchdog)
        thresholds: dict[int, Thresholds] = {}
        refresh: dict[str, float] = {}
        # Dynamic mode shares the node's buffer of a priority: every port's share.
        shared: dict[int, int] = {}
        for port in self.ports:
            for tc, cls in port.pfc_classes.items():
                shared[tc] = shared.get(tc, 0) + cls["limit_bytes"] - cls["pfc"]["headroom_bytes"]
        for port in self.ports:
            refresh[port.ifname] = 0.5 * pfcwire.MAX_QUANTA * pfcwire.quantum_ns(port.rate_bps)
            for tc, cls in port.pfc_classes.items():
                p = cls["pfc"]
                thresholds.setdefault(tc, Thresholds(
                    xoff_bytes=p["xoff_bytes"], xon_bytes=p["xon_bytes"],
                    headroom_bytes=p["headroom_bytes"], egress_xoff_bytes=p["xoff_bytes"],
                    egress_xon_bytes=p["xon_bytes"], mode=p.get("mode", "static"),
                    alpha=p.get("alpha", 0.125), shared_buffer_bytes=shared[tc]))
        self.decider = PauseDecider(thresholds, refresh)
        # The fastest any egress queue can fill: every other port sending into
        # it while it drains nothing (it may be paused itself).
        total = sum(p.rate_bps for p in self.ports)
        self.fill_bps = {p.ifname: max(0, total - p.rate_bps) for p in self.ports}
        self.paused_state: dict[tuple[str, int], bool] = {}
        # (egress, tc) -> (fabric ns, depth) of the last two polls, to estimate
        # when a queue crossed XOFF between them (for the reaction-time bench).
        self.depths: dict[tuple[str, int], tuple[float, int, float, int]] = {}

    def now_fabric_ns(self) -> float:
        return self.dilation.to_fabric_ns(time.monotonic_ns() - self.t0)

    def log(self, kind: str, port: str, tc: int, **detail) -> None:
        if self.events is None:
            return
        self.events.write(json.dumps({"mono_ns": time.monotonic_ns(), "kind": kind,
                                      "node": self.node, "port": port, "tclass": tc,
                                      **detail}) + "\n")

    # -- receiving pauses -------------------------------------------------------------
    def on_frame(self, port: Port, data: bytes) -> None:
        try:
            frame = pfcwire.decode(data)
        except pfcwire.MalformedPfc:
            return
        now = self.now_fabric_ns()
        for prio, quanta in frame.paused().items():
            if prio not in port.pfc_classes:
                continue              # priorities without PFC are never paused
            port.counters[prio].frames_rx += 1
            pause_ns = quanta * pfcwire.quantum_ns(port.rate_bps)
            self.timer.on_frame(port.ifname, prio, pause_ns, now)
            self._apply(port, prio, now, quanta=quanta)

    def _apply(self, port: Port, prio: int, now: float, quanta: int | None = None) -> None:
        paused = self.timer.is_paused(port.ifname, prio, now)
        key = (port.ifname, prio)
        if self.paused_state.get(key, False) != paused:
            self.gate.set(port, prio, paused)
            self.paused_state[key] = paused
            self.log("pfc_paused" if paused else "pfc_resumed", port.ifname, prio,
                     peer_node=port.peer_node, peer_port=port.peer_port, quanta=quanta)

    # -- sending pauses ---------------------------------------------------------------
    def poll(self) -> float:
        """Observe every egress queue; send XOFF/XON; return the next poll delay (wall ns)."""
        now = self.now_fabric_ns()
        delay = float(MAX_POLL_WALL_NS)
        for port in self.ports:
            if port.maps is None or not port.pfc_classes:
                continue
            for tc in port.pfc_classes:
                depth = port.maps.vq_bytes(tc)
                totals = port.maps.ingress_bytes(tc)
                prev = port.last_ingress.get(tc, {})
                arrivals = {}
                for ifindex, total in totals.items():
                    src = self.by_index.get(ifindex)
                    if src is not None and total > prev.get(ifindex, 0):
                        arrivals[src.ifname] = total - prev.get(ifindex, 0)
                port.last_ingress[tc] = totals
                self.decider.observe(port.ifname, tc, depth, arrivals)
                last = self.depths.get((port.ifname, tc))
                prev_t, prev_d = (last[2], last[3]) if last else (now, depth)
                self.depths[(port.ifname, tc)] = (prev_t, prev_d, now, depth)
                xoff = port.pfc_classes[tc]["pfc"]["xoff_bytes"]
                wait_fabric = safe_poll_interval_ns(depth, xoff, self.fill_bps[port.ifname],
                                                    0, 1e18)
                delay = min(delay, self.dilation.to_wall_ns(wait_fabric))
        for action in self.decider.decide(now):
            port = self.by_name.get(action.ingress)
            if port is None or action.priority not in port.pfc_classes:
                continue
            crossed = self._crossed_ns_ago(action.ingress, action.priority, now)
            quanta = pfcwire.MAX_QUANTA if action.xoff else 0
            port.sock.send(pfcwire.encode(port.mac, {action.priority: quanta}))
            c = port.counters[action.priority]
            if action.xoff:
                c.xoff_tx += 1
            else:
                c.xon_tx += 1
            self.log("pfc_xoff" if action.xoff else "pfc_xon", port.ifname, action.priority,
                     peer_node=port.peer_node, peer_port=port.peer_port, quanta=quanta,
                     occupancy_bytes=action.occupancy_bytes, reason=action.reason,
                     crossed_ns_ago=crossed)
        return max(MIN_POLL_WALL_NS, min(delay, MAX_POLL_WALL_NS))

    def _crossed_ns_ago(self, ingress: str, prio: int, now: float) -> float | None:
        """Fabric ns since the deepest queue this ingress feeds crossed XOFF (interpolated
        between the last two polls), or None if no queue it feeds is above XOFF."""
        best = None
        for (egress, tc), fifo in self.decider.fifos.items():
            if tc != prio or ingress not in fifo.by_ingress:
                continue
            t0, d0, t1, d1 = self.depths.get((egress, tc), (now, 0, now, 0))
            xoff = self.by_name[egress].pfc_classes[tc]["pfc"]["xoff_bytes"]
            if d1 < xoff:
                continue
            if d0 >= xoff or d1 == d0:
                crossed_at = t0 if d0 >= xoff else t1
            else:
                crossed_at = t0 + (xoff - d0) / (d1 - d0) * (t1 - t0)
            ago = now - crossed_at
            best = ago if best is None else max(best, ago)
        return best

    def expire(self) -> None:
        now = self.now_fabric_ns()
        for port_name, prio, what in self.timer.expire(now):
            port = self.by_name[port_name]
            if what == "storm":
                port.counters[prio].storms += 1
                self.log("pfc_storm", port_name, prio, peer_node=port.peer_node,
                         peer_port=port.peer_port)
            self._apply(port, prio, now)

    def snapshot(self) -> dict:
        now = self.now_fabric_ns()
        rows = []
        for port in self.ports:
            for tc, c in port.counters.items():
                rows.append({"port": port.ifname, "tclass": tc, "pause_tx": c.xoff_tx,
                             "xon_tx": c.xon_tx, "pause_rx": c.frames_rx,
                             "paused_ns": round(self.timer.paused_ns(port.ifname, tc, now)),
                             "paused": int(self.timer.is_paused(port.ifname, tc, now)),
                             "storms": c.storms})
        return {"mode": "pfc", "node": self.node, "ports": rows}

    def run(self, life: Lifecycle) -> None:
        socks = {p.sock.fileno(): p for p in self.ports}
        next_poll = time.monotonic_ns()
        while not life.should_stop():
            now_wall = time.monotonic_ns()
            if self.is_switch and now_wall >= next_poll:
                next_poll = now_wall + int(self.poll())
            deadline = self.timer.next_deadline_ns()
            wait_wall = (next_poll - now_wall) if self.is_switch else MAX_POLL_WALL_NS
            if deadline is not None:
                wait_wall = min(wait_wall, self.dilation.to_wall_ns(
                    max(0.0, deadline - self.now_fabric_ns())))
            ready, _, _ = select.select(list(socks), [], [], max(0, wait_wall) / 1e9)
            for fd in ready:
                port = socks[fd]
                while True:
                    try:
                        data = port.sock.recv(2048)
                    except BlockingIOError:
                        break
                    self.on_frame(port, data)
            self.expire()

    def close(self) -> None:
        # Leave every gate open: a stopped agent must not leave the fabric paused.
        for (ifname, prio), paused in self.paused_state.items():
            if paused:
                try:
                    self.gate.set(self.by_name[ifname], prio, False)
                except Exception:   # best effort while stopping
                    pass
        self.gate.close()
        for port in self.ports:
            port.sock.close()
            port.kick.close()
            if port.maps is not None:
                port.maps.close()
        if self.events is not None:
            self.events.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.pfc", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--plan", required=True, help="the lab's plan.json")
    parser.add_argument("--node", required=True)
    parser.add_argument("--control-sock", help="serve counters (one JSON line) here")
    parser.add_argument("--events", help="append events (JSON lines) to this file")
    parser.add_argument("--watchdog-ns", type=int, default=0,
                        help="fabric ns paused before a class is declared stormed (0: off)")
    parser.add_argument("--no-parent-watch", action="store_true",
                        help="keep running when the starting process exits (testbed up)")
    parser.add_argument("--ready-file", help="touch once running")
    parser.add_argument("--rt-priority", type=int, default=10,
                        help="SCHED_FIFO priority (0: normal scheduling). A switch's PFC logic "
                             "must not queue behind busy senders on a 2-core VM: its reaction "
                             "time is headroom the buffer must hold. It sleeps in select() "
                             "between polls, so it cannot starve the machine.")
    args = parser.parse_args(argv)
    try:
        if args.rt_priority > 0:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_priority))
        else:
            os.nice(-10)
    except OSError:
        pass        # not root, or RT not allowed: normal priority (the run still works)
    life = Lifecycle(getppid=(lambda: 0) if args.no_parent_watch else os.getppid)
    life.install_signal_handlers()
    agent = Agent(args)
    server = SnapshotServer(args.control_sock, agent.snapshot) if args.control_sock else None
    if args.ready_file:
        Path(args.ready_file).touch()
    try:
        agent.run(life)
    finally:
        if server is not None:
            server.close()
        agent.close()
    print(json.dumps(agent.snapshot(), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
