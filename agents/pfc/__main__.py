"""`python -m agents.pfc`: the PFC agent of one node (switch or host).

Started inside the node's namespace with `nsenter --net` (not `ip netns
exec`, which remounts /sys and hides the pinned BPF maps). It

- (switches) sleeps on the node's PFC event ring buffer: the port program
  accounts the buffer per (ingress port, priority) at every packet and posts
  an event when an ingress crosses its XOFF or XON threshold, or (static
  mode) when an egress queue reaches its own XOFF (egress protection: every
  ingress holding bytes in it is paused). The agent sends real 802.1Qbb
  frames out of those ingress ports at once: XOFF (65535 quanta, refreshed at
  half its lifetime while the reason lasts), XON (0) when no reason is left.
  The event only wakes it: the decision is re-read from the node's map, so a
  lost event (full ring) cannot leave a pause stuck, and a full rescan runs
  every RESCAN_WALL_NS;
- receives PFC frames on every port and pauses that port's egress class: its
  TBF gate closes (agents/pfc/gate.py: nothing leaves), until the pause expires
  or XON arrives;
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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from agents.pfc import gate as gates
from agents.pfc.logic import INGRESS, PauseRequests, PauseTimer, egress_reason
from agents.portmaps import NODE_DIR, NodeMaps, PortMaps
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.timebase import Dilation
from agents.wire import pfc as pfcwire

SOL_PACKET = 263             # not in Python's socket module
PACKET_QDISC_BYPASS = 20      # a PFC frame is a MAC control frame: it skips the port's queues
PIN_ROOT = Path("/sys/fs/bpf/tb")
RESCAN_WALL_NS = 20_000_000   # full rescan of the node's flags (a lost event, new contributors)
MAX_WAIT_WALL_NS = 20_000_000


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
    slot: int                          # ingress slot at this node (1..)
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


class Gate:
    """Open and close one egress class's TBF gate (agents/pfc/gate.py).

    The two tc requests of every (port, class) are encoded once, at start; a
    pause then costs one raw netlink write and its ack (~20 us of wall time)
    instead of pyroute2's ~1.5 ms per request, which at D = 2000 is most of a
    microsecond of fabric time.
    """

    def __init__(self, ports: list[Port]) -> None:
        self.messages: dict[tuple[str, int, bool], bytes] = {}
        for port in ports:
            for tc, cls in port.pfc_classes.items():
                major, minor = cls["classid"].split(":")
                leaf = int(cls["leaf_handle"].rstrip(":"), 16) << 16
                opened, closed = gates.tbf_messages(
                    port.ifindex, leaf, (int(major, 16) << 16) | int(minor, 16),
                    port.wall_rate_bps, port.burst_bytes, port.frame_bytes, cls["limit_bytes"])
                self.messages[(port.ifname, tc, False)] = opened
                self.messages[(port.ifname, tc, True)] = closed
        self.netlink = gates.Requester()

    def set(self, port: Port, tc: int, paused: bool) -> None:
        self.netlink.request(self.messages[(port.ifname, tc, paused)])
        if not paused:
            # A closed TBF left its watchdog armed for when its slow rate would allow
            # the next packet, seconds away; changing the rate back does not reschedule
            # the port, and a sender blocked on its full queue enqueues nothing that
            # would. One frame through the port's qdisc (a PFC frame that enables no
            # priority: receivers ignore it) makes it dequeue at once.
            port.kick.send(pfcwire.encode(port.mac, {}))

    def close(self) -> None:
        self.netlink.close()


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
    for slot, iface in enumerate(me["interfaces"], start=1):
        egress = iface["egress"]
        pfc_classes = {c["tc"]: c for c in egress["classes"] if c.get("pfc")}
        maps = None
        pin = PIN_ROOT / lab / node / iface["ifname"]
        if pin.exists():
            maps = PortMaps(pin)
        ports.append(Port(
            ifname=iface["ifname"], ifindex=socket.if_nametoindex(iface["ifname"]), slot=slot,
            mac=pfcwire.mac_bytes(iface["mac"]), peer_node=iface["peer"]["node"],
            peer_port=iface["peer"]["ifname"], rate_bps=egress["rate_bps"],
            wall_rate_bps=egress["wall_rate_bps"], burst_bytes=egress["burst_bytes"],
            frame_bytes=egress["quantum_bytes"],
            pfc_classes=pfc_classes, sock=_open_sock(iface["ifname"]),
            kick=_open_sock(iface["ifname"], bypass=False), maps=maps,
            counters={tc: PortCounters() for tc in pfc_classes}))
    return me, ports


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.plan = json.loads(Path(args.plan).read_text())
        self.node = args.node
        self.lab = self.plan["lab"]
        self.dilation = Dilation(self.plan["dilation"]["factor"])
        self.me, self.ports = load_ports(self.plan, self.node, self.lab)
        self.by_name = {p.ifname: p for p in self.ports}
        self.by_slot = {p.slot: p for p in self.ports}
        self.is_switch = self.me["role"] == "switch"
        self.t0 = time.monotonic_ns()
        # Events are written after the frames of a wake-up are out (a JSON line costs tens
        # of us, which would add to the next frame's reaction time).
        self.events = open(args.events, "a") if args.events else None
        self.frames: dict[tuple[str, int, bool], bytes] = {}
        self.gate = Gate(self.ports)
        watchdog = args.watchdog_ns if args.watchdog_ns else None
        self.timer = PauseTimer(watchdog_ns=watchdog)
        refresh = {p.ifname: 0.5 * pfcwire.MAX_QUANTA * pfcwire.quantum_ns(p.rate_bps)
                   for p in self.ports}
        self.requests = PauseRequests(refresh)
        self.tracked: list[int] = list(self.me.get("buffer", {}).get("tracked", []))
        self.node_maps: NodeMaps | None = None
        node_dir = PIN_ROOT / self.lab / self.node / NODE_DIR
        if self.is_switch and self.tracked and node_dir.exists():
            self.node_maps = NodeMaps(node_dir, events=True)
        self.hot: dict[tuple[int, int], bool] = {}       # (port slot, tc) -> egress protection
        self.paused_state: dict[tuple[str, int], bool] = {}
        self.events_lost_seen = 0
        self.pending: list[tuple[int, str, str, int, dict]] = []
        self.rx_mono: int | None = None       # when the frame being handled was read
        self.next_rescan = 0
        self.rescans = 0
        self.wakeups = 0

    def now_fabric_ns(self) -> float:
        return self.dilation.to_fabric_ns(time.monotonic_ns() - self.t0)

    def log(self, kind: str, port: str, tc: int, **detail: object) -> None:
        """Note an event now; it is written (JSON) by flush_log, after the loop's frames."""
        if self.events is not None:
            self.pending.append((time.monotonic_ns(), kind, port, tc, detail))

    def flush_log(self) -> None:
        if self.events is None or not self.pending:
            return
        self.events.write("".join(
            json.dumps({"mono_ns": mono, "kind": kind, "node": self.node, "port": port,
                        "tclass": tc, **detail}) + "\n"
            for mono, kind, port, tc, detail in self.pending))
        self.events.flush()
        self.pending.clear()

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
            t0 = time.monotonic_ns()
            self.gate.set(port, prio, paused)
            self.paused_state[key] = paused
            # gate_us: the netlink change (and the kick on reopening), wall time
            self.log("pfc_paused" if paused else "pfc_resumed", port.ifname, prio,
                     peer_node=port.peer_node, peer_port=port.peer_port, quanta=quanta,
                     gate_us=round((time.monotonic_ns() - t0) / 1e3, 1),
                     rx_us_ago=(None if self.rx_mono is None else
                                round((t0 - self.rx_mono) / 1e3, 1)))

    # -- sending pauses ---------------------------------------------------------------
    def _send(self, action, occupancy: int | None = None,
              crossed_mono_ns: int | None = None) -> None:
        port = self.by_name.get(action.ingress)
        if port is None or action.priority not in port.pfc_classes:
            return
        quanta = pfcwire.MAX_QUANTA if action.xoff else 0
        key = (port.ifname, action.priority, action.xoff)
        frame = self.frames.get(key)
        if frame is None:
            frame = self.frames[key] = pfcwire.encode(port.mac, {action.priority: quanta})
        port.sock.send(frame)
        c = port.counters[action.priority]
        if action.xoff:
            c.xoff_tx += 1
        else:
            c.xon_tx += 1
        # how long ago (fabric ns) the packet that crossed the threshold passed the port
        # program: the agent's share of the reaction time (bench/pfc.py)
        crossed = (None if crossed_mono_ns is None else
                   self.dilation.to_fabric_ns(max(0, time.monotonic_ns() - crossed_mono_ns)))
        self.log("pfc_xoff" if action.xoff else "pfc_xon", port.ifname, action.priority,
                 peer_node=port.peer_node, peer_port=port.peer_port, quanta=quanta,
                 occupancy_bytes=occupancy, reason=action.reason, crossed_ns_ago=crossed)

    def _ingress_flag(self, tc: int, slot: int, now: float, crossed: int | None) -> None:
        """Make the "ingress" reason of (slot, tc) what the node's map says."""
        port = self.by_slot.get(slot)
        if port is None or self.node_maps is None:
            return
        acct = self.node_maps.acct(self.tracked.index(tc), slot)
        action = self.requests.set(port.ifname, tc, INGRESS, acct.want_pause, now)
        if action:
            self._send(action, acct.bytes + acct.hdrm_bytes, crossed)

    def _egress_flag(self, tc: int, port_slot: int, now: float, crossed: int | None) -> None:
        """Static mode: pause every ingress holding bytes in a hot egress queue."""
        port = self.by_slot.get(port_slot)
        if port is None or port.maps is None:
            return
        hot = port.maps.hot(tc)
        holders: set[str] = set()
        if hot:
            queued = port.maps.ingress_queued(self.tracked.index(tc))
            holders = {self.by_slot[s].ifname for s in queued if s in self.by_slot}
        self.hot[(port_slot, tc)] = hot
        for action in self.requests.replace(egress_reason(port.ifname), tc, holders, now):
            self._send(action, port.maps.vq_bytes(tc), crossed)

    def on_events(self, node_maps: NodeMaps) -> None:
        """Wake-up by the ring buffer: re-read what each event names, act on it; rescan
        when the ring overflowed (events were lost)."""
        self.wakeups += 1
        now = self.now_fabric_ns()
        for ev in node_maps.events():
            if ev.tc not in self.tracked:
                continue
            if ev.kind in ("xoff", "xon"):
                self._ingress_flag(ev.tc, ev.slot, now, ev.ts_ns)
            elif ev.kind in ("egress_hot", "egress_cool"):
                self._egress_flag(ev.tc, ev.port_slot, now, ev.ts_ns)
            elif ev.kind == "drop":
                port = self.by_slot.get(ev.port_slot)
                self.log("lossless_drop", port.ifname if port else "", ev.tc,
                         ingress=self.by_slot[ev.slot].ifname if ev.slot in self.by_slot
                         else "local", occupancy_bytes=ev.bytes)
        if node_maps.head().events_lost != self.events_lost_seen:
            self.rescan(node_maps)

    def rescan(self, node_maps: NodeMaps) -> None:
        """Every tracked (slot, class) and hot egress queue, from the maps: catches a lost
        event, and new contributors to a queue under egress protection."""
        self.rescans += 1
        now = self.now_fabric_ns()
        head = node_maps.head()
        self.events_lost_seen = head.events_lost
        for tc in self.tracked:
            for port in self.ports:
                self._ingress_flag(tc, port.slot, now, None)
                if port.maps is not None and (port.maps.hot(tc) or self.hot.get((port.slot, tc))):
                    self._egress_flag(tc, port.slot, now, None)

    def expire(self) -> None:
        now = self.now_fabric_ns()
        for port_name, prio, what in self.timer.expire(now):
            port = self.by_name[port_name]
            if what == "storm":
                port.counters[prio].storms += 1
                self.log("pfc_storm", port_name, prio, peer_node=port.peer_node,
                         peer_port=port.peer_port)
            self._apply(port, prio, now)
        for action in self.requests.refresh(now):
            self._send(action)

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
        return {"mode": "pfc", "node": self.node, "ports": rows, "wakeups": self.wakeups,
                "rescans": self.rescans}

    def run(self, life: Lifecycle) -> None:
        ports: dict[int, Port] = {p.sock.fileno(): p for p in self.ports}
        fds = list(ports)
        node_maps = self.node_maps           # switches with tracked classes only
        ring_fd = None
        if node_maps is not None:
            ring_fd = node_maps.fileno()
            fds.append(ring_fd)
            self.rescan(node_maps)
            node_maps.events()               # stale ones: the rescan read the truth
        while not life.should_stop():
            now_wall = time.monotonic_ns()
            if node_maps is not None and now_wall >= self.next_rescan:
                self.next_rescan = now_wall + RESCAN_WALL_NS
                self.rescan(node_maps)
            wait_wall = MAX_WAIT_WALL_NS
            for deadline in (self.timer.next_deadline_ns(), self.requests.next_refresh_ns()):
                if deadline is not None:
                    wait_wall = min(wait_wall, self.dilation.to_wall_ns(
                        max(0.0, deadline - self.now_fabric_ns())))
            if node_maps is not None:
                wait_wall = min(wait_wall, max(0, self.next_rescan - now_wall))
            ready, _, _ = select.select(fds, [], [], max(0, wait_wall) / 1e9)
            for fd in ready:
                if node_maps is not None and fd == ring_fd:
                    self.on_events(node_maps)
                    continue
                port = ports[fd]
                while True:
                    try:
                        data = port.sock.recv(2048)
                    except BlockingIOError:
                        break
                    self.rx_mono = time.monotonic_ns()
                    self.on_frame(port, data)
                self.rx_mono = None
            self.expire()
            self.flush_log()

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
        if self.node_maps is not None:
            self.node_maps.close()
        if self.events is not None:
            self.flush_log()
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
    life = Lifecycle(watch_parent=not args.no_parent_watch)
    life.install_signal_handlers()
    agent = Agent(args)
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
    sys.exit(main())
