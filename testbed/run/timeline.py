"""The fault timeline of a run: a thread that applies each planned event at its time.

`Timeline` is the scheduler, with an injected clock and applier so its order,
lateness, convergence and stop are tested without a kernel: every EventPlan becomes
an "applied" step at t0 + at_ns, and (link events that carry the converged tables)
a "converged" step at t0 + at_ns + converge_ns; steps run in time order (a tie in
plan order, an event's applied step before its converged one). Each applied step is
recorded as a store event of kind "fault" with the event's facts and how late it was
(`late_ns`, fabric time after its due time; `took_ns`, fabric time applying it
took); a failure is a fidelity note naming the
event, and the timeline carries on with the next one.

`FabricApplier` is what a run applies them with: the kernel side in
testbed/net/events.py, and for pfc / rate (on PFC-gated ports) / host_drain a command
to the node's PFC agent (agents.runtime.control.send_command on the socket
testbed/run/fabric_agents.py passes it). It keeps each port's current egress and drop
probability, so successive events on one port compose. docs/timeline.md says what
each kind does in the kernel and what is recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agents.runtime import control
from agents.timebase import Dilation
from testbed.net import events as kernel
from testbed.plan.model import EgressPlan, EventPlan, Plan
from testbed.results.store import Store
from testbed.run.collector import Collector
from testbed.run.fabric_agents import has_pfc, pfc_command_socket

APPLIED, CONVERGED = "applied", "converged"


@dataclass(frozen=True)
class Step:
    due_ns: int             # fabric ns after t0
    order: int              # plan order, then applied before converged
    event: EventPlan
    phase: str              # APPLIED or CONVERGED


def steps_of(events: list[EventPlan]) -> list[Step]:
    """Every step of the timeline, in the order it runs."""
    out = []
    for i, ev in enumerate(events):
        out.append(Step(ev.at_ns, 2 * i, ev, APPLIED))
        if ev.routes is not None:
            out.append(Step(ev.at_ns + ev.converge_ns, 2 * i + 1, ev, CONVERGED))
    return sorted(out, key=lambda s: (s.due_ns, s.order))


# (event, phase) -> facts for the record; raises on failure
Applier = Callable[[EventPlan, str], dict]
# (step, ts_fabric_ns, mono_ns, late_ns, facts)
Recorder = Callable[[Step, int, int, int, dict], None]


class Timeline:
    """Applies `events` at t0_mono_ns + wall(at_ns) in its own thread (or in `run()`)."""

    def __init__(self, events: list[EventPlan], t0_mono_ns: int, timebase: Dilation,
                 apply: Applier, record: Recorder, note: Callable[[str], None], *,
                 clock: Callable[[], int] = time.monotonic_ns,
                 wait: Callable[[float], object] | None = None,
                 late_tolerance_ns: int | None = None) -> None:
        self.steps = steps_of(events)
        self.t0_mono_ns = t0_mono_ns
        self.timebase = timebase
        self.apply, self.record, self.note = apply, record, note
        self.clock = clock
        self.late_tolerance_ns = late_tolerance_ns
        self._stop = threading.Event()
        self.wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None
        self.done: list[Step] = []
        self.failed: list[Step] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="timeline", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop before the next step (one being applied finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        for step in self.steps:
            due_mono = self.t0_mono_ns + self.timebase.to_wall_ns(step.due_ns)
            while not self._stop.is_set():
                left = due_mono - self.clock()
                if left <= 0:
                    break
                self.wait(left / 1e9)
            if self._stop.is_set():
                return
            mono = self.clock()
            ts = round(self.timebase.to_fabric_ns(mono - self.t0_mono_ns))
            late = max(0, ts - step.due_ns)
            try:
                facts = self.apply(step.event, step.phase)
            except Exception as exc:   # noqa: BLE001 - a run carries on; the note says what
                self.failed.append(step)
                self.note(f"event {step.event.index} ({step.event.description}, at "
                          f"{step.event.at_ns / 1e3:g} us) could not be "
                          f"{'applied' if step.phase == APPLIED else 'converged'}: {exc}")
                continue
            took = round(self.timebase.to_fabric_ns(self.clock() - mono))
            self.done.append(step)
            self.record(step, ts, mono, late, {**facts, "took_ns": took})
            if self.late_tolerance_ns is not None and late > self.late_tolerance_ns:
                self.note(f"event {step.event.index} ({step.event.description}) was "
                          f"{'applied' if step.phase == APPLIED else 'converged'} "
                          f"{late / 1e3:.1f} us fabric after its time, more than a sample "
                          "period: the run's process did not wake in time (a loaded "
                          "machine); its counters show the change from then")


def store_recorder(store: Store) -> Recorder:
    """Each step as a "fault" event in the run's store (issue 12 contract, section 4;
    the fields are docs/run-format.md's, spelled out per shape so they can be read)."""

    def record(step: Step, ts: int, mono: int, late: int, facts: dict) -> None:
        ev = step.event
        first = ev.ports[0] if ev.ports else None
        node = first.node if first else ""
        port = first.ifname if first else ""
        tclass = first.tc if first and first.tc is not None else -1
        if step.phase == CONVERGED:
            store.add_event(ts, mono, "fault", node=node, port=port, tclass=tclass,
                            event_kind=ev.kind, target=ev.target, description=ev.description,
                            index=ev.index, at_ns=ev.at_ns, late_ns=late, took_ns=facts["took_ns"],
                            converge_ns=ev.converge_ns, phase=step.phase,
                            nodes=facts["nodes"], routes_deleted=facts["routes_deleted"],
                            routes_replaced=facts["routes_replaced"],
                            ip_drops=facts["ip_drops"],
                            ip_drop_packets=facts["ip_drop_packets"])
        elif ev.kind == "link_down":
            store.add_event(ts, mono, "fault", node=node, port=port, tclass=tclass,
                            event_kind=ev.kind, target=ev.target, description=ev.description,
                            index=ev.index, at_ns=ev.at_ns, late_ns=late, took_ns=facts["took_ns"],
                            converge_ns=ev.converge_ns, phase=step.phase,
                            changes=facts["changes"], lost=facts["lost"],
                            lost_packets=facts["lost_packets"], lost_bytes=facts["lost_bytes"])
        else:
            store.add_event(ts, mono, "fault", node=node, port=port, tclass=tclass,
                            event_kind=ev.kind, target=ev.target, description=ev.description,
                            index=ev.index, at_ns=ev.at_ns, late_ns=late, took_ns=facts["took_ns"],
                            converge_ns=ev.converge_ns, phase=step.phase,
                            changes=facts["changes"])
    return record


# --- applying events to a run's fabric ----------------------------------------------------

@dataclass
class _PortNow:
    egress: EgressPlan
    loss_probability: float


@dataclass
class FabricApplier:
    """Applies events to a built lab: the kernel (testbed/net/events.py) and the nodes'
    PFC agents (their command sockets under `agents_dir`)."""

    plan: Plan
    agents_dir: Path
    send: Callable[[str, dict], dict] | None = None
    # (ports, from fabric ns, to fabric ns or None): the run's invariant monitor is told
    # which ports are being taken down (InvariantMonitor.quiet_ports)
    quiet: Callable[[list[tuple[str, str]], int, int | None], None] | None = None
    fabric_now_ns: Callable[[], int] | None = None
    quiet_margin_ns: int = 0
    ports: dict[tuple[str, str], _PortNow] = field(default_factory=dict)
    _ip_drops_at: dict[int, dict[str, int]] = field(default_factory=dict)
    # per link-down event: what its ports' queues lost, and the black hole until converged
    _losses: dict[int, dict] = field(default_factory=dict)
    # (node, class) -> fabric ns a pfc event first turned PFC off at a port of it
    pfc_off: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node in self.plan.nodes:
            for iface in node.interfaces:
                self.ports[(node.name, iface.ifname)] = _PortNow(iface.egress,
                                                                 iface.loss_probability)
        self.agents = has_pfc(self.plan)

    def __call__(self, event: EventPlan, phase: str) -> dict:
        if phase == CONVERGED:
            return self._converge(event)
        handler = getattr(self, f"_{event.kind}", None)
        if handler is None:
            raise ValueError(f"unknown event kind {event.kind!r}")
        return handler(event)

    # -- link events --------------------------------------------------------------------
    def _ends(self, event: EventPlan) -> list[tuple[str, str]]:
        return [(p.node, p.ifname) for p in event.ports]

    def _link_down(self, event: EventPlan) -> dict:
        if event.routes is not None:
            self._ip_drops_at[event.index] = kernel.ip_drops(self.plan)
        ends = self._ends(event)
        # a sample that started one period before is judged with the ports' state after
        began = self.fabric_now_ns() - self.quiet_margin_ns if self.fabric_now_ns else 0
        if self.quiet is not None:
            self.quiet(ends, began, None)
        # While the link is down its ports drop everything, counted per flow (drop
        # probability 1), from the moment the down is applied until the link is back
        # (_link_up restores the ports' loss): a down port's qdisc is the kernel's noop
        # one, so a packet its program admitted would be freed uncounted (the link-flap
        # runs of the RoCE-vs-UET suite missed 94 and 10 packets of the streams across it).
        for n, i in ends:
            if self._has_program(n, i):
                kernel.set_port_params(self.plan, n, i, self.ports[(n, i)].egress, 1.0)
        try:
            lost = kernel.set_links(self.plan, ends, up=False)
        finally:
            if self.quiet is not None and self.fabric_now_ns is not None:
                self.quiet(ends, began, self.fabric_now_ns())
        ports: dict[tuple[str, str, int], int] = {}
        for x in lost:
            ports[(x.node, x.port, x.tclass)] = ports.get((x.node, x.port, x.tclass), 0) \
                + x.packets
        self._losses[event.index] = {
            "where": f"{event.description} at {event.at_ns / 1e3:g} us",
            "packets": sum(ports.values()), "ports": ports}
        facts: dict = {"changes": [{"port": f"{n}:{i}", "up": False} for n, i in ends],
                       "lost_packets": sum(x.packets for x in lost),
                       "lost_bytes": sum(x.bytes for x in lost),
                       "lost": [x.as_dict() for x in lost]}
        return facts

    def _link_up(self, event: EventPlan) -> dict:
        self._close_holes()
        if event.routes is not None:
            # until the routes come back, a node whose route the down deleted is a hole
            self._ip_drops_at[event.index] = kernel.ip_drops(self.plan)
        ends = self._ends(event)
        # Until both ends are up (and their carrier is), a port whose own end is up has
        # no working qdisc: what it admits would be freed uncounted. So while the link
        # comes up its ports keep dropping everything, counted per flow (drop
        # probability 1, set when it went down), as a link still training carries
        # nothing; then their drop probability is back.
        training = [(n, i) for n, i in ends if self._has_program(n, i)]
        for n, i in training:
            kernel.set_port_params(self.plan, n, i, self.ports[(n, i)].egress, 1.0)
        try:
            kernel.set_links(self.plan, ends, up=True)
        finally:
            for n, i in training:
                now = self.ports[(n, i)]
                kernel.set_port_params(self.plan, n, i, now.egress, now.loss_probability)
        return {"changes": [{"port": f"{n}:{i}", "up": True} for n, i in ends]}

    def _has_program(self, node: str, ifname: str) -> bool:
        return kernel.has_port_program(self.plan, node, ifname)

    def _converge(self, event: EventPlan) -> dict:
        assert event.routes is not None
        deleted = replaced = 0
        for node, routes in sorted(event.routes.items()):
            done = kernel.replace_routes(self.plan, node, routes)
            deleted += done["deleted"]
            replaced += done["replaced"]
        before = self._ip_drops_at.pop(event.index, {})
        after = kernel.ip_drops(self.plan)
        dropped = {n: after[n] - before.get(n, 0) for n in after if after[n] > before.get(n, 0)}
        if event.index in self._losses:
            self._losses[event.index]["packets"] += sum(dropped.values())
            if event.kind == "link_down":
                # the routes went around the link, or (no other way) away: what still
                # finds no route is the same hole, counted until the link comes up
                self._ip_drops_at[event.index] = after
        elif dropped:
            # a link_up's hole: packets lost until its routes came back
            self._losses[event.index] = {"where": f"{event.description} at "
                                                  f"{event.at_ns / 1e3:g} us",
                                         "packets": sum(dropped.values()), "ports": {}}
        return {"nodes": len(event.routes), "routes_deleted": deleted,
                "routes_replaced": replaced, "ip_drops": dropped,
                "ip_drop_packets": sum(dropped.values())}

    def _close_holes(self) -> None:
        """Count every link-down's hole up to now and stop counting it (a link comes
        up: from here on its own converge counts what finds no route)."""
        if not self._ip_drops_at:
            return
        now = kernel.ip_drops(self.plan)
        for index in [i for i in self._ip_drops_at if i in self._losses]:
            before = self._ip_drops_at.pop(index)
            self._losses[index]["packets"] += sum(max(0, now[n] - before.get(n, 0))
                                                  for n in now)

    def link_losses(self) -> list[dict]:
        """Per link-down so far: {"where", "packets", "ports"} (InvariantMonitor.finish).
        A link-down whose routes have not converged (yet, or ever) counts its black
        hole up to now (the lab must still be up)."""
        if self._ip_drops_at:
            now = kernel.ip_drops(self.plan)
            for index, before in self._ip_drops_at.items():
                if index in self._losses:
                    self._losses[index]["packets"] += sum(
                        max(0, now[n] - before.get(n, 0)) for n in now)
            self._ip_drops_at.clear()
        return [self._losses[i] for i in sorted(self._losses)]

    # -- port events --------------------------------------------------------------------
    def _loss(self, event: EventPlan) -> dict:
        out = []
        for p in event.ports:
            assert p.loss_probability is not None, "loss event without loss_probability"
            now = self.ports[(p.node, p.ifname)]
            kernel.set_port_params(self.plan, p.node, p.ifname, now.egress, p.loss_probability)
            out.append({"port": f"{p.node}:{p.ifname}", "from": now.loss_probability,
                        "to": p.loss_probability})
            now.loss_probability = p.loss_probability
        return {"changes": out}

    def _ecn(self, event: EventPlan) -> dict:
        out = []
        for p in event.ports:
            assert p.tc is not None and p.ecn is not None, "ecn event without tc / ecn"
            now = self.ports[(p.node, p.ifname)]
            classes = [c.model_copy(update={"ecn": p.ecn}) if c.tc == p.tc else c
                       for c in now.egress.classes]
            if not any(c.tc == p.tc for c in classes):
                raise kernel.EventError(f"{p.node}:{p.ifname} has no class {p.tc}")
            egress = now.egress.model_copy(update={"classes": classes})
            kernel.set_port_params(self.plan, p.node, p.ifname, egress, now.loss_probability)
            now.egress = egress
            out.append({"port": f"{p.node}:{p.ifname}", "tclass": p.tc,
                        **p.ecn.model_dump()})
        return {"changes": out}

    def _rate(self, event: EventPlan) -> dict:
        out = []
        for p in event.ports:
            assert p.egress is not None, "rate event without egress"
            now = self.ports[(p.node, p.ifname)]
            gated = self.agents and any(c.leaf_kind == "tbf" for c in p.egress.classes)
            kernel.set_port_rate(self.plan, p.node, p.ifname, p.egress, gates=not gated)
            if gated:
                self._command(p.node, {"op": "rate", "port": p.ifname,
                                       "rate_bps": p.egress.rate_bps,
                                       "wall_rate_bps": p.egress.wall_rate_bps,
                                       "burst_bytes": p.egress.burst_bytes})
            out.append({"port": f"{p.node}:{p.ifname}", "from_bps": now.egress.rate_bps,
                        "to_bps": p.egress.rate_bps, "gates_by_agent": gated})
            now.egress = p.egress
        return {"changes": out}

    def _pfc(self, event: EventPlan) -> dict:
        out = []
        for p in event.ports:
            reply = self._command(p.node, {"op": "pfc", "port": p.ifname, "tc": p.tc,
                                           "enabled": bool(p.pfc_enabled)})
            out.append({"port": f"{p.node}:{p.ifname}", "tclass": p.tc,
                        "enabled": bool(p.pfc_enabled), "agent": _reply_facts(reply)})
            if not p.pfc_enabled and p.tc is not None:
                now = self.fabric_now_ns() if self.fabric_now_ns else 0
                self.pfc_off.setdefault((p.node, p.tc), now)
        return {"changes": out}

    def _host_drain(self, event: EventPlan) -> dict:
        out = []
        for p in event.ports:
            reply = self._command(p.node, {
                "op": "drain", "port": p.ifname, "tc": p.tc, "rate_bps": p.drain_rate_bps,
                "wall_rate_bps": p.drain_wall_rate_bps, "xoff_bytes": p.xoff_bytes,
                "xon_bytes": p.xon_bytes})
            out.append({"port": f"{p.node}:{p.ifname}", "tclass": p.tc,
                        "drain_rate_bps": p.drain_rate_bps, "agent": _reply_facts(reply)})
        return {"changes": out}

    def _command(self, node: str, request: dict) -> dict:
        if not self.agents:
            raise kernel.EventError(f"no PFC agent runs on {node} (the fabric has no PFC "
                                    "class), so nothing can apply this")
        send = self.send or getattr(control, "send_command", None)
        if send is None:
            raise kernel.EventError("this build's agents take no commands "
                                    "(agents.runtime.control.send_command is missing)")
        path = pfc_command_socket(self.agents_dir, node, self.plan.lab)
        reply = send(path, request)
        if not reply.get("ok"):
            raise kernel.EventError(f"the PFC agent on {node} refused {request['op']}: "
                                    f"{reply.get('error', reply)}")
        return reply


def _reply_facts(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k != "ok"}


def start_timeline(plan: Plan, store: Store, agents_dir: Path, t0_mono_ns: int,
                   note: Callable[[str], None], collector: Collector | None = None
                   ) -> tuple[Timeline, FabricApplier] | None:
    """The run's timeline thread, started; None when the plan has no events. With the
    run's `collector`, its invariant monitor is told which ports a link-down empties."""
    if not plan.events:
        return None
    applier = FabricApplier(plan, agents_dir)
    if collector is not None:
        applier.quiet = collector.invariants.quiet_ports
        applier.fabric_now_ns = collector.fabric_now_ns
        applier.quiet_margin_ns = round(plan.timebase.to_fabric_ns(collector.period_wall_ns))
    timeline = Timeline(plan.events, t0_mono_ns, plan.timebase, applier,
                        store_recorder(store), note, late_tolerance_ns=applier.quiet_margin_ns
                        or None)
    timeline.start()
    return timeline, applier
