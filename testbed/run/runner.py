"""One run: up -> agents -> workload -> sample -> stop -> down -> summary -> report.

Ctrl-C or SIGTERM at any point stops cleanly: agents are stopped, the fabric
goes down, what was sampled is kept and the report is written from it, marked
interrupted. Samples go to the store as they are taken, so even a SIGKILL
leaves a database that `testbed report` can read (and `testbed down --all`
cleans the fabric).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agents.timebase import Dilation
from testbed.config import LoadedConfig
from testbed.net import apply_plan, destroy_lab
from testbed.net.counters import QueueProbe, datapath_snapshot, udp_errors
from testbed.net.probe import probe_report
from testbed.net.state import LabState
from testbed.plan.model import Plan
from testbed.run.accounts import stream_accounts
from testbed.run.capture import start_captures, stop_captures
from testbed.run.collector import AgentEndpoint, Collector, LiveTotals, agent_read_notes
from testbed.run.fabric_agents import has_pfc, start_pfc_agents
from testbed.run.fidelity import base_rtt_shortfall_ns
from testbed.run.procs import AgentProcess, socket_path, start_agent
from testbed.run.rundir import create_run_dir, machine_metadata, write_json, write_private
from testbed.run.store import Store
from testbed.run.summary import DROP_COUNTERS, build_summary
from testbed.run.workload import (
    DEFAULT_DRAIN_WALL_NS,
    DEFAULT_SAMPLE_PERIOD_WALL_NS,
    WIRE_OVERHEAD_BYTES,
    AgentSpec,
    expand_workload,
    workload_span_ns,
)
from testbed.units import format_size

# Wall time allowed for agents to start before the common start time t0.
STARTUP_BASE_S = 0.8
STARTUP_PER_AGENT_S = 0.03
# A RoCE client imports numpy, connects, and both sides build their data patterns
# before the start time: about 0.25 s of CPU each, on a VM of two cores.
ROCE_STARTUP_PER_CLIENT_S = 0.25
# Wall seconds to wait for every RoCE server to listen before the clients start.
ROCE_SERVER_READY_S = 20.0
# A client set up later than this after its start time is reported (wall ns).
ROCE_LATE_TOLERANCE_NS = 20_000_000


@dataclass
class RunOptions:
    runs_root: Path = Path("runs")
    capture: bool = False
    capture_snaplen: int = 0        # bytes kept per frame; 0: whole frames
    keep_up: bool = False
    budget_bps: int | None = None
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    say: Callable[[str], None] = print
    on_sample: Callable[[str, LiveTotals, float], None] | None = None
    # called with the plan once the fabric and its PFC agents are up, before any traffic
    # (tests use it to break something on purpose and see the run say so)
    on_up: Callable[[Plan], None] | None = None


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    interrupted: bool
    collector_overhead: float


class _Interrupt:
    """SIGINT/SIGTERM set a flag; the run finishes its clean-up instead of dying."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name = ""
        self._old: dict[int, object] = {}

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def run_config(loaded: LoadedConfig, plan: Plan, options: RunOptions) -> RunResult:
    say = options.say
    dilation = Dilation(plan.dilation.factor)
    fabric = loaded.fabric
    run_dir = create_run_dir(options.runs_root, fabric.name)
    (run_dir / "agents").mkdir(mode=0o700)
    write_private(run_dir / "config.yaml", loaded.text)
    write_private(run_dir / "plan.json", plan.to_json())
    probe = probe_report()
    write_json(run_dir / "metadata.json", machine_metadata(
        probe, plan.dilation.factor, plan.dilation.max_wall_port_rate_bps, options.argv))
    store = Store(run_dir / "counters.sqlite", create=True)
    store.set_meta("lab", plan.lab)
    store.set_meta("dilation", str(plan.dilation.factor))

    workload = fabric.workload
    period_ns = (workload.sample_period_ns if workload and workload.sample_period_ns
                 else round(dilation.to_fabric_ns(DEFAULT_SAMPLE_PERIOD_WALL_NS)))
    drain_ns = (workload.drain_ns if workload and workload.drain_ns
                else round(dilation.to_fabric_ns(DEFAULT_DRAIN_WALL_NS)))
    store.set_meta("sample_period_fabric_ns", str(period_ns))
    specs = expand_workload(fabric, plan)
    span_ns = workload_span_ns(fabric, plan)

    fidelity: list[str] = list(plan.warnings)
    missing = set(probe.get("missing", []))
    if "netem" in missing:
        short_ns = base_rtt_shortfall_ns(plan)
        fidelity.append(
            f"sch_netem is missing in kernel {probe.get('kernel')}: link propagation and FEC "
            f"delay are not emulated, so the longest host-to-host base RTT is short by "
            f"{short_ns / 1e3:.2f} us fabric; PHY frame loss is applied by the BPF port "
            "program instead")

    # Known before anything runs: recorded at once, so a killed run keeps them.
    for note in fidelity:
        store.add_event(0, time.monotonic_ns(), "fidelity", message=note)

    interrupted = False
    collector: Collector | None = None
    agents: list[tuple[AgentSpec, AgentProcess]] = []
    captures: list[AgentProcess] = []
    fabric_procs: list[AgentProcess] = []
    t_start = time.monotonic()
    t0 = time.monotonic_ns()
    t0_realtime_ns = time.time_ns()
    results_written = False
    udp_start: dict[str, dict[str, int]] = {}
    invariants: dict | None = None
    with _Interrupt() as stop:
        try:
            store.add_event(0, time.monotonic_ns(), "phase", phase="up")
            report = apply_plan(plan, progress=lambda m: say(f"up: {m}"))
            state = LabState.load(plan.lab)
            if state is not None:
                state.run_dir = str(run_dir)
                state.save()
            say(f"up: lab {plan.lab!r} in {sum(report.seconds.values()):.2f}s, "
                f"D={plan.dilation.factor}")
            udp_start = udp_errors(plan)
            if report.ordering.startswith("none"):
                fidelity.append(f"flows are not steered to one CPU per port "
                                f"({report.ordering[6:]}): a flow's packets can be reordered "
                                "crossing the fabric when the CPUs are busy (docs/datapath.md, "
                                "Ordering)")
            if report.datapath.startswith("none"):
                fidelity.append(f"no port programs ({report.datapath[6:]}): no ECN marking, "
                                "no queue accounting, no PFC, no PHY loss")
            if options.capture:
                captures = start_captures(plan, run_dir, options.capture_snaplen)
            fabric_endpoints: list[AgentEndpoint] = []
            if has_pfc(plan):
                if _has_port_programs(plan):
                    started = start_pfc_agents(plan, run_dir / "plan.json", run_dir / "agents")
                    fabric_procs.extend(p for p, _ in started)
                    fabric_endpoints = [e for _, e in started]
                    say(f"pfc: agents on {len(started)} nodes")
                else:
                    fidelity.append("PFC is configured but the port programs are not "
                                    "attached (no BPF datapath), so no PFC agent runs and "
                                    "lossless classes can drop")

            if options.on_up is not None:
                options.on_up(plan)
            endpoints = []

            def start(spec: AgentSpec, t0: int | None = None) -> None:
                argv = list(spec.argv)
                sock = socket_path(run_dir / "agents", spec.name, plan.lab)
                argv += ["--control-sock", sock]
                if _is_roce(spec):       # its final JSON stays in the run directory
                    argv += ["--ready-file", str(_ready_file(run_dir, spec)),
                             "--out", str(run_dir / "agents" / f"{spec.name}.json")]
                if t0 is not None:
                    argv += ["--start-at-mono-ns",
                             str(t0 + dilation.to_wall_ns(spec.start_ns))]
                proc = start_agent(plan.lab, plan.node(spec.node).netns, spec.module, argv,
                                   spec.name)
                agents.append((spec, proc))
                endpoints.append(AgentEndpoint(spec.name, spec.node, sock))

            # Receivers first; RoCE servers must listen before their clients set up.
            for spec in specs:
                if spec.role != "sender":
                    start(spec)
            fidelity += _wait_ready(run_dir, agents, stop.event)
            startup_s = STARTUP_BASE_S + sum(
                ROCE_STARTUP_PER_CLIENT_S if _is_roce(s) and s.role == "sender"
                else STARTUP_PER_AGENT_S for s in specs)
            t0 = time.monotonic_ns() + int(startup_s * 1e9)
            t0_realtime_ns = time.time_ns() + (t0 - time.monotonic_ns())
            for spec in specs:
                if spec.role == "sender" and not stop.event.is_set():
                    start(spec, t0)
            collector = Collector(plan, store, dilation.to_wall_ns(period_ns), t0,
                                  fabric_endpoints + endpoints)
            if options.on_sample is not None:
                collector.on_sample = lambda totals: options.on_sample(
                    phase, totals, time.monotonic() - t_start)
            phase = "workload"
            store.add_event(collector.fabric_now_ns(), time.monotonic_ns(), "phase",
                            phase="workload", agents=len(specs))
            collector.start()

            senders = [p for s, p in agents if s.role == "sender"]
            end_wall = t0 + dilation.to_wall_ns(span_ns)
            # Senders stop by themselves; wait for them (plus slack), or an interrupt.
            while not stop.event.is_set():
                if senders and all(p.popen.poll() is not None for p in senders):
                    break
                if not senders and time.monotonic_ns() >= end_wall:
                    break
                if time.monotonic_ns() > end_wall + 30e9:
                    fidelity.append("senders did not finish 30 s of wall time after their "
                                    "scheduled end; they were stopped")
                    break
                stop.event.wait(0.05)
            if not stop.event.is_set():
                phase = "drain"
                store.add_event(collector.fabric_now_ns(), time.monotonic_ns(), "phase",
                                phase="drain")
                drain_end = time.monotonic_ns() + dilation.to_wall_ns(drain_ns)
                while time.monotonic_ns() < drain_end and not stop.event.is_set():
                    stop.event.wait(0.05)
                # Receivers stop only once the fabric is empty: a datagram that arrives
                # after its receiver closed would be lost to the measurement, not the fabric.
                fidelity += _drain_fabric(plan, stop.event, dilation, drain_ns)
        except BaseException as exc:
            fidelity.append(f"run failed: {exc!r}")
            say(f"run: failed: {exc}")
            if not isinstance(exc, Exception):
                raise
        finally:
            interrupted = stop.event.is_set()
            if interrupted:
                say(f"run: interrupted by {stop.signal_name}; stopping agents, taking the "
                    "fabric down, writing the report")
                store.add_event(collector.fabric_now_ns() if collector else 0,
                                time.monotonic_ns(), "interrupted", signal=stop.signal_name)
            results = {}
            for spec, proc in agents:
                proc.stop()
                try:
                    results[spec.name] = proc.result(timeout_s=5)
                except RuntimeError as exc:
                    fidelity.append(f"agent {spec.name} on {spec.node}: {exc}")
            fidelity += stop_captures(captures, run_dir)
            for proc in fabric_procs:
                proc.stop()
            if collector is not None:
                collector.stop()
            try:
                _write_results(store, plan, agents, results, dilation)
                results_written = True
                paused = {n for (n, _p, _t), v in store.last_values("pause_rx").items() if v}
                fidelity += _agent_fidelity(plan, agents, results, dilation, paused)
                drops = sum(v for counter in DROP_COUNTERS
                            for (_n, _p, tc), v in store.last_values(counter).items()
                            if tc in _lossless_tcs(plan))
                fidelity += _roce_fidelity(run_dir, agents, results, dilation,
                                           t0_realtime_ns, lossless_drops=drops)
            except Exception as exc:   # results are best effort on an interrupted run
                fidelity.append(f"could not collect agent results: {exc!r}")
            if collector is not None:
                try:
                    invariants = _check_invariants(run_dir, plan, store, collector, agents,
                                                   results, udp_start)
                    fidelity += invariants["notes"]
                except Exception as exc:   # the run's data is kept; say why it is unchecked
                    fidelity.append(f"could not check the run's invariants: {exc!r}")
                fidelity += collector.watchdog.notes(plan.dilation.factor)
                fidelity += collector.late_notes()
                fidelity += agent_read_notes(collector.agents)
            if not options.keep_up:
                removed = destroy_lab(plan.lab)
                say(f"down: removed {len(removed)} namespaces")
            store.add_event(collector.fabric_now_ns() if collector else 0, time.monotonic_ns(),
                            "phase", phase="down")

    known = len(plan.warnings) + (1 if "netem" in missing else 0)
    for note in fidelity[known:]:
        store.add_event(collector.fabric_now_ns() if collector else 0, time.monotonic_ns(),
                        "fidelity", message=note)
    duration_wall = time.monotonic() - t_start
    duration_fabric = collector.fabric_now_ns() if collector else 0
    overhead = collector.overhead_fraction() if collector else 0.0
    summary = build_summary(
        name=fabric.name, plan=plan, store=store, run_dir=str(run_dir),
        duration_fabric_ns=max(0, duration_fabric), duration_wall_s=duration_wall,
        interrupted=interrupted, fidelity=fidelity,
        extra={"collector": {"samples": collector.totals.samples if collector else 0,
                             "period_fabric_ns": period_ns,
                             "cpu_fraction_of_one_core": round(overhead, 4)},
               "results_complete": results_written,
               **({"invariants": {k: v for k, v in invariants.items() if k != "notes"}}
                  if invariants else {})})
    write_json(run_dir / "summary.json", summary)
    store.close()
    _build_report(run_dir, say)
    return RunResult(run_dir, summary, interrupted, overhead)


# A drain that outlasts this many times the configured drain (and DRAIN_CAP_WALL_S) gives up.
DRAIN_CAP_FACTOR = 20
DRAIN_CAP_WALL_S = 30.0


def _drain_fabric(plan: Plan, stop: threading.Event, dilation: Dilation,
                  drain_ns: int) -> list[str]:
    """Wait until no port program holds a queued byte; a note if that never happened."""
    if not _has_port_programs(plan):
        return []
    probe = QueueProbe(plan)
    try:
        start = time.monotonic()
        cap_s = min(DRAIN_CAP_WALL_S, DRAIN_CAP_FACTOR * dilation.to_wall_s(drain_ns))
        while not stop.is_set():
            left = probe.queued_bytes()
            if left == 0:
                return []
            if time.monotonic() - start > cap_s:
                return [f"the fabric still held {format_size(left)} "
                        f"{dilation.to_fabric_ns(cap_s * 1e9) / 1e3:.0f} us fabric after the "
                        "drain; the receivers were stopped anyway (a stuck pause?)"]
            stop.wait(0.02)
        return []
    finally:
        probe.close()


def _check_invariants(run_dir: Path, plan: Plan, store: Store, collector: Collector, agents,
                      results: dict, udp_start: dict[str, dict[str, int]]) -> dict:
    """Read the port programs' final counters (kept in datapath.json), account every
    stream, and judge the run's invariants (testbed/run/invariants.py)."""
    snapshot = datapath_snapshot(plan) if _has_port_programs(plan) else None
    if snapshot is not None:
        write_json(run_dir / "datapath.json", snapshot)
    udp_end = udp_errors(plan)
    host_errors = {h: sum(v.get(k, 0) - udp_start.get(h, {}).get(k, 0)
                          for k in ("RcvbufErrors", "NoPorts"))
                   for h, v in udp_end.items()}
    streams = stream_accounts(plan, agents, results,
                              snapshot["flow_drops"] if snapshot else [])
    last = {name: store.last_values(name) for name in
            ("class_drops", "class_packets", "backlog_packets", "tx_dropped")}
    out = collector.invariants.finish(snapshot, last, streams, host_errors)
    out["streams"] = streams
    out["host_socket_drops"] = {h: n for h, n in host_errors.items() if n}
    return out


def _has_port_programs(plan: Plan) -> bool:
    from testbed.net.portprog import pin_dir_of

    node = plan.nodes[0]
    return bool(node.interfaces) and pin_dir_of(plan.lab, node.name,
                                                node.interfaces[0].ifname).exists()


def _write_results(store: Store, plan: Plan, agents, results: dict, dilation: Dilation) -> None:
    _write_roce_results(store, [(s, p) for s, p in agents if _is_roce(s)],
                        results)
    agents = [(s, p) for s, p in agents if not _is_roce(s)]
    by_ip = {n.interfaces[0].address.split("/")[0]: n.name for n in plan.hosts()}
    received: dict[tuple[str, str, str], list[int]] = {}   # (traffic, src, dst) -> [pk, bytes]
    window_ns: dict[tuple[str, str], float] = {}            # (traffic, dst) -> fabric ns
    for spec, _ in agents:
        res = results.get(spec.name)
        if spec.role != "receiver" or res is None:
            continue
        if res.get("start_wall_ns") and res.get("end_wall_ns"):
            window_ns[(spec.traffic, spec.dst)] = dilation.to_fabric_ns(
                res["end_wall_ns"] - res["start_wall_ns"])
        for key, flow in res.get("flows", {}).items():
            src = by_ip.get(key.split(":")[0], key.split(":")[0])
            entry = received.setdefault((spec.traffic, src, spec.dst), [0, 0])
            entry[0] += flow.get("received", 0)
            entry[1] += flow.get("bytes", 0)
    for spec, _ in agents:
        if spec.role != "sender":
            continue
        sent = results.get(spec.name, {})
        rx_packets, rx_bytes = received.get((spec.traffic, spec.src, spec.dst), [0, 0])
        tx_packets = sent.get("packets", 0)
        # A stream's received rate is over its receiver's whole active window
        # (first to last arrival of any stream), so the streams into one
        # receiver add up to what that receiver got.
        window = window_ns.get((spec.traffic, spec.dst), 0)
        rx_wire_bits = (rx_bytes + rx_packets * WIRE_OVERHEAD_BYTES) * 8
        store.add_result(spec.traffic, spec.kind, {
            "src": spec.src, "dst": spec.dst,
            "tx_packets": tx_packets, "tx_bytes": sent.get("bytes", 0),
            "rx_packets": rx_packets, "rx_bytes": rx_bytes,
            "lost": max(0, tx_packets - rx_packets),
            "set_fabric_bps": sent.get("set_fabric_bps", 0),
            "tx_fabric_bps": round(sent.get("fabric_bps", 0)),
            "rx_fabric_bps": round(rx_wire_bits / window * 1e9) if window else 0,
        })


def _agent_fidelity(plan: Plan, agents, results: dict, dilation: Dilation,
                    paused_nodes: set[str] = frozenset()) -> list[str]:
    # A host asked to send more than its NIC's line rate is held back by its
    # own queue (blocking sends): falling behind schedule is then the fabric
    # pushing back, not the CPU failing to keep up.
    offered: dict[str, float] = {}
    for spec, _ in agents:
        if spec.role == "sender":
            offered[spec.src] = offered.get(spec.src, 0) + results.get(spec.name, {}).get(
                "set_fabric_bps", 0)
    notes = []
    for spec, _ in agents:
        res = results.get(spec.name, {})
        forgiven = res.get("forgiven_ns", 0)
        # Offered above line rate, or paused by PFC: held back on purpose.
        oversubscribed = (spec.role == "sender" and (
            offered.get(spec.src, 0) > plan.node(spec.src).interfaces[0].egress.rate_bps
            or spec.src in paused_nodes))
        if spec.role == "sender" and forgiven and not oversubscribed:
            late_us = dilation.to_fabric_ns(res.get("max_late_ns", 0)) / 1e3
            notes.append(f"sender {spec.name} fell behind its schedule and skipped "
                         f"{dilation.to_fabric_ns(forgiven) / 1e3:.1f} us fabric of sending "
                         f"(max lateness {late_us:.1f} us fabric): the host CPU did not keep up")
        if res.get("socket_drops"):
            notes.append(f"receiver {spec.name} dropped {res['socket_drops']} packets in its own "
                         "socket buffer (it fell behind, not the fabric)")
    return notes


def _is_roce(spec: AgentSpec) -> bool:
    return spec.kind.startswith("roce_")


def _ready_file(run_dir: Path, spec: AgentSpec) -> Path:
    return run_dir / "agents" / f"{spec.name}.ready"


def _wait_ready(run_dir: Path, agents, stop: threading.Event) -> list[str]:
    """Wait until every RoCE server listens (its ready file exists); notes for those that
    did not within ROCE_SERVER_READY_S (their clients will fail to connect)."""
    waiting = {spec.name: (spec, proc) for spec, proc in agents
               if _is_roce(spec) and spec.role == "receiver"}
    deadline = time.monotonic() + ROCE_SERVER_READY_S
    while waiting and time.monotonic() < deadline and not stop.is_set():
        for name, (spec, proc) in list(waiting.items()):
            if _ready_file(run_dir, spec).exists() or proc.popen.poll() is not None:
                del waiting[name]
        stop.wait(0.02)
    notes = [f"RoCE server {name} on {spec.node} was not listening {ROCE_SERVER_READY_S:g} s "
             "(wall) after it was started" for name, (spec, _) in waiting.items()]
    notes += [f"RoCE server {spec.name} on {spec.node} exited during set-up "
              f"(code {proc.popen.returncode})" for spec, proc in agents
              if _is_roce(spec) and spec.role == "receiver"
              and proc.popen.poll() is not None]
    return notes


def _roce_sum(res: dict, side: str, key: str) -> int:
    return sum(int(q.get(side, {}).get(key, 0)) for q in (res.get("qps") or {}).values())


def _write_roce_results(store: Store, agents, results: dict) -> None:
    """One row per RoCE stream (client + its server), in fabric units.

    bytes / gbps: message bytes the client completed (acknowledged) over its time
    time_us (first post to last completion, fabric: for one message, its completion
    time as the sender sees it, last byte delivered plus the ACK's way back). start_us:
    the first post, fabric us after the run's common start (the entry's start plus how
    late the client began); end_us = start_us + time_us, when the last message completed.
    tx_* and rx_* count data packets and their UDP payload as the requester sent them
    (retransmissions included) and the responder received them; lost = sent - received;
    rx_fabric_bps is the wire rate received (UDP payload + 66 B per packet) over the
    client's time."""
    servers = {(s.traffic, s.src, s.dst): results.get(s.name) for s, _ in agents
               if s.role == "receiver"}
    for spec, _ in agents:
        if spec.role != "sender":
            continue
        c = results.get(spec.name) or {}
        srv = servers.get((spec.traffic, spec.src, spec.dst)) or {}
        fabric_ns = float(c.get("elapsed_fabric_ns") or 0)
        start_us = (spec.start_ns + (c.get("start_late_fabric_ns") or 0)) / 1e3
        tx_packets = _roce_sum(c, "requester", "packets_sent")
        rx_packets = _roce_sum(srv, "responder", "packets_received")
        rx_bytes = sum(int(q.get("bytes_received", 0)) for q in (srv.get("qps") or {}).values())
        rx_wire_bits = (rx_bytes + rx_packets * WIRE_OVERHEAD_BYTES) * 8
        verified = c.get("verified")
        if verified is None:
            verified = srv.get("verified")
        store.add_result(spec.traffic, spec.kind, {
            "src": spec.src, "dst": spec.dst,
            "cc": "/".join(str(x) for x in (c.get("cc"), c.get("cc_preset")) if x),
            "cc_overrides": c.get("cc_overrides") or None,
            "window_packets": c.get("window_packets"),
            "qps": c.get("qp_count", 0),
            "bytes": int(c.get("bytes", 0)), "messages": int(c.get("messages", 0)),
            "time_us": round(fabric_ns / 1e3, 3),
            "start_us": round(start_us, 3),
            "end_us": round(start_us + fabric_ns / 1e3, 3) if "elapsed_fabric_ns" in c else None,
            "gbps": round(float(c.get("bw_fabric_bps", 0)) / 1e9, 3),
            "tx_packets": tx_packets, "tx_bytes": _roce_sum(c, "requester", "bytes_sent"),
            "rx_packets": rx_packets, "rx_bytes": rx_bytes,
            "lost": max(0, tx_packets - rx_packets),
            "rx_fabric_bps": round(rx_wire_bits / fabric_ns * 1e9) if fabric_ns else 0,
            "retransmissions": _roce_sum(c, "requester", "retransmissions"),
            "naks": sum(_roce_sum(c, "requester", k) for k in (
                "naks_received", "rnr_naks_received", "fatal_naks_received")),
            "timeouts": _roce_sum(c, "requester", "timeouts"),
            "cnps_sent": _roce_sum(srv, "responder", "cnps_sent"),
            "cnps_received": _roce_sum(c, "requester", "cnps_received"),
            "ce_received": _roce_sum(srv, "responder", "ce_packets_received"),
            "verified": verified,
            "error": c.get("error") or srv.get("error"),
        })


def _lossless_tcs(plan: Plan) -> set[int]:
    return {t.tc for t in plan.traffic_classes if t.lossless}


def _roce_fidelity(run_dir: Path, agents, results: dict, dilation: Dilation,
                   t0_realtime_ns: int, lossless_drops: float = 0) -> list[str]:
    """Where RoCE streams did not run as configured: a client set up after the common
    start, an error, data that did not verify, ACK timeouts without a drop."""
    notes = []
    for spec, _ in agents:
        if spec.module != "agents.roce":
            continue
        res = results.get(spec.name) or {}
        who = f"RoCE {'client' if spec.role == 'sender' else 'server'} {spec.name}"
        if res.get("error"):
            notes.append(f"{who} on {spec.node}: {res['error']}")
        if spec.role != "sender":
            continue
        try:
            ready_ns = _ready_file(run_dir, spec).stat().st_mtime_ns
        except FileNotFoundError:
            ready_ns = None
        late = None if ready_ns is None else (
            ready_ns - t0_realtime_ns - dilation.to_wall_ns(spec.start_ns))
        if late is None:
            notes.append(f"{who} on {spec.node} never finished set-up")
        elif late > ROCE_LATE_TOLERANCE_NS:
            notes.append(f"{who} on {spec.node} finished set-up {late / 1e6:.0f} ms (wall) "
                         f"after its start time, so it started "
                         f"{dilation.to_fabric_ns(late) / 1e3:.1f} us fabric late")
        if res.get("verified") is False:
            notes.append(f"{who}: the data did not arrive byte-exact (first mismatch "
                         f"{res.get('first_mismatch')})")
        timeouts = _roce_sum(res, "requester", "timeouts")
        if timeouts and not lossless_drops:
            notes.append(f"{who}: {timeouts} ACK timeouts although no lossless queue dropped: "
                         "ACKs came later than the QP timeout (long pauses, or an agent short "
                         "of CPU)")
    return notes


def _build_report(run_dir: Path, say: Callable[[str], None]) -> None:
    try:
        from testbed.report import build_report
    except ImportError:
        say("report: the report module is not available; summary.json is written")
        return
    try:
        paths = build_report(run_dir)
        say(f"report: {paths.html}")
    except Exception as exc:   # the run's data is safe; say why the report is missing
        say(f"report: could not be built ({exc}); rebuild with `testbed report {run_dir}`")
