"""One run, in named stages: prepare -> up -> fabric agents -> workload -> sample ->
stop -> results -> summary and report.

Each stage is a function of the `Run` it is given (what the run has so far) and adds
to it; `run_config` calls them in order and makes sure the later ones run whatever
happened in the earlier ones. Ctrl-C or SIGTERM at any point stops cleanly: agents are
stopped, the fabric goes down, what was sampled is kept and the report is written from
it, marked interrupted. Samples go to the store as they are taken, so even a SIGKILL
leaves a database that `testbed report` can read (and `testbed down --all` cleans the
fabric). Every fidelity note is written to the store as an event when it is noted.

Workload kinds (testbed/workloads) decide what their agents need: extra files, a wait
until servers are ready, set-up time, result rows, stream accounts and their own notes.

One VM's part of a run spread over several VMs (`RunOptions.part`, docs/scale-out.md)
goes through the same stages for its own nodes and agents: it builds the VM's part,
starts the agents of its nodes at the common start instant, samples its ports, and
writes a *part run directory*: the agents' raw results (agents/results.json), its ports'
counters and invariants, and no result rows or report. `testbed merge` (merge.py) makes
the run directory of the whole fabric from every VM's part.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agents.runtime.start import read_armed_file, write_start_file
from agents.timebase import wall_timeout_s
from testbed.config import LoadedConfig
from testbed.net import apply_plan, destroy_lab
from testbed.net.counters import QueueProbe, datapath_snapshot, udp_errors
from testbed.net.namespaces import socket_in
from testbed.net.portprog import pin_dir_of
from testbed.net.probe import probe_report
from testbed.net.state import LabState
from testbed.plan.model import Plan
from testbed.plan.part import PartPlan, local_plan
from testbed.report import build_report
from testbed.results.files import write_json, write_private
from testbed.results.flows import write_flow_files
from testbed.results.store import Store
from testbed.results.tables import DROP_COUNTERS
from testbed.run.capture import start_captures, stop_captures
from testbed.run.clocksync import CLOCK_PORT, ClockServer, measure
from testbed.run.collector import AgentEndpoint, Collector, LiveTotals, agent_read_notes
from testbed.run.fabric_agents import (
    has_pfc,
    rxe_cc_hosts,
    rxe_cc_note,
    rxe_dcqcn_of,
    start_pfc_agents,
    start_rxe_cc_agents,
)
from testbed.run.fidelity import base_rtt_shortfall_ns
from testbed.run.pfc_reaction import loop_note, reactions, summarize
from testbed.run.pinning import pin_paths
from testbed.run.procs import AgentProcess, socket_path, start_agent, use_zygote, zygote_counts
from testbed.run.rundir import create_run_dir, machine_metadata
from testbed.run.summary import build_summary
from testbed.run.timeline import FabricApplier, Timeline, start_timeline
from testbed.run.timings import RunTimings
from testbed.run.watch import RunWatch, WatchedAgent
from testbed.run.workload import (
    DEFAULT_SAMPLE_PERIOD_WALL_NS,
    armed_file,
    by_kind,
    events_file,
    expand_workload,
    out_file,
    ready_file,
    run_view,
    start_file,
    stream_accounts,
    workload_span_ns,
    workload_work_wall_s,
)
from testbed.run.zygote import Zygote, agent_start_record, start_run_zygote, zygote_enabled
from testbed.units import format_size
from testbed.workloads.base import AgentFiles, AgentSpec, FlowRecord, RunView, WorkloadKind
from testbed.workloads.registry import REGISTRY

# The common start t0 is given once every sender is armed (agents.runtime.start): t0 =
# the moment the last one armed + go_margin_s, which covers waking them all (a start file
# they wait for with inotify) on this machine's CPUs. A sender that saw it after its start
# time is named (late_senders), so a margin too short for the machine's load is said.
# 20 ms was: in CI a collective rank sharing a host with another job's woke 3-5 ms late.
GO_MARGIN_BASE_S = 0.05
GO_MARGIN_PER_ROUND_S = 0.002
# A sender that saw the start this much after its start time started late.
LATE_START_TOLERANCE_NS = 2_000_000
# Wall seconds to wait for every agent a kind waits for (a RoCE server listening).
READY_TIMEOUT_S = 20.0
# Wall seconds senders may overrun their scheduled end before they are stopped.
SENDER_OVERRUN_S = 30.0


@dataclass(frozen=True)
class PartRun:
    """One VM's part of a run over several VMs: which part, the common start instant,
    where the tunnels' underlay is, and the file whose appearance says every VM's
    senders are done (the controller writes it; until then this part keeps its
    receivers serving the other VMs' senders)."""
    part: PartPlan
    start_at_unix_ns: int                   # CLOCK_REALTIME of the common start t0
    underlay_netns: str | None = None
    stop_file: Path | None = None
    # the VM whose clock the others' are measured against, and its underlay address
    reference: tuple[str, str] | None = None
    local_underlay: str | None = None       # this VM's underlay address


# The marker a part run writes in its run directory once its own senders are done.
SENDERS_DONE = "senders-done"


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
    # called with the run directory once summary.json is written, before the report is
    # built: an incident run writes its verdict there, so the report is built once, with it
    before_report: Callable[[Path], None] | None = None
    # one VM's part of a run over several VMs (None: the whole fabric here)
    part: PartRun | None = None
    # CLOCK_MONOTONIC ns (start, end) of loading and compiling the config, for timings.json
    compile_mono_ns: tuple[int, int] | None = None
    # nodes per PFC agent process (None: auto; 1: one per node): fabric_agents.pfc_groups
    pfc_nodes_per_process: int | None = None


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    interrupted: bool
    collector_overhead: float
    fault: str = ""        # the fault that ended the run (its fidelity note), if one did
    failed: str = ""       # why the run failed (a stage raised: bring-up, agents...), if it did


class Notes:
    """The run's fidelity notes, each written to the store as an event when noted."""

    def __init__(self, store: Store, clock: Callable[[], int]) -> None:
        self.items: list[str] = []
        self._store = store
        self._clock = clock

    def add(self, note: str) -> None:
        self.items.append(note)
        try:
            self._store.add_event(self._clock(), time.monotonic_ns(), "fidelity", message=note)
        except (sqlite3.Error, OSError):
            # The disk is full (or the store failed): the note is kept for summary.json
            # and the run's output; the watch names the store's failure itself.
            pass

    def extend(self, notes: Iterable[str]) -> None:
        for note in notes:
            self.add(note)


@dataclass
class Run:
    """What one run has so far; the stages below fill it in."""

    loaded: LoadedConfig
    plan: Plan                           # a part run's: its own nodes (builder.part_view)
    options: RunOptions
    run_dir: Path
    store: Store
    notes: Notes
    probe: dict
    specs: list[AgentSpec]
    period_ns: int                       # fabric time between samples
    drain_ns: int
    span_ns: int                         # fabric time from t0 to the senders' end
    work_wall_s: float = 0.0             # wall time senders work outside fabric time
    t_start: float = field(default_factory=time.monotonic)
    t0_mono_ns: int = field(default_factory=time.monotonic_ns)
    t0_realtime_ns: int = field(default_factory=time.time_ns)
    phase: str = "up"
    udp_start: dict[str, dict[str, int]] = field(default_factory=dict)
    captures: list[AgentProcess] = field(default_factory=list)
    fabric_procs: list[AgentProcess] = field(default_factory=list)
    endpoints: list[AgentEndpoint] = field(default_factory=list)
    agents: list[tuple[AgentSpec, AgentProcess]] = field(default_factory=list)
    results: dict[str, dict] = field(default_factory=dict)
    collector: Collector | None = None
    timeline: tuple[Timeline, FabricApplier] | None = None   # the fault timeline, if any
    results_written: bool = False
    invariants: dict | None = None
    pfc_reaction: dict | None = None     # the emulated PFC loop's pauses (pfc_reaction.py)
    peaks_snapshot: dict | None = None   # the port programs just before the fabric agents stop
    interrupted: bool = False
    failed: str = ""                     # a stage raised: what (summary.json `failed`)
    watch: RunWatch | None = None        # faults during the run (testbed/run/watch.py)
    full_plan: Plan | None = None        # a part run's whole fabric (None: `plan` is)
    clock: dict | None = None            # a part run's measured clock offset (clocksync)
    clock_server: ClockServer | None = None   # the reference VM's, while the run lasts
    timings: RunTimings = field(default_factory=RunTimings)   # timings.json
    zygote: Zygote | None = None         # the agents' fork server (testbed/run/zygote.py)

    @property
    def agents_dir(self) -> Path:
        return self.run_dir / "agents"

    def fabric_now_ns(self) -> int:
        return self.collector.fabric_now_ns() if self.collector else 0

    def by_kind(self) -> dict[WorkloadKind, list[AgentSpec]]:
        return by_kind(spec for spec, _ in self.agents)


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

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def run_config(loaded: LoadedConfig, plan: Plan, options: RunOptions) -> RunResult:
    started = time.monotonic_ns()
    run = prepare(loaded, plan, options)
    timings = run.timings
    if options.compile_mono_ns is not None:
        timings.add("compile", *options.compile_mono_ns)
    timings.add("prepare", started, time.monotonic_ns())
    with _Interrupt() as stop:
        try:
            if options.part is not None:
                serve_clock(run)
            start_zygote(run)
            with timings.phase("up"):
                bring_up(run)
            if options.part is not None:
                measure_clock(run)
            with timings.phase("fabric_agents"):
                start_fabric_agents(run)
                pin_sender_paths(run)
            if options.on_up is not None:
                options.on_up(plan)
            start_workload(run, stop.event)
            sample_until_done(run, stop.event)
        except BaseException as exc:
            run.failed = f"{type(exc).__name__}: {exc}"
            run.notes.add(f"run failed: {exc!r}")
            options.say(f"run: failed: {exc}")
            if not isinstance(exc, Exception):
                raise
        finally:
            run.interrupted = stop.event.is_set()
            if run.interrupted:
                options.say(f"run: interrupted by {stop.signal_name}; stopping agents, taking "
                            "the fabric down, writing the report")
                try:
                    run.store.add_event(run.fabric_now_ns(), time.monotonic_ns(),
                                        "interrupted", signal=stop.signal_name)
                except (sqlite3.Error, OSError):
                    pass    # the disk full: the watch named it; stopping comes first
            with timings.phase("stop_agents"):
                try:
                    stop_agents(run)
                finally:
                    stop_zygote(run)
                if run.clock_server is not None:
                    run.clock_server.stop()
            with timings.phase("results"):
                write_results(run)
            with timings.phase("down"):
                take_down(run)
    with timings.phase("summary"):
        summary = write_summary(run)
    with timings.phase("report"):
        if options.before_report is not None:
            options.before_report(run.run_dir)
        if options.part is None:
            write_report(run.run_dir, options.say)
        else:
            options.say(f"part run of VM {options.part.part.vm}: no report of its own; "
                        "`testbed merge` makes the whole fabric's run directory from every VM's")
    try:
        timings.write(run.run_dir)
    except OSError as exc:     # the disk full: the run's data is kept all the same
        options.say(f"run: could not write timings.json ({exc})")
    overhead = run.collector.overhead_fraction() if run.collector else 0.0
    ended = next((f.message for f in run.watch.faults if f.ends_run), "") if run.watch else ""
    return RunResult(run.run_dir, summary, run.interrupted, overhead, ended, run.failed)


# --- stages ------------------------------------------------------------------------

def prepare(loaded: LoadedConfig, plan: Plan, options: RunOptions) -> Run:
    """The run directory with the config, plan and machine metadata; the store; the
    workload's agents; the notes known before anything runs."""
    dilation = plan.timebase
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
                else default_drain_ns(plan))
    store.set_meta("sample_period_fabric_ns", str(period_ns))
    specs = expand_workload(fabric, plan)
    part = options.part
    if part is not None:
        here = set(part.part.nodes)
        specs = [s for s in specs if s.node in here]
        store.set_meta("part_vm", part.part.vm)
        write_json(run_dir / "part.json", part_metadata(part))
    run = Run(loaded=loaded, plan=plan if part is None else local_plan(plan, part.part),
              options=options, run_dir=run_dir, store=store,
              notes=Notes(store, lambda: 0), probe=probe,
              specs=specs, period_ns=period_ns, drain_ns=drain_ns,
              span_ns=workload_span_ns(fabric, plan),
              work_wall_s=workload_work_wall_s(fabric), full_plan=plan if part else None)
    run.notes = Notes(store, run.fabric_now_ns)
    run.notes.extend(plan.warnings)
    run.notes.extend(kernel_notes(plan, probe))
    return run


# The drain when the workload sets none: this many of the fabric's longest base round
# trips (what is still on a wire or an ACK on its way back when the queues are empty:
# the port programs do not see it), and at least DEFAULT_DRAIN_MIN_WALL_NS of wall time
# (a sample period, so the report shows the fabric empty); then the run waits until no
# port program holds a byte (drain_fabric). Each receiver reads what its socket holds
# before it exits, and the conservation invariant names any packet not accounted for.
DEFAULT_DRAIN_RTTS = 10
DEFAULT_DRAIN_MIN_WALL_NS = 100_000_000


def default_drain_ns(plan: Plan) -> int:
    """Fabric ns to drain after the senders stop when the workload sets no `drain`."""
    return max(DEFAULT_DRAIN_RTTS * base_rtt_shortfall_ns(plan),
               round(plan.timebase.to_fabric_ns(DEFAULT_DRAIN_MIN_WALL_NS)))


def part_metadata(part: PartRun, clock: dict | None = None) -> dict:
    """part.json of a part run directory (docs/scale-out.md, "A run over several VMs")."""
    p = part.part
    return {"format_version": 1, "vm": p.vm, "nodes": p.nodes,
            "start_at_unix_ns": part.start_at_unix_ns,
            "reference": part.reference[0] if part.reference else None,
            "tunnels": [{"link": t.link, "vni": t.vni, "local": t.local.model_dump(),
                         "remote": t.remote.model_dump()} for t in p.tunnels],
            "clock": clock}


# Wall seconds a part run tries to reach the reference VM's clock server, at most: the
# other VMs build their parts meanwhile, the reference its own (its server starts first).
CLOCK_TRY_S = 10.0
# Wall seconds kept free before the common start for the agents' own start-up.
CLOCK_START_MARGIN_S = 1.5


def serve_clock(run: Run) -> None:
    """The reference VM answers the others' clock requests on its underlay address for as
    long as its part run lasts (clocksync.py)."""
    part = run.options.part
    assert part is not None
    if part.reference is None or part.reference[0] != part.part.vm:
        return
    sock = socket_in(part.underlay_netns)
    try:
        sock.bind((part.reference[1], CLOCK_PORT))
    except OSError as exc:
        sock.close()
        run.notes.add(f"VM {part.part.vm} (the clock reference) could not serve the clock "
                      f"on {part.reference[1]}:{CLOCK_PORT} ({exc}): the other VMs' clock "
                      "offsets go unmeasured")
        return
    run.clock_server = ClockServer(sock)
    run.clock_server.start()


def measure_clock(run: Run) -> None:
    """A VM other than the reference measures its clock offset to it over the underlay
    (after building its part, before the common start); part.json records it, and
    `testbed merge` moves this VM's samples by it."""
    part = run.options.part
    assert part is not None
    if part.reference is None or part.reference[0] == part.part.vm:
        return
    name, address = part.reference
    sock = socket_in(part.underlay_netns)
    try:
        deadline = time.monotonic() + min(CLOCK_TRY_S, max(
            0.0, (part.start_at_unix_ns - time.time_ns()) / 1e9 - CLOCK_START_MARGIN_S))
        offset = None
        while offset is None and time.monotonic() < deadline:
            offset = measure(sock, (address, CLOCK_PORT), name, count=16, timeout_s=0.2)
    finally:
        sock.close()
    if offset is None:
        run.notes.add(f"VM {part.part.vm} could not measure its clock offset to {name} "
                      f"({address}:{CLOCK_PORT} did not answer): its samples are merged as "
                      "if on the same clock")
        return
    run.clock = offset.to_dict()
    write_json(run.run_dir / "part.json", part_metadata(part, run.clock))
    run.options.say(f"clock: {offset.offset_ns / 1e3:+.1f} us against {name} "
                    f"(+- {offset.uncertainty_ns / 1e3:.1f} us, {offset.exchanges} exchanges)")


def kernel_notes(plan: Plan, probe: dict) -> list[str]:
    """What this fabric does not emulate on the kernel it runs on (testbed probe).

    Where the kernel has sch_netem and IFB devices the builder puts each link's
    dilated delay and PHY loss on the wire (testbed/net/netem.py): nothing to note.
    """
    missing = [f for f in ("netem", "ifb") if f in set(probe.get("missing", []))]
    if not missing:
        return []
    short_ns = base_rtt_shortfall_ns(plan)
    if short_ns <= 0:
        return []
    return [missing_delay_note(short_ns, f"kernel {probe.get('kernel')} has no "
                               + " and no ".join(_FEATURE_WORDS[f] for f in missing))]


_FEATURE_WORDS = {"netem": "sch_netem", "ifb": "IFB devices"}


def missing_delay_note(short_ns: int, why: str) -> str:
    return (f"link propagation and FEC delay are not emulated ({why}), so the longest "
            f"host-to-host base RTT is short by {short_ns / 1e3:.2f} us fabric; PHY frame loss "
            "is applied by the BPF port program")


def start_zygote(run: Run) -> None:
    """The run's zygote, started before `up` so that its imports (the PFC agent's, the
    rxe_cc agent's and every workload agent module's) overlap the bring-up; the run's
    `python -m` agents fork from it (procs.start_process). TESTBED_ZYGOTE=0: none."""
    modules = (["agents.pfc"] if has_pfc(run.plan) else []) + (
        ["agents.rxe_cc"] if rxe_cc_hosts(run.plan) else [])
    modules += sorted({s.module for s in run.specs} - set(modules))
    run.zygote, note = start_run_zygote(run.plan.lab, modules, run.agents_dir / "zygote.log")
    if note:
        run.notes.add(note)
    run.timings.agent_start = agent_start_record(zygote_enabled(), run.zygote,
                                                 {"fallback": note})
    if run.zygote is not None:
        use_zygote(run.plan.lab, run.zygote, run.notes.add)


def stop_zygote(run: Run) -> None:
    """After the agents: how they were started (timings.json), then the zygote exits."""
    if run.zygote is None:
        return
    run.timings.agent_start = agent_start_record(True, run.zygote,
                                                 zygote_counts(run.plan.lab))
    use_zygote(run.plan.lab, None)
    run.zygote.close()


def bring_up(run: Run) -> None:
    """Build the fabric; note what its datapath could not do."""
    plan, say = run.plan, run.options.say
    run.store.add_event(run.fabric_now_ns(), time.monotonic_ns(), "phase", phase="up")
    part = run.options.part
    if part is None:
        report = apply_plan(plan, progress=lambda m: say(f"up: {m}"))
    else:
        assert run.full_plan is not None
        report = apply_plan(run.full_plan, progress=lambda m: say(f"up: {m}"), part=part.part,
                            underlay_netns=part.underlay_netns)
    run.timings.up_steps = dict(report.seconds)
    state = LabState.load(plan.lab)
    if state is not None:
        state.run_dir = str(run.run_dir)
        state.save()
    say(f"up: lab {plan.lab!r} in {sum(report.seconds.values()):.2f}s, "
        f"D={plan.dilation.factor}")
    run.udp_start = udp_errors(plan)
    run.store.set_meta("link_delay", report.delay)
    whole = run.full_plan or plan         # paths cross other VMs' nodes
    if report.delay.startswith("none") and not kernel_notes(whole, run.probe):
        # the probe saw netem and ifb, yet the builder could not use them
        short_ns = base_rtt_shortfall_ns(whole)
        if short_ns > 0:
            run.notes.add(missing_delay_note(short_ns, report.delay[6:]))
    if report.ordering.startswith("none"):
        run.notes.add(f"flows are not steered to one CPU per port ({report.ordering[6:]}): a "
                      "flow's packets can be reordered crossing the fabric when the CPUs are "
                      "busy (docs/datapath.md, Ordering)")
    if report.datapath.startswith("none"):
        run.notes.add(f"no port programs ({report.datapath[6:]}): no ECN marking, no queue "
                      "accounting, no PFC, no PHY loss")


def start_fabric_agents(run: Run) -> None:
    """Captures (if asked for), a PFC agent per node with a lossless class, and DCQCN
    around rxe on rxe hosts whose lossless class has ECN."""
    plan = run.plan
    if run.options.capture:
        run.captures = start_captures(plan, run.run_dir, run.options.capture_snaplen)
    start_pfc(run)
    start_rxe_cc(run)


def start_rxe_cc(run: Run) -> None:
    """DCQCN around kernel Soft-RoCE (agents/rxe_cc), unless the workload turns it off."""
    hosts = rxe_cc_hosts(run.plan)
    if not hosts:
        return
    workload = run.loaded.fabric.workload
    dcqcn = rxe_dcqcn_of(list(workload.traffic) if workload else [])
    if dcqcn is None:
        run.notes.add(f"rxe hosts ({', '.join(h.name for h in hosts)}) run without "
                      "congestion control (cc: none): rxe has none of its own")
        return
    started = start_rxe_cc_agents(run.plan, run.agents_dir, dcqcn)
    run.fabric_procs += [p for p, _ in started]
    run.endpoints += [e for _, e in started]
    run.notes.add(rxe_cc_note(hosts, dcqcn))
    run.options.say(f"rxe_cc: DCQCN ({dcqcn.preset}) around rxe on {len(started)} hosts, "
                    "per host class")


def start_pfc(run: Run) -> None:
    plan = run.plan
    if not has_pfc(plan):
        return
    if not has_port_programs(plan):
        run.notes.add("PFC is configured but the port programs are not attached (no BPF "
                      "datapath), so no PFC agent runs and lossless classes can drop")
        return
    started = start_pfc_agents(plan, run.run_dir / "plan.json", run.agents_dir,
                               nodes_per_process=run.options.pfc_nodes_per_process)
    run.fabric_procs += [p for p, _ in started]
    run.endpoints += [e for _, e in started]
    procs = len({p.pid for p, _ in started})
    run.options.say(f"pfc: agents on {len(started)} nodes ({procs} processes)")


def pin_sender_paths(run: Run) -> None:
    """Source ports for senders pinned to a path (a RoCE entry's via:), asked of the
    kernel now that the fabric is up (testbed/run/pinning.py); a path_pinned event each."""
    run.specs, pinned = pin_paths(run.plan, run.specs)
    for p in pinned:
        run.store.add_event(run.fabric_now_ns(), time.monotonic_ns(), "path_pinned",
                            node=p.src, traffic=p.traffic, sender=p.sender, dst=p.dst,
                            dport=p.dport, via=list(p.via), sports=list(p.sports),
                            paths=list(p.paths))
        run.options.say(f"paths: {p.sender} via {','.join(p.via)}: sport "
                        f"{', '.join(map(str, p.sports))}: {p.paths[0]}")


def start_agent_of(run: Run, spec: AgentSpec, armed: bool = False) -> None:
    """Start one workload agent, pointed at its control socket, the files its kind asks
    for and (`armed`: a sender) the run's start file, which gives it the common start
    once every sender is armed (agents.runtime.start)."""
    plan = run.plan
    sock = socket_path(run.agents_dir, spec.name, plan.lab)
    inputs = {}
    for name, text in spec.inputs:
        inputs[name] = run.agents_dir / f"{spec.name}.{name}"
        write_private(inputs[name], text)
    files = AgentFiles(ready=ready_file(run.agents_dir, spec), out=out_file(run.agents_dir, spec),
                       events=events_file(run.agents_dir, spec), inputs=inputs)
    argv = [*spec.argv, "--control-sock", sock, *REGISTRY.of(spec.kind).files_argv(spec, files)]
    if armed:
        argv += ["--start-file", str(start_file(run.agents_dir)),
                 "--armed-file", str(armed_file(run.agents_dir, spec)),
                 "--start-offset-ns", str(plan.timebase.to_wall_ns(spec.start_ns))]
    proc = start_agent(plan.lab, plan.node(spec.node).netns, spec.module, argv, spec.name)
    run.agents.append((spec, proc))
    # The collector imports the events file if the kind pointed its agent at it.
    run.endpoints.append(AgentEndpoint(spec.name, spec.node, sock,
                                       events_path=str(files.events)))


def start_workload(run: Run, stop: threading.Event) -> None:
    """Receivers first, then (once the ones their kind waits for are ready) the senders,
    all timed from one common start t0; the collector samples from then on."""
    started = time.monotonic_ns()
    for spec in run.specs:
        if spec.role != "sender":
            start_agent_of(run, spec)
    run.notes.extend(wait_ready(run, stop))
    ready = time.monotonic_ns()
    run.timings.add("workload_agents", started, ready)
    senders = [s for s in run.specs if s.role == "sender"]
    start_file(run.agents_dir).parent.mkdir(mode=0o700, exist_ok=True)
    for spec in senders:
        if not stop.is_set():
            start_agent_of(run, spec, armed=True)
    run.notes.extend(wait_armed(run, stop))
    run.t0_mono_ns = time.monotonic_ns() + int(go_margin_s(len(senders)) * 1e9)
    run.t0_realtime_ns = time.time_ns() + (run.t0_mono_ns - time.monotonic_ns())
    if run.options.part is not None:
        run.notes.extend(common_start(run, run.options.part))
    write_start_file(str(start_file(run.agents_dir)), run.t0_mono_ns)
    collector = Collector(run.plan, run.store, run.plan.timebase.to_wall_ns(run.period_ns),
                          run.t0_mono_ns, run.endpoints, whole_plan=run.full_plan)
    on_sample = run.options.on_sample
    if on_sample is not None:
        collector.on_sample = lambda totals: on_sample(run.phase, totals,
                                                       time.monotonic() - run.t_start)
    run.collector = collector
    run.phase = "workload"
    run.store.add_event(run.fabric_now_ns(), time.monotonic_ns(), "phase", phase="workload",
                        agents=len(run.specs))
    collector.start()
    run.watch = start_watch(run, collector)
    run.timeline = start_timeline(run.plan, run.store, run.agents_dir, run.t0_mono_ns,
                                  run.notes.add, collector)
    # the common start margin: receivers ready -> t0 (the senders start within it)
    run.timings.add("start_margin", ready, run.t0_mono_ns)
    run.timings.planned_workload_wall_s = run.plan.timebase.to_wall_s(run.span_ns)


def go_margin_s(senders: int, cpus: int | None = None) -> float:
    """Wall seconds from the last sender arming to t0: the start file's write, and each
    sender woken, reading it and going back to sleep until t0, in ceil(senders / cpus)
    rounds on this machine's CPUs."""
    cpus = cpus or os.cpu_count() or 1
    return GO_MARGIN_BASE_S + GO_MARGIN_PER_ROUND_S * -(-max(1, senders) // cpus)


def wait_armed(run: Run, stop: threading.Event) -> list[str]:
    """Wait until every sender has armed (written its armed file: set up, waiting for
    the start), has exited, or the arming timeout has passed: READY_TIMEOUT_S, plus
    what the kinds say their senders may take (WorkloadKind.startup_wall_s). Notes for
    those that did not arm in time (they start late, and late_senders says by how much)."""
    waiting = {spec.name: (spec, proc) for spec, proc in run.agents if spec.role == "sender"}
    timeout_s = wall_timeout_s(READY_TIMEOUT_S + sum(
        REGISTRY.of(spec.kind).startup_wall_s(spec) for spec, _p in waiting.values()))
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline and not stop.is_set():
        for name, (spec, proc) in list(waiting.items()):
            if (armed_file(run.agents_dir, spec).exists()
                    or proc.popen.poll() is not None):
                del waiting[name]   # one that exited is named by the run's watch
        if waiting:
            stop.wait(0.002)
    if stop.is_set():
        return []
    return [f"{_who(spec)} on {spec.node} was not set up {timeout_s:.0f} s (wall) after it "
            "was started: the common start was given without it" for spec, _ in
            waiting.values()]


def late_senders(run: Run) -> list[str]:
    """A note per sender that saw the common start after its own start time (its traffic
    began late by that much), or never armed while it ran (it sent nothing from t0)."""
    notes = []
    for spec, proc in run.agents:
        if spec.role != "sender":
            continue
        path = armed_file(run.agents_dir, spec)
        if str(path) not in list(proc.popen.args):  # type: ignore[arg-type]
            continue            # not started with the start signal
        armed = read_armed_file(str(path))
        if armed is None or "go_seen_mono_ns" not in armed:
            if proc.popen.poll() not in (None, 0):
                continue        # it failed: the run's watch names that
            notes.append(f"{_who(spec)} on {spec.node} never "
                         f"{'armed' if armed is None else 'saw the common start'}: it sent "
                         "nothing from its start time")
            continue
        late_ns = int(armed["go_seen_mono_ns"]) - int(armed["start_mono_ns"])
        if late_ns > LATE_START_TOLERANCE_NS:
            fabric_us = run.plan.timebase.to_fabric_ns(late_ns) / 1e3
            notes.append(f"{_who(spec)} on {spec.node} saw the common start {late_ns / 1e6:.0f}"
                         f" ms (wall) after its start time: its traffic began {fabric_us:,.1f}"
                         " us fabric late (the machine was too loaded to wake it in the "
                         "start margin)")
    return notes


def common_start(run: Run, part: PartRun) -> list[str]:
    """A part run's t0 is the instant every VM was given (CLOCK_REALTIME), mapped once to
    this machine's CLOCK_MONOTONIC, which times everything after it. Notes if this VM's
    agents needed longer to be ready than the controller allowed."""
    now_mono, now_real = time.monotonic_ns(), time.time_ns()
    earliest = run.t0_mono_ns          # this VM's own start-up margin
    run.t0_mono_ns = now_mono + (part.start_at_unix_ns - now_real)
    run.t0_realtime_ns = part.start_at_unix_ns
    if run.t0_mono_ns < earliest:
        return [f"VM {part.part.vm} was ready "
                f"{(earliest - run.t0_mono_ns) / 1e6:.0f} ms (wall) after the common start "
                "(set-up took longer than the controller allowed): its senders started late "
                "and its receivers missed what came before they were ready"]
    return []


def start_watch(run: Run, collector: Collector) -> RunWatch:
    """The watch over every agent, the collector, the namespaces and the clock."""
    endpoints = {e.name: e for e in run.endpoints}
    watched = []
    # one watched agent per process: PFC nodes served by one process (docs/pfc.md) die
    # together, and their one fault names them all
    by_pid: dict[int, list[AgentProcess]] = {}
    for proc in run.fabric_procs:
        by_pid.setdefault(proc.pid, []).append(proc)
    for procs in by_pid.values():
        proc = procs[0]
        role = "pfc" if proc.name.startswith("pfc-") else "rxe_cc"
        node = proc.name.removeprefix("pfc-").removeprefix("rxe-cc-")
        watched.append(WatchedAgent(proc.name, node, role, proc, endpoints.get(proc.name),
                                    lossless=role == "pfc", also_nodes=tuple(
                                        p.name.removeprefix("pfc-") for p in procs[1:])))
    for spec, proc in run.agents:
        watched.append(WatchedAgent(spec.name, spec.node, spec.role, proc,
                                    endpoints.get(spec.name)))
    return RunWatch(watched, {n.netns: n.name for n in run.plan.nodes},
                    collector.fabric_now_ns, collector, run_dir=str(run.run_dir))


def watch_tick(run: Run) -> bool:
    """Check for faults (testbed/run/watch.py); note and record each one found. Whether
    one of them ends the run."""
    if run.watch is None:
        return False
    for fault in run.watch.check():
        run.notes.add(fault.message)
        try:
            run.store.add_event(fault.ts_fabric_ns, fault.detected_mono_ns, "run_fault",
                                node=fault.node, port=fault.who, fault=fault.kind,
                                who=fault.who, role=fault.role,
                                action="ended the run" if fault.ends_run else "continued",
                                message=fault.message)
        except (sqlite3.Error, OSError):
            pass
        run.options.say(f"run: {fault.message}")
    return run.watch.ends_run()


def wait_ready(run: Run, stop: threading.Event) -> list[str]:
    """Wait until every agent its kind waits for has its ready file; notes for those that
    did not within READY_TIMEOUT_S or exited first (their peers will fail to set up)."""
    waiting = {spec.name: (spec, proc) for spec, proc in run.agents
               if REGISTRY.of(spec.kind).waits_ready(spec)}
    exited: list[tuple[AgentSpec, AgentProcess]] = []
    deadline = time.monotonic() + wall_timeout_s(READY_TIMEOUT_S)
    while waiting and time.monotonic() < deadline and not stop.is_set():
        for name, (spec, proc) in list(waiting.items()):
            if ready_file(run.agents_dir, spec).exists():
                del waiting[name]
            elif proc.popen.poll() is not None:
                exited.append((spec, proc))
                del waiting[name]
        stop.wait(0.005)
    ready_s = wall_timeout_s(READY_TIMEOUT_S)
    notes = [f"{_who(spec)} on {spec.node} was not ready {ready_s:g} s (wall) after "
             "it was started" for spec, _ in waiting.values()]
    notes += [f"{_who(spec)} on {spec.node} exited during set-up (code "
              f"{proc.popen.returncode})" for spec, proc in exited]
    return notes


def _who(spec: AgentSpec) -> str:
    return REGISTRY.of(spec.kind).describe(spec)


def sample_until_done(run: Run, stop: threading.Event) -> None:
    """Wait for the senders to finish (or their schedule to pass), then drain: the
    configured drain time, and until no port program holds a byte."""
    dilation = run.plan.timebase
    senders = [p for s, p in run.agents if s.role == "sender"]
    end_wall = run.t0_mono_ns + dilation.to_wall_ns(run.span_ns)
    part = run.options.part
    overrun_s = SENDER_OVERRUN_S + run.work_wall_s
    while not stop.is_set():
        if watch_tick(run):
            return
        if senders and all(p.popen.poll() is not None for p in senders):
            break
        if not senders and part is not None and part.stop_file is not None:
            break        # nothing of its own to wait for: the stop file below decides
        if not senders and time.monotonic_ns() >= end_wall:
            break
        if time.monotonic_ns() > end_wall + overrun_s * 1e9:
            run.notes.add(f"senders did not finish {overrun_s:g} s of wall time after "
                          "their scheduled end; they were stopped")
            break
        stop.wait(0.05)
    if stop.is_set():
        return
    run.notes.extend(late_senders(run))
    if part is not None and not wait_for_other_vms(run, part, stop, end_wall, overrun_s):
        return
    drain_start = time.monotonic_ns()
    run.timings.add("workload", run.t0_mono_ns, drain_start)
    try:
        _drain(run, stop)
    finally:
        run.timings.add("drain", drain_start, time.monotonic_ns())


def _drain(run: Run, stop: threading.Event) -> None:
    """The configured drain time, then until no port program holds a byte."""
    dilation = run.plan.timebase
    run.phase = "drain"
    run.store.add_event(run.fabric_now_ns(), time.monotonic_ns(), "phase", phase="drain")
    drain_end = time.monotonic_ns() + dilation.to_wall_ns(run.drain_ns)
    while time.monotonic_ns() < drain_end and not stop.is_set():
        if watch_tick(run):
            return
        stop.wait(0.05)
    # Receivers stop only once the fabric is empty: a datagram that arrives after its
    # receiver closed would be lost to the measurement, not the fabric.
    run.notes.extend(drain_fabric(run.plan, stop, run.drain_ns, lambda: watch_tick(run)))


def wait_for_other_vms(run: Run, part: PartRun, stop: threading.Event, end_wall: int,
                       overrun_s: float) -> bool:
    """A part run whose own senders are done says so (SENDERS_DONE in its run directory)
    and, given a stop file, keeps its receivers serving the other VMs' senders until the
    controller writes it. False if the run was stopped or ended by a fault meanwhile."""
    write_private(run.run_dir / SENDERS_DONE, f"{time.time_ns()}\n")
    if part.stop_file is None:
        return True
    while not part.stop_file.exists():
        if stop.is_set() or watch_tick(run):
            return False
        if time.monotonic_ns() > end_wall + overrun_s * 1e9:
            run.notes.add(f"the stop file {part.stop_file} did not appear {overrun_s:g} s of "
                          "wall time after the scheduled end: the other VMs' senders may not "
                          "have finished; this VM stopped its agents")
            return True
        stop.wait(0.05)
    return True


def stop_agents(run: Run) -> None:
    """Stop the workload's agents and keep their results, then the captures, the fabric
    agents and the collector (whose last sample is the final one). Every workload agent is
    asked first and then waited for, so each gets the whole grace period to wind down and
    write its counters (one after the other, the last would have waited for all). The
    fault timeline stops first: no event is applied to a fabric whose agents are going."""
    if run.watch is not None:
        watch_tick(run)            # what died last, before the exits we cause
        run.watch.stopping = True
    if run.timeline is not None:
        run.timeline[0].stop()
    for _spec, proc in run.agents:
        proc.request_stop()
    for spec, proc in run.agents:
        # result() reads the agent's stdout while it winds down (and stops it if it does
        # not): waiting first without reading hung an agent whose last line is over a
        # pipe's 64 KiB (a RoCE responder of 127 streams) until it was killed mid-line
        try:
            run.results[spec.name] = proc.result(timeout_s=wall_timeout_s(5))
        except (RuntimeError, ValueError) as exc:
            run.notes.add(f"agent {spec.name} on {spec.node}: {exc}")
    run.notes.extend(stop_captures(run.captures, run.run_dir))
    if run.fabric_procs:
        # The fabric agents open their gates as they stop, one after another: what a
        # paused upstream then floods into a neighbour is the emulator coming down.
        # The invariants are judged on the fabric as it was before that.
        if run.collector is not None:
            run.collector.invariants.freeze()
        try:
            run.peaks_snapshot = (datapath_snapshot(run.plan) if has_port_programs(run.plan)
                                  else None)
        except Exception as exc:   # the final snapshot still gives the peaks
            run.notes.add("could not read the port programs before the fabric agents "
                          f"stopped: {exc!r}")
    # Asked together, then waited for: each winds down (opens its gates, writes its last
    # events) in parallel with the others instead of after them (~0.1 s each).
    for proc in run.fabric_procs:
        proc.request_stop()
    for proc in run.fabric_procs:
        proc.stop()
    if run.collector is not None:
        run.collector.stop()
        watch_tick(run)            # the final sample may have found the disk full


def write_results(run: Run) -> None:
    """Result rows and each kind's notes, then the run's invariants and the collector's
    own notes. Best effort on an interrupted run: what cannot be read is said. A part run
    keeps its agents' raw results for the merge instead (streams have their two ends on
    different VMs), and checks its own ports' invariants."""
    if run.options.part is not None:
        write_json(run.agents_dir / "results.json", run.results)
        run.results_written = True
    try:
        if run.options.part is not None:
            raise _PartRun()
        view = _run_view(run)
        kinds = run.by_kind()
        flows: list[FlowRecord] = []
        for kind, specs in kinds.items():
            rows = kind.result_rows(specs, run.results, view)
            for row in rows:
                run.store.add_result(row.traffic, row.kind, row.fields)
            write_output_files(run.run_dir, kind.output_files(rows, specs, run.results, view))
            flows += kind.flow_records(specs, run.results, view)
        if flows:
            run.store.add_flows(flows)
            write_flow_files(run.run_dir, flows)
        run.results_written = True
        for kind, specs in kinds.items():
            run.notes.extend(kind.fidelity_notes(specs, run.results, view))
    except _PartRun:
        view = None
    except Exception as exc:
        run.notes.add(f"could not collect agent results: {exc!r}")
        view = None
    if run.collector is None:
        return
    try:
        run.invariants = check_invariants(run, view or _run_view(run))
        run.notes.extend(run.invariants["notes"])
    except Exception as exc:   # the run's data is kept; say why it is unchecked
        run.notes.add(f"could not check the run's invariants: {exc!r}")
    run.notes.extend(run.collector.watchdog.notes(run.plan.timebase))
    run.notes.extend(run.collector.late_notes())
    run.notes.extend(agent_read_notes(run.collector.agents))
    measure_pfc_loop(run)


def measure_pfc_loop(run: Run) -> None:
    """The PFC loop's reaction in this run (summary `pfc_reaction`), and a note when a
    lossless invariant failed while the loop was slower than the plan assumed."""
    try:
        run.pfc_reaction = pfc_loop(run)
    except Exception as exc:
        run.notes.add(f"could not measure the PFC loop's reaction: {exc!r}")
        return
    checks = (run.invariants or {}).get("checks") or {}
    if any(not (checks.get(k) or {}).get("held", True) for k in ("headroom", "lossless_drop")):
        note = loop_note(run.pfc_reaction, run.plan.dilation.pfc_loop_wall_ns)
        if note:
            run.notes.add(note)


def pfc_loop(run: Run) -> dict | None:
    """How fast the emulated PFC loop paused upstream ports in this run (None: no pause)."""
    events = {k: run.store.events(k) for k in ("pfc_xoff", "pfc_paused")}
    roles = {node.name: node.role for node in run.plan.nodes}
    return summarize(reactions(events["pfc_xoff"], events["pfc_paused"], roles, "pause"),
                     run.plan.timebase)


class _PartRun(Exception):
    """A part run has no result rows of its own (merge.py makes them)."""


def write_output_files(run_dir: Path, files: dict[str, str]) -> None:
    """A kind's extra result files, under the run directory's results/."""
    for name, text in files.items():
        path = run_dir / "results" / name
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_private(path, text)


def _run_view(run: Run) -> RunView:
    store, plan = run.store, run.plan
    paused = frozenset(n for (n, _p, _t), v in store.last_values("pause_rx").items() if v)
    lossless = {t.tc for t in plan.traffic_classes if t.lossless}
    drops = sum(v for counter in DROP_COUNTERS
                for (_n, _p, tc), v in store.last_values(counter).items() if tc in lossless)
    return run_view(plan, run.agents_dir, run.t0_realtime_ns, paused, int(drops))


def check_invariants(run: Run, view: RunView) -> dict:
    """Read the port programs' final counters (kept in datapath.json), account every
    stream through its kind, and judge the run's invariants (testbed/run/invariants.py)."""
    plan, store = run.plan, run.store
    assert run.collector is not None
    snapshot = datapath_snapshot(plan) if has_port_programs(plan) else None
    if snapshot is not None:
        write_json(run.run_dir / "datapath.json", snapshot)
    udp_end = udp_errors(plan)
    host_errors = {h: sum(v.get(k, 0) - run.udp_start.get(h, {}).get(k, 0)
                          for k in ("RcvbufErrors", "NoPorts"))
                   for h, v in udp_end.items()}
    flow_drops = snapshot["flow_drops"] if snapshot else []
    # a part run's streams have an end on another VM: merge.py accounts them
    specs = [s for s, _ in run.agents] if run.options.part is None else []
    streams = stream_accounts(specs, run.results, flow_drops, view)
    if run.options.part is not None:
        write_json(run.agents_dir / "host_udp_errors.json", host_errors)
    last = {name: store.last_values(name) for name in
            ("class_drops", "class_packets", "backlog_packets", "tx_dropped", "wire_drops",
             "wire_backlog_packets")}
    applier = run.timeline[1] if run.timeline else None
    out = run.collector.invariants.finish(
        snapshot, last, streams, host_errors,
        link_losses=applier.link_losses() if applier else None,
        pfc_off=applier.pfc_off if applier else None, peaks_snapshot=run.peaks_snapshot)
    out["streams"] = streams
    out["host_socket_drops"] = {h: n for h, n in host_errors.items() if n}
    return out


def take_down(run: Run) -> None:
    if not run.options.keep_up:
        removed = destroy_lab(run.plan.lab)
        run.options.say(f"down: removed {len(removed)} namespaces")
    try:
        run.store.add_event(run.fabric_now_ns(), time.monotonic_ns(), "phase", phase="down")
    except (sqlite3.Error, OSError):
        pass    # the disk full (named by the watch): the fabric is down all the same


def write_summary(run: Run) -> dict:
    """summary.json (docs/run-format.md); the store is closed after it."""
    collector = run.collector
    overhead = collector.overhead_fraction() if collector else 0.0
    invariants = run.invariants
    summary = build_summary(
        name=run.loaded.fabric.name, plan=run.plan, store=run.store, run_dir=str(run.run_dir),
        duration_fabric_ns=max(0, run.fabric_now_ns()),
        duration_wall_s=time.monotonic() - run.t_start,
        interrupted=run.interrupted, fidelity=run.notes.items,
        extra={"collector": {"samples": collector.totals.samples if collector else 0,
                             "period_fabric_ns": run.period_ns,
                             "cpu_fraction_of_one_core": round(overhead, 4)},
               "results_complete": run.results_written,
               "failed": run.failed or None,
               **({"part": {"vm": run.options.part.part.vm,
                            "nodes": run.options.part.part.nodes,
                            "start_at_unix_ns": run.options.part.start_at_unix_ns,
                            "t0_realtime_ns": run.t0_realtime_ns,
                            "t0_mono_ns": run.t0_mono_ns}}
                  if run.options.part is not None else {}),
               "run_faults": [f.detail() | {"node": f.node, "ts_fabric_ns": f.ts_fabric_ns}
                              for f in (run.watch.faults if run.watch else [])],
               **({"invariants": {k: v for k, v in invariants.items() if k != "notes"}}
                  if invariants else {}),
               **({"pfc_reaction": {**run.pfc_reaction,
                                    "assumed_wall_ns": run.plan.dilation.pfc_loop_wall_ns}}
                  if run.pfc_reaction else {})})
    try:
        write_json(run.run_dir / "summary.json", summary)
    except OSError as exc:   # the disk full: the database and the output say what happened
        run.options.say(f"run: could not write summary.json ({exc}); the run's data is in "
                        "counters.sqlite")
    finally:
        try:
            run.store.close()
        except (sqlite3.Error, OSError) as exc:
            run.options.say(f"run: counters.sqlite could not be finished ({exc}); it holds "
                            "every sample written before, in time order")
    return summary


def write_report(run_dir: Path, say: Callable[[str], None]) -> None:
    try:
        paths = build_report(run_dir)
        say(f"report: {paths.html}")
    except Exception as exc:   # the run's data is safe; say why the report is missing
        say(f"report: could not be built ({exc}); rebuild with `testbed report {run_dir}`")


# A drain that outlasts this many times the configured drain (at least DRAIN_CAP_MIN_WALL_S,
# at most DRAIN_CAP_WALL_S) gives up.
DRAIN_CAP_FACTOR = 20
DRAIN_CAP_MIN_WALL_S = 20.0
DRAIN_CAP_WALL_S = 30.0


def drain_fabric(plan: Plan, stop: threading.Event, drain_ns: int,
                 should_end: Callable[[], bool] = lambda: False) -> list[str]:
    """Wait until no port program holds a queued byte; a note if that never happened.
    `should_end` (the run's watch) cuts the wait short when a fault ends the run."""
    if not has_port_programs(plan):
        return []
    dilation = plan.timebase
    probe = QueueProbe(plan)
    try:
        start = time.monotonic()
        cap_s = min(DRAIN_CAP_WALL_S, max(DRAIN_CAP_MIN_WALL_S,
                                          DRAIN_CAP_FACTOR * dilation.to_wall_s(drain_ns)))
        while not stop.is_set() and not should_end():
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


def has_port_programs(plan: Plan) -> bool:
    """Whether the port programs are attached (their pins exist for the first port)."""
    node = plan.nodes[0]
    return bool(node.interfaces) and pin_dir_of(plan.lab, node.name,
                                                node.interfaces[0].ifname).exists()
