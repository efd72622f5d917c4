"""`python -m agents.pfc`: the PFC agent of one node (switch or host), or of several.

Started inside the node's namespace with `nsenter --net` (not `ip netns
exec`, which remounts /sys and hides the pinned BPF maps). With `--group FILE`
one process serves several nodes: it enters each node's network namespace in
turn (setns) to open that node's sockets, keeps a separate Agent per node, and
serves them all from one loop (`Loop`; docs/pfc.md "One process, several
nodes"). For each node it

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
- (hosts, once told by a `drain` command) models the NIC's receive buffer
  of a class: it fills with what the switch port toward the host delivers
  (that port's departure counter, read from its pinned maps) and drains at
  the set rate; at XOFF the host pauses its switch, at XON it resumes;
- takes commands on --command-sock (one JSON line each way,
  agents.runtime.control): `pfc` (PFC off / on for a (port, class)), `rate`
  (a port's new rate: pause times, gate rate) and `drain` (the receive-buffer
  model), each logged as an `agent_command` event;
- serves per-(port, priority) counters on --control-sock and appends every
  XOFF/XON/pause/storm as a JSON line to --events.

All thresholds and times come from the plan in fabric units; the Dilation
converts. Hosts run the agent too: they obey pauses (their NIC class stops
and blocking sends push back on the application), and send PFC only from the
receive-buffer model. A frame that cannot be sent (the link is down:
ENETDOWN / ENXIO) is counted (`send_errors`) and the agent keeps going.
"""

from __future__ import annotations

import argparse
import ctypes  # setns (--group); agents.portmaps loads it anyway (bpf())
import functools
import json
import os
import select
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agents.pfc import gate as gates
from agents.pfc.logic import (
    INGRESS,
    RX_BUFFER,
    Action,
    PauseRequests,
    PauseTimer,
    RxBuffer,
    egress_reason,
)
from agents.portmaps import NODE_DIR, STATE_FIELDS, NodeMaps, PortMaps
from agents.runtime.control import (
    CommandInbox,
    CommandServer,
    SnapshotServer,
    command_refusals,
    serve_commands,
    serve_snapshots,
)
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.timebase import Dilation, machine_slowdown
from agents.wire import pfc as pfcwire

SOL_PACKET = 263             # not in Python's socket module
PACKET_QDISC_BYPASS = 20      # a PFC frame is a MAC control frame: it skips the port's queues
PIN_ROOT = Path("/sys/fs/bpf/tb")
RESCAN_WALL_NS = 20_000_000   # full rescan of the node's flags (a lost event, new contributors)
MAX_WAIT_WALL_NS = 20_000_000
# The receive-buffer model polls its arrivals counter no later than the earliest moment
# the level could cross a threshold (RxBuffer.next_poll_ns), and at least this often
# close to one: 0.25 us of fabric time keeps the XOFF within ~1 us of the crossing with
# room for the agent's own latency. The wall floor keeps a low dilation from spinning.
DRAIN_POLL_MIN_FABRIC_NS = 250
DRAIN_POLL_MIN_WALL_NS = 20_000
DRAIN_POLL_MAX_WALL_NS = 5_000_000
DEP_BYTES = STATE_FIELDS.index("dep_bytes")


@dataclass
class PortCounters:
    xoff_tx: int = 0
    xon_tx: int = 0
    frames_rx: int = 0
    storms: int = 0
    send_errors: int = 0      # frames of this class the port could not send (link down)
    gate_errors: int = 0      # gate changes the kernel refused


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
    peer_maps: PortMaps | None = None  # hosts: the switch port toward this NIC (arrivals)


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
            self.compile(port)
        self.netlink = gates.Requester()

    def compile(self, port: Port) -> None:
        """(Re)encode the port's gate messages from its rate and burst now."""
        for tc, cls in port.pfc_classes.items():
            major, minor = cls["classid"].split(":")
            leaf = int(cls["leaf_handle"].rstrip(":"), 16) << 16
            opened, closed = gates.tbf_messages(
                port.ifindex, leaf, (int(major, 16) << 16) | int(minor, 16),
                port.wall_rate_bps, port.burst_bytes, port.frame_bytes, cls["limit_bytes"])
            self.messages[(port.ifname, tc, False)] = opened
            self.messages[(port.ifname, tc, True)] = closed

    def set(self, port: Port, tc: int, paused: bool) -> None:
        self.netlink.request(self.messages[(port.ifname, tc, paused)])
        if not paused:
            # A closed TBF left its watchdog armed for when its slow rate would allow
            # the next packet, seconds away; changing the rate back does not reschedule
            # the port, and a sender blocked on its full queue enqueues nothing that
            # would. One frame through the port's qdisc (a PFC frame that enables no
            # priority: receivers ignore it) makes it dequeue at once.
            try:
                port.kick.send(pfcwire.encode(port.mac, {}))
            except OSError:     # link down: nothing to dequeue for until it is back
                port.counters[tc].send_errors += 1

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
        self.commands = 0
        self.rx_buffers: dict[tuple[str, int], RxBuffer] = {}     # hosts: (port, tc)
        self.overflow_bytes: dict[tuple[str, int], float] = {}   # kept after a model ends
        self.next_drain_poll: float | None = None                # fabric ns
        self.inbox = CommandInbox()
        #: the --command-sock server, once started (its refusals go into the snapshot)
        self.command_server: CommandServer | None = None
        #: the process's loop (it may serve other nodes too: --group)
        self.loop: Loop | None = None

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
            if not self.requests.enabled(port.ifname, prio):
                continue              # PFC off for this class here: counted, not obeyed
            pause_ns = quanta * pfcwire.quantum_ns(port.rate_bps)
            self.timer.on_frame(port.ifname, prio, pause_ns, now)
            self._apply(port, prio, now, quanta=quanta)

    def _apply(self, port: Port, prio: int, now: float, quanta: int | None = None) -> None:
        paused = self.timer.is_paused(port.ifname, prio, now)
        key = (port.ifname, prio)
        if self.paused_state.get(key, False) != paused:
            t0 = time.monotonic_ns()
            try:
                self.gate.set(port, prio, paused)
            except OSError as exc:
                # The kernel refused the change (the port is gone, or tc is busy): count
                # it and keep the old state, so a later change of the pause state tries again.
                port.counters[prio].gate_errors += 1
                self.log("pfc_gate_error", port.ifname, prio, paused=paused,
                         errno=exc.errno, error=str(exc))
                return
            self.paused_state[key] = paused
            # gate_us: the netlink change (and the kick on reopening), wall time
            self.log("pfc_paused" if paused else "pfc_resumed", port.ifname, prio,
                     peer_node=port.peer_node, peer_port=port.peer_port, quanta=quanta,
                     gate_us=round((time.monotonic_ns() - t0) / 1e3, 1),
                     rx_us_ago=(None if self.rx_mono is None else
                                round((t0 - self.rx_mono) / 1e3, 1)))

    # -- sending pauses ---------------------------------------------------------------
    def _send(self, action: Action, occupancy: float | None = None,
              crossed_mono_ns: int | None = None) -> None:
        port = self.by_name.get(action.ingress)
        if port is None or action.priority not in port.pfc_classes:
            return
        quanta = pfcwire.MAX_QUANTA if action.xoff else 0
        key = (port.ifname, action.priority, action.xoff)
        frame = self.frames.get(key)
        if frame is None:
            frame = self.frames[key] = pfcwire.encode(port.mac, {action.priority: quanta})
        c = port.counters[action.priority]
        try:
            port.sock.send(frame)
        except OSError as exc:
            # The link is down (ENETDOWN, ENXIO) or the socket has a pending error: the
            # frame is lost as on a dead wire. The pause state stays what was decided, so
            # the next refresh (or the peer's own pause timeout) settles it once it is up.
            c.send_errors += 1
            self.log("pfc_send_error", port.ifname, action.priority, xoff=action.xoff,
                     errno=exc.errno, error=os.strerror(exc.errno) if exc.errno else str(exc))
            return
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
                 occupancy_bytes=None if occupancy is None else round(occupancy),
                 reason=action.reason, crossed_ns_ago=crossed)

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

    # -- the host NIC's receive-buffer model ----------------------------------------
    def _arrived(self, port: Port, tc: int) -> int:
        """Bytes of class `tc` the switch port toward this NIC has delivered so far."""
        if port.peer_maps is None:
            pin = PIN_ROOT / self.lab / port.peer_node / port.peer_port
            if not (pin / "maps").exists():
                raise ValueError(f"no port program pinned at {pin}: arrivals cannot be "
                                 "counted")
            port.peer_maps = PortMaps(pin)
        return int(port.peer_maps.row(tc)[DEP_BYTES])

    def poll_rx_buffers(self) -> None:
        """Advance every receive-buffer model to now; XOFF / XON where a level crossed."""
        now = self.now_fabric_ns()
        for key, buf in list(self.rx_buffers.items()):
            port = self.by_name[key[0]]
            before_ns, before_level = buf.last_ns, buf.level_bytes
            change = buf.advance(self._arrived(port, key[1]), now)
            self.overflow_bytes[key] = buf.overflow_bytes
            if change is not None:
                self._rx_buffer_pause(port, key[1], buf, change, now, before_ns, before_level)
            if buf.finished:
                del self.rx_buffers[key]
                self.log("rx_buffer_off", port.ifname, key[1],
                         peak_bytes=round(buf.peak_bytes),
                         overflow_bytes=round(buf.overflow_bytes))
        self._plan_drain_poll(now)

    def _rx_buffer_pause(self, port: Port, tc: int, buf: RxBuffer, xoff: bool, now: float,
                         before_ns: float, before_level: float) -> None:
        crossed_mono = None
        if xoff and buf.level_bytes > before_level:
            # Where between the two polls the level passed XOFF (linear): the model's
            # share of the reaction time, as crossed_ns_ago is for a switch.
            frac = (buf.xoff_bytes - before_level) / (buf.level_bytes - before_level)
            crossed = before_ns + min(1.0, max(0.0, frac)) * (now - before_ns)
            crossed_mono = self.t0 + round(self.dilation.to_wall_ns(crossed))
        action = self.requests.set(port.ifname, tc, RX_BUFFER, xoff, now)
        if action:
            self._send(action, buf.level_bytes, crossed_mono)

    def _plan_drain_poll(self, now: float) -> None:
        if not self.rx_buffers:
            self.next_drain_poll = None
            return
        low = max(DRAIN_POLL_MIN_FABRIC_NS, self.dilation.to_fabric_ns(DRAIN_POLL_MIN_WALL_NS))
        high = max(low, self.dilation.to_fabric_ns(DRAIN_POLL_MAX_WALL_NS))
        self.next_drain_poll = min(buf.next_poll_ns(now, low, high)
                                   for buf in self.rx_buffers.values())

    # -- commands (--command-sock) ----------------------------------------------------
    def _port_class(self, request: dict, need_tc: bool = True) -> tuple[Port, int]:
        port = self.by_name.get(request.get("port"))  # type: ignore[arg-type]
        if port is None:
            raise ValueError(f"no port {request.get('port')!r} on {self.node} "
                             f"(ports: {', '.join(self.by_name)})")
        if not need_tc:
            return port, -1
        tc = request.get("tc")
        if not isinstance(tc, int) or tc not in port.pfc_classes:
            raise ValueError(f"{port.ifname} has no PFC class {tc!r} "
                             f"(PFC classes: {sorted(port.pfc_classes)})")
        return port, tc

    @staticmethod
    def _count(request: dict, key: str, *, optional: bool = False,
               positive: bool = False) -> int | None:
        value = request.get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or (
                positive and value <= 0):
            raise ValueError(f"{key} must be a {'positive' if positive else 'non-negative'} "
                             f"number, not {value!r}")
        return int(value)

    def command(self, request: dict) -> dict:
        """Apply one request (in the main loop's thread); the reply's fields."""
        op = request.get("op")
        handler = {"pfc": self._cmd_pfc, "rate": self._cmd_rate,
                   "drain": self._cmd_drain}.get(op)  # type: ignore[arg-type]
        if handler is None:
            raise ValueError(f"unknown op {op!r} (pfc, rate, drain)")
        reply = handler(request)          # each logs its agent_command event once applied
        self.commands += 1
        self.flush_log()
        return reply

    def _cmd_pfc(self, request: dict) -> dict:
        port, tc = self._port_class(request)
        enabled = request.get("enabled")
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be true or false, not {enabled!r}")
        now = self.now_fabric_ns()
        # Sending side: reasons stay tracked while off; the mask releases or restores.
        action = self.requests.set_enabled(port.ifname, tc, enabled, now)
        if action:
            self._send(action)
        if enabled and self.node_maps is not None:
            self.rescan(self.node_maps)       # re-read the maps: act on a pending decision
        # Receiving side: a class held paused by the peer reopens at once.
        if not enabled and self.timer.is_paused(port.ifname, tc, now):
            self.timer.on_frame(port.ifname, tc, 0, now)
            self._apply(port, tc, now)
        self.log("agent_command", port.ifname, tc, op="pfc", enabled=enabled)
        return {"enabled": enabled, "paused_tx": self.requests.paused(port.ifname, tc)}

    def _cmd_rate(self, request: dict) -> dict:
        port, _ = self._port_class(request, need_tc=False)
        rate = self._count(request, "rate_bps", positive=True)
        wall = self._count(request, "wall_rate_bps", positive=True)
        burst = self._count(request, "burst_bytes", optional=True, positive=True)
        assert rate is not None and wall is not None
        port.rate_bps, port.wall_rate_bps = rate, wall
        if burst is not None:
            port.burst_bytes = burst
        # Pause quanta convert at the new rate from now on (received frames and the
        # refresh period); pauses already running keep the time they were given.
        self.requests.refresh_ns[port.ifname] = (
            0.5 * pfcwire.MAX_QUANTA * pfcwire.quantum_ns(port.rate_bps))
        self.gate.compile(port)
        reopened = []
        for tc in port.pfc_classes:
            if not self.paused_state.get((port.ifname, tc), False):
                self.gate.set(port, tc, False)     # an open gate runs at the new rate now
                reopened.append(tc)
        for (ifname, _tc), buf in self.rx_buffers.items():
            if ifname == port.ifname:
                buf.line_rate_bps = rate
        self.log("agent_command", port.ifname, -1, op="rate", rate_bps=rate,
                 wall_rate_bps=wall, burst_bytes=port.burst_bytes, gates_set=reopened)
        return {"gates_set": reopened}

    def _cmd_drain(self, request: dict) -> dict:
        port, tc = self._port_class(request)
        if self.is_switch:
            raise ValueError("drain models a host NIC's receive buffer; this is a switch")
        rate = self._count(request, "rate_bps", optional=True)
        pfc = port.pfc_classes[tc]["pfc"] or {}
        xoff = self._count(request, "xoff_bytes", optional=True, positive=True)
        xon = self._count(request, "xon_bytes", optional=True)
        headroom = self._count(request, "headroom_bytes", optional=True)
        xoff = pfc.get("xoff_bytes", 0) if xoff is None else xoff
        xon = pfc.get("xon_bytes", 0) if xon is None else xon
        headroom = pfc.get("headroom_bytes", 0) if headroom is None else headroom
        if not xoff:
            raise ValueError("xoff_bytes needed (the class plan has none)")
        key = (port.ifname, tc)
        now = self.now_fabric_ns()
        arrived = self._arrived(port, tc)
        buf = self.rx_buffers.get(key)
        if buf is None and rate is None:            # line rate and empty: nothing to model
            self.log("agent_command", port.ifname, tc, op="drain", rate_bps=None,
                     xoff_bytes=xoff, xon_bytes=xon, headroom_bytes=headroom, model="off",
                     level_bytes=0)
            return {"model": "off", "level_bytes": 0}
        if buf is None:
            buf = self.rx_buffers[key] = RxBuffer.start(
                arrived, now, xoff, xon, headroom, rate, port.rate_bps)
            buf.empty_bytes = port.frame_bytes
            buf.overflow_bytes = self.overflow_bytes.get(key, 0.0)
        else:
            change = buf.set_rate(rate, arrived, now)
            buf.xoff_bytes, buf.xon_bytes = xoff, min(xon, xoff)
            buf.capacity_bytes = xoff + headroom
            if change is not None:
                self._rx_buffer_pause(port, tc, buf, change, now, now, buf.level_bytes)
        self.poll_rx_buffers()
        model = "on" if key in self.rx_buffers else "off"
        self.log("agent_command", port.ifname, tc, op="drain", rate_bps=rate,
                 xoff_bytes=xoff, xon_bytes=xon, headroom_bytes=headroom, model=model,
                 level_bytes=round(buf.level_bytes))
        return {"model": model, "level_bytes": round(buf.level_bytes)}

    def snapshot(self) -> dict:
        now = self.now_fabric_ns()
        rows = []
        for port in self.ports:
            for tc, c in port.counters.items():
                row = {"port": port.ifname, "tclass": tc, "pause_tx": c.xoff_tx,
                       "xon_tx": c.xon_tx, "pause_rx": c.frames_rx,
                       "paused_ns": round(self.timer.paused_ns(port.ifname, tc, now)),
                       "paused": int(self.timer.is_paused(port.ifname, tc, now)),
                       "storms": c.storms, "send_errors": c.send_errors,
                       "gate_errors": c.gate_errors,
                       "pfc_enabled": int(self.requests.enabled(port.ifname, tc))}
                if not self.is_switch:
                    buf = self.rx_buffers.get((port.ifname, tc))
                    row["rx_buffer_bytes"] = round(buf.level_bytes) if buf else 0
                    row["rx_buffer_overflow_bytes"] = round(
                        self.overflow_bytes.get((port.ifname, tc), 0.0))
                rows.append(row)
        return {"mode": "pfc", "node": self.node, "ports": rows, "wakeups": self.wakeups,
                "rescans": self.rescans, "commands": self.commands,
                "process_nodes": len(self.loop.agents) if self.loop else 1,
                "loop_busy_max_us": (round(self.loop.busy_max_wall_ns / 1e3, 1)
                                     if self.loop else 0.0),
                **command_refusals(self.command_server),
                "send_errors": sum(c.send_errors for p in self.ports
                                   for c in p.counters.values())}

    # -- the loop (serve(): one node, or several in one process) -----------------------
    def begin(self) -> None:
        """Read the node's maps once before the loop: the truth, not stale events."""
        if self.node_maps is not None:
            self.rescan(self.node_maps)
            self.node_maps.events()          # stale ones: the rescan read the truth

    def handlers(self) -> dict[int, Callable[[], object]]:
        """What to do when each of this node's descriptors is readable."""
        out: dict[int, Callable[[], object]] = {
            p.sock.fileno(): functools.partial(self.on_readable, p) for p in self.ports}
        out[self.inbox.fileno()] = lambda: self.inbox.run(self.command)
        if self.node_maps is not None:
            maps = self.node_maps
            out[maps.fileno()] = lambda: self.on_events(maps)
        return out

    def on_readable(self, port: Port) -> None:
        while True:
            try:
                data = port.sock.recv(2048)
            except BlockingIOError:
                break
            except OSError:
                # The link went down (the socket reports ENETDOWN once); the
                # binding stays and frames flow again once it is back up.
                break
            self.rx_mono = time.monotonic_ns()
            self.on_frame(port, data)
        self.rx_mono = None

    def wait_wall_ns(self) -> int:
        """Rescan if due; then how long (wall ns) this node may sleep."""
        now_wall = time.monotonic_ns()
        node_maps = self.node_maps           # switches with tracked classes only
        if node_maps is not None and now_wall >= self.next_rescan:
            # A slow machine (a TCG guest) rescans less often: at the same period a
            # rescan there takes the whole period, and the agent runs SCHED_FIFO.
            self.next_rescan = now_wall + int(RESCAN_WALL_NS * machine_slowdown())
            self.rescan(node_maps)
        wait_wall = MAX_WAIT_WALL_NS
        for deadline in (self.timer.next_deadline_ns(), self.requests.next_refresh_ns(),
                         self.next_drain_poll):
            if deadline is not None:
                wait_wall = min(wait_wall, int(self.dilation.to_wall_ns(
                    max(0.0, deadline - self.now_fabric_ns()))))
        if node_maps is not None:
            wait_wall = min(wait_wall, max(0, self.next_rescan - now_wall))
        return max(0, wait_wall)

    def tick(self) -> None:
        """After a wake-up: the receive-buffer models and the pause timers."""
        if self.next_drain_poll is not None and self.now_fabric_ns() >= self.next_drain_poll:
            self.poll_rx_buffers()
        self.expire()

    def close(self) -> None:
        # Leave every gate open: a stopped agent must not leave the fabric paused.
        for (ifname, prio), paused in self.paused_state.items():
            if paused:
                try:
                    self.gate.set(self.by_name[ifname], prio, False)
                except Exception:   # best effort while stopping
                    pass
        # A host that stops must not leave its switch paused either.
        for (ifname, tc), buf in self.rx_buffers.items():
            if buf.want_pause:
                try:
                    action = self.requests.set(ifname, tc, RX_BUFFER, False,
                                               self.now_fabric_ns())
                    if action:
                        self._send(action)
                except Exception:   # noqa: BLE001 - best effort while stopping
                    pass
        self.gate.close()
        self.inbox.close()
        for port in self.ports:
            port.sock.close()
            port.kick.close()
            for maps in (port.maps, port.peer_maps):
                if maps is not None:
                    maps.close()
        if self.node_maps is not None:
            self.node_maps.close()
        if self.events is not None:
            self.flush_log()
            self.events.close()


class Loop:
    """One process's event loop over the nodes it serves (one, or a group: --group).

    Every node keeps its own Agent (ports, pause state, timers, counters, sockets); the
    loop only multiplexes their descriptors. An epoll set holds them all (a group of
    nodes opens more than select()'s 1024), and the loop sleeps in select() on the
    epoll descriptor alone, because epoll_wait's timeout is whole milliseconds and the
    pause timers and receive-buffer polls need microseconds. The epoll descriptor is
    made before any node's sockets, so it stays below 1024.

    `busy_max_wall_ns` is the longest one wake-up took (handling every ready
    descriptor, then every node's timers, then the event logs): a node whose event
    arrived just after a wake-up began waits up to that long. Each node's snapshot
    carries it (`loop_busy_max_us`) with the number of nodes its process serves
    (`process_nodes`), so a process that serves too many nodes to keep up shows.
    """

    def __init__(self) -> None:
        self.poller = select.epoll()
        self.agents: list[Agent] = []
        self.busy_max_wall_ns = 0

    def add(self, agent: Agent) -> None:
        agent.loop = self
        self.agents.append(agent)

    def run(self, life: Lifecycle) -> None:
        handlers: dict[int, Callable[[], object]] = {}
        for agent in self.agents:
            handlers.update(agent.handlers())
            agent.begin()
        for fd in handlers:
            self.poller.register(fd, select.EPOLLIN)
        epoll_fd = [self.poller.fileno()]
        while not life.should_stop():
            wait_wall = min(a.wait_wall_ns() for a in self.agents)
            ready, _, _ = select.select(epoll_fd, [], [], wait_wall / 1e9)
            woke = time.monotonic_ns()
            if ready:
                for fd, _mask in self.poller.poll(0):
                    handlers[fd]()
            for agent in self.agents:
                agent.tick()
            # Events are written after every node's frames are out (a JSON line costs
            # tens of us, which would add to the next frame's reaction time).
            for agent in self.agents:
                agent.flush_log()
            self.busy_max_wall_ns = max(self.busy_max_wall_ns, time.monotonic_ns() - woke)

    def close(self) -> None:
        self.poller.close()


CLONE_NEWNET = 0x40000000


def enter_netns(path: str) -> None:
    """Move this thread into the network namespace at `path` (setns(2)): the sockets
    made from now on (AF_PACKET, netlink) belong to it, and interface names resolve
    there. The mount namespace is left alone: the pinned BPF maps stay visible."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def read_group(path: str) -> tuple[int, list[dict]]:
    """The --group file: (watchdog_ns, one entry per node). Each entry names the node,
    its plan file, its network namespace (a path) and its sockets, event file and
    ready file, as the one-node flags would (testbed/run/fabric_agents.py writes it)."""
    spec = json.loads(Path(path).read_text())
    nodes = spec.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValueError(f"{path}: `nodes` must be a non-empty list")
    need = ("node", "plan", "netns")
    for i, entry in enumerate(nodes):
        missing = [k for k in need if not isinstance(entry, dict) or not entry.get(k)]
        if missing:
            raise ValueError(f"{path}: nodes[{i}] lacks {', '.join(missing)}")
    names = [e["node"] for e in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a node is listed twice ({', '.join(names)})")
    return int(spec.get("watchdog_ns") or 0), nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.pfc", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--plan", help="the lab's plan.json (or the node's cut of it)")
    parser.add_argument("--node")
    parser.add_argument("--group",
                        help="serve several nodes from this process: a JSON file naming "
                             "each node, its plan, namespace, sockets and files (then "
                             "--plan, --node and the per-node flags are not used)")
    parser.add_argument("--control-sock", help="serve counters (one JSON line) here")
    parser.add_argument("--command-sock",
                        help="take commands here (pfc, rate, drain; one JSON line each way)")
    parser.add_argument("--events", help="append events (JSON lines) to this file")
    parser.add_argument("--ready-file", help="touch once running")
    parser.add_argument("--watchdog-ns", type=int, default=0,
                        help="fabric ns paused before a class is declared stormed (0: off)")
    parser.add_argument("--no-parent-watch", action="store_true",
                        help="keep running when the starting process exits (testbed up)")
    parser.add_argument("--rt-priority", type=int, default=10,
                        help="SCHED_FIFO priority (0: normal scheduling). A switch's PFC logic "
                             "must not queue behind busy senders on a 2-core VM: its reaction "
                             "time is headroom the buffer must hold. It sleeps in select() "
                             "between polls, so it cannot starve the machine.")
    args = parser.parse_args(argv)
    if args.group:
        watchdog, entries = read_group(args.group)
        nodes = [argparse.Namespace(
            plan=e["plan"], node=e["node"], netns=e["netns"], watchdog_ns=watchdog,
            control_sock=e.get("control_sock"), command_sock=e.get("command_sock"),
            events=e.get("events"), ready_file=e.get("ready_file")) for e in entries]
        # every node's ports, maps and map descriptors, its sockets and files
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    elif args.plan and args.node:
        args.netns = None
        nodes = [args]
    else:
        parser.error("--plan and --node (one node), or --group FILE")
    try:
        if args.rt_priority > 0:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_priority))
        else:
            os.nice(-10)
    except OSError:
        pass        # not root, or RT not allowed: normal priority (the run still works)
    life = Lifecycle(watch_parent=not args.no_parent_watch)
    life.install_signal_handlers()
    loop = Loop()
    servers: list[SnapshotServer | CommandServer | None] = []
    try:
        for node_args in nodes:
            if node_args.netns:
                enter_netns(node_args.netns)
            agent = Agent(node_args)
            loop.add(agent)
            servers.append(serve_snapshots(node_args.control_sock, agent.snapshot))
            agent.command_server = serve_commands(node_args.command_sock, agent.inbox.submit)
            servers.append(agent.command_server)
        for node_args in nodes:
            mark_ready(node_args.ready_file)
        loop.run(life)
    finally:
        for srv in servers:
            if srv is not None:
                srv.close()
        for agent in loop.agents:
            agent.close()
        loop.close()
    if not args.group:
        report_counters(loop.agents[0].snapshot())
    else:
        # One short line for the group (every node's counters are on its control socket
        # and in the run's store): the starter does not read this pipe while it waits.
        report_counters({"mode": "pfc_group", "nodes": [a.node for a in loop.agents],
                         "loop_busy_max_us": round(loop.busy_max_wall_ns / 1e3, 1),
                         "send_errors": sum(c.send_errors for a in loop.agents
                                            for p in a.ports for c in p.counters.values())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
