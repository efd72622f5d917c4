"""Agents that are part of the fabric itself, not of a workload: PFC on every node, and
DCQCN around kernel Soft-RoCE on rxe hosts (agents/rxe_cc, docs/rxe-cc.md).

They start right after the fabric is built and before any traffic, and stop
after the workload; their control sockets and event files live in the
directory given (a run directory's agents/, or the lab's state directory
for `testbed up`). Each PFC agent also takes commands (the fault timeline's pfc,
rate and drain: testbed/run/timeline.py) on `pfc_command_socket(directory, node)`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agents.timebase import wall_timeout_s
from testbed.net.qdisc import HTB_PORT_CLASS
from testbed.net.rxe import device_name
from testbed.plan.model import ClassPlan, InterfacePlan, NodePlan, Plan
from testbed.run.collector import AgentEndpoint
from testbed.run.procs import AgentProcess, socket_path, start_process
from testbed.workloads.rdma import DEFAULT_CC_PRESETS

READY_TIMEOUT_S = 20.0
# SCHED_FIFO priority of the PFC agents (agents/pfc: their reaction time is headroom)
PFC_RT_PRIORITY = 10
DEFAULT_CNP_DSCP = 48
PORT_CLASSID = f"{HTB_PORT_CLASS >> 16:x}:{HTB_PORT_CLASS & 0xFFFF:x}"   # the classes' parent


def has_pfc(plan: Plan) -> bool:
    return any(c.pfc for n in plan.nodes for i in n.interfaces for c in i.egress.classes)


def watchdog_ns(plan: Plan) -> int:
    values = [c.pfc.watchdog_ns for n in plan.nodes for i in n.interfaces
              for c in i.egress.classes if c.pfc and c.pfc.watchdog_ns]
    return min(values) if values else 0


def pfc_command_socket(directory: Path, node: str, lab: str) -> str:
    """Where the PFC agent of `node` takes commands: `<directory>/<node>-pfc.cmd.sock`
    (in the lab's state directory when that path is too long for a UNIX socket)."""
    return socket_path(directory, f"{node}-pfc.cmd", lab)


def write_node_plans(plan_path: Path, directory: Path) -> dict[str, Path]:
    """The plan of `plan_path` cut to one node each, as `<directory>/<node>-pfc.plan.json`:
    every top-level field but `nodes` (and `links`), and `nodes` holding that node alone.

    A PFC agent reads its own node and the lab's fields; handed the whole plan, each of
    them parsed all of it (1.1 MB of JSON, some 10 MB of Python objects, at 128 hosts)
    for one node's 2-12 KB (bench/agent_memory.py)."""
    full = json.loads(plan_path.read_text())
    common = {k: v for k, v in full.items() if k not in ("nodes", "links")}
    out = {}
    for node in full["nodes"]:
        path = directory / f"{node['name']}-pfc.plan.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**common, "nodes": [node]}))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        out[node["name"]] = path
    return out


#: auto grouping (docs/pfc.md, "One process, several nodes"): a fabric of up to this many
#: nodes keeps one PFC process per node; a larger one groups them, at most
#: PFC_MAX_NODES_PER_PROCESS in a process
PFC_ONE_PER_NODE_UP_TO = 32
PFC_MAX_NODES_PER_PROCESS = 16


def pfc_groups(nodes: list[NodePlan], nodes_per_process: int | None = None,
               cpus: int | None = None) -> list[list[NodePlan]]:
    """The nodes each PFC agent process serves.

    `nodes_per_process` 1 is one process per node; N > 1 puts up to N nodes in each.
    None (auto): one process per node up to PFC_ONE_PER_NODE_UP_TO nodes (its memory is
    small there, and grouped processes showed a longer tail of pause reaction times:
    bench/pfc.py --compare, bench/README.md); above, one process per CPU, more once a
    process would serve more than PFC_MAX_NODES_PER_PROCESS nodes: a process runs on one
    CPU at a time, so more processes than CPUs buy no parallelism and each costs its
    interpreter (~11 MB PSS); the cap bounds how many nodes' events can queue behind
    one another in one wake-up. Switches are dealt first and round-robin, so every
    process gets its share of the switches (their events are what the reaction time is
    made of), then the hosts."""
    if nodes_per_process is not None and nodes_per_process < 1:
        raise ValueError(f"PFC nodes per process must be 1 or more, not {nodes_per_process}")
    if not nodes:
        return []
    if nodes_per_process is None and len(nodes) <= PFC_ONE_PER_NODE_UP_TO:
        processes = len(nodes)
    elif nodes_per_process is None:
        cpus = cpus or os.cpu_count() or 1
        processes = max(cpus, -(-len(nodes) // PFC_MAX_NODES_PER_PROCESS))
    else:
        processes = -(-len(nodes) // nodes_per_process)
    processes = min(processes, len(nodes))
    ordered = ([n for n in nodes if n.role == "switch"]
               + [n for n in nodes if n.role != "switch"])
    groups: list[list[NodePlan]] = [[] for _ in range(processes)]
    for i, node in enumerate(ordered):
        groups[i % processes].append(node)
    return groups


def start_pfc_agents(plan: Plan, plan_path: Path, directory: Path,
                     parent_watch: bool = True, nodes_per_process: int | None = None
                     ) -> list[tuple[AgentProcess, AgentEndpoint]]:
    """PFC agents for every node, grouped into processes by `pfc_groups`; returns one
    (process, endpoint) per node once every node is served. Nodes of one group share
    the Popen (a group process that dies takes all its nodes' PFC with it, and each
    node says so); every node keeps its own sockets, event file and counters."""
    out = []
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    node_plans = write_node_plans(plan_path, directory)
    common = ["--rt-priority", "0"] + ([] if parent_watch else ["--no-parent-watch"])
    for i, group in enumerate(pfc_groups(plan.nodes, nodes_per_process)):
        entries = []
        for node in group:
            ready = directory / f"{node.name}-pfc.ready"
            ready.unlink(missing_ok=True)
            entries.append({
                "node": node.name, "plan": str(node_plans[node.name]),
                "netns": f"/var/run/netns/{node.netns}",
                "control_sock": socket_path(directory, f"{node.name}-pfc", plan.lab),
                "command_sock": pfc_command_socket(directory, node.name, plan.lab),
                "events": str(directory / f"{node.name}-pfc.events.jsonl"),
                "ready_file": str(ready)})
        # Real-time priority is given below once every agent is listening: an agent that
        # is FIFO while the others still import can starve them on a slow 2-CPU machine.
        if len(group) == 1:
            e = entries[0]
            argv = [sys.executable, "-m", "agents.pfc", "--plan", e["plan"], "--node",
                    e["node"], "--control-sock", e["control_sock"], "--events", e["events"],
                    "--ready-file", e["ready_file"], "--watchdog-ns", str(watchdog_ns(plan)),
                    "--command-sock", e["command_sock"], *common]
            name = f"pfc-{group[0].name}"
        else:
            spec = directory / f"pfc-group{i}.json"
            spec.write_text(json.dumps({"watchdog_ns": watchdog_ns(plan), "nodes": entries},
                                       indent=1))
            os.chmod(spec, 0o600)
            argv = [sys.executable, "-m", "agents.pfc", "--group", str(spec), *common]
            # the lab state names the process after every node it serves (`testbed
            # down` ends it by pid like any agent)
            name = "pfc-" + "+".join(n.name for n in group)
        proc = start_process(plan.lab, group[0].netns, argv, name, keep_mounts=True)
        for node, e in zip(group, entries, strict=True):
            out.append((AgentProcess(f"pfc-{node.name}", node.netns, proc.popen),
                        AgentEndpoint(f"pfc-{node.name}", node.name, e["control_sock"],
                                      events_path=e["events"])))
    deadline = time.monotonic() + wall_timeout_s(READY_TIMEOUT_S)
    for proc, endpoint in out:
        ready = directory / f"{endpoint.node}-pfc.ready"
        while not ready.exists():
            if proc.popen.poll() is not None:
                _out, err = proc.popen.communicate()
                raise RuntimeError(f"PFC agent on {endpoint.node} exited: {err.strip()[-400:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"PFC agent on {endpoint.node} did not start in "
                                   f"{wall_timeout_s(READY_TIMEOUT_S):.0f} s")
            time.sleep(0.01)
    for pid in sorted({proc.popen.pid for proc, _endpoint in out}):
        # nsenter execs the agent: its pid is the agent's. Every thread of it, not the
        # main one alone: the socket servers' threads hold the GIL while they answer, and
        # one of them preempted at normal priority on a busy machine would hold the
        # loop off for as long (a group serves several nodes' sockets: bench/pfc.py).
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            tids = [pid]
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(PFC_RT_PRIORITY))
            except OSError:
                pass    # RT not allowed here (or the thread ended): normal priority
    return out


# --- DCQCN around rxe --------------------------------------------------------------------


@dataclass(frozen=True)
class RxeDcqcn:
    """The DCQCN parameters the rxe hosts' NICs run with (those of the RoCE kinds)."""

    preset: str = DEFAULT_CC_PRESETS["dcqcn"]
    overrides: tuple[tuple[str, object], ...] = ()


def rxe_dcqcn_of(traffic: list) -> RxeDcqcn | None:
    """DCQCN for the rxe hosts, from the workload's traffic entries: off (None) when an
    entry of the perftest kind says `cc: none`; its `cc_preset` / `cc_params` when it
    gives them, else the RoCE kinds' default preset. (An rxe host's NIC runs one DCQCN
    whatever runs over it, so the first perftest entry that says something decides.)"""
    for entry in traffic:
        if getattr(entry, "kind", None) != "perftest":
            continue
        cc = getattr(entry, "cc", "dcqcn")
        if cc == "none":
            return None
        if cc != "dcqcn":
            continue
        preset = getattr(entry, "preset", None) or getattr(entry, "cc_preset", None)
        overrides = entry.cc_overrides() if hasattr(entry, "cc_overrides") else {}
        return RxeDcqcn(preset or DEFAULT_CC_PRESETS["dcqcn"], tuple(sorted(overrides.items())))
    return RxeDcqcn()


def lossless_ecn_class(plan: Plan, iface: InterfacePlan) -> ClassPlan | None:
    """The NIC's class of the fabric's lossless traffic class with ECN (the one DCQCN
    rate-limits), if any. (The switches mark; a host NIC's class has no curve itself.)"""
    tcs = {t.tc for t in plan.traffic_classes if t.lossless and t.ecn}
    return next((c for c in iface.egress.classes if c.tc in tcs), None)


def rxe_cc_hosts(plan: Plan) -> list[NodePlan]:
    """rxe hosts whose NIC has a lossless class with ECN: those DCQCN runs for."""
    return [n for n in plan.hosts() if getattr(n, "endpoint", "transport") == "rxe"
            and n.interfaces and lossless_ecn_class(plan, n.interfaces[0]) is not None]


def cnp_dscp_of_plan(plan: Plan) -> int:
    for t in plan.traffic_classes:
        if t.name == "cnp" and t.dscp:
            return t.dscp[0]
    return DEFAULT_CNP_DSCP


def rxe_cc_argv(plan: Plan, node: NodePlan, dcqcn: RxeDcqcn) -> list[str]:
    """The rxe_cc agent's arguments for one host (NP and RP both: a host may receive and
    send): its NIC, the CNP's MACs and DSCP, the lossless class it rate-limits, DCQCN."""
    iface = node.interfaces[0]
    cls = lossless_ecn_class(plan, iface)
    if cls is None:
        raise ValueError(f"{node.name}: no lossless class with ECN on {iface.ifname}")
    peer = plan.node(iface.peer.node)
    gw_mac = next(i.mac for i in peer.interfaces if i.ifname == iface.peer.ifname)
    egress = iface.egress
    argv = ["--lab", plan.lab, "--node", node.name, "--ifname", iface.ifname, "--np", "--rp",
            "--dilation", str(plan.dilation.factor), "--dcqcn-preset", dcqcn.preset,
            "--line-rate-bps", str(egress.rate_bps), "--rxe-dev", device_name(plan.lab, node.name),
            "--gw-mac", gw_mac, "--cnp-dscp", str(cnp_dscp_of_plan(plan)),
            "--classid", cls.classid, "--parent", PORT_CLASSID, "--prio", str(cls.prio),
            "--wall-rate-bps", str(cls.wall_rate_bps), "--wall-ceil-bps", str(cls.wall_ceil_bps),
            "--burst-bytes", str(egress.burst_bytes), "--overhead-bytes",
            str(egress.overhead_bytes), "--quantum-bytes", str(egress.quantum_bytes),
            "--lossless-tc", str(cls.tc)]
    if dcqcn.overrides:
        argv += ["--cc-params", json.dumps(dict(dcqcn.overrides), sort_keys=True)]
    return argv


def rxe_cc_note(hosts: list[NodePlan], dcqcn: RxeDcqcn) -> str:
    """The fidelity note of a run whose rxe hosts run DCQCN around rxe."""
    names = ", ".join(h.name for h in hosts)
    return (f"rxe hosts ({names}) have no congestion control of their own: DCQCN "
            f"({dcqcn.preset}) is emulated around rxe, and its rate applies per HOST CLASS "
            "(the lossless class of each rxe host's NIC, an HTB ceil), not per QP: every QP "
            "of a host shares one rate; CNPs are sent at most once per CNP interval per QP, "
            "up to one agent poll late (docs/rxe-cc.md)")


def start_rxe_cc_agents(plan: Plan, directory: Path, dcqcn: RxeDcqcn,
                        parent_watch: bool = True
                        ) -> list[tuple[AgentProcess, AgentEndpoint]]:
    """The counter program on each rxe host's NIC and an rxe_cc agent beside it; returns
    once every agent is listening."""
    from testbed.net.rxecc import attach_rxe_cc

    out = []
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for node in rxe_cc_hosts(plan):
        attach_rxe_cc(plan.lab, node.name, node.netns, node.interfaces[0].ifname)
        sock = socket_path(directory, f"{node.name}-rxe-cc", plan.lab)
        events = directory / f"{node.name}-rxe-cc.events.jsonl"
        ready = directory / f"{node.name}-rxe-cc.ready"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "agents.rxe_cc", *rxe_cc_argv(plan, node, dcqcn),
                "--control-sock", str(sock), "--events", str(events), "--ready-file",
                str(ready)]
        if not parent_watch:
            argv.append("--no-parent-watch")
        proc = start_process(plan.lab, node.netns, argv, f"rxe-cc-{node.name}",
                             keep_mounts=True)
        out.append((proc, AgentEndpoint(f"rxe-cc-{node.name}", node.name, sock,
                                        events_path=str(events))))
    deadline = time.monotonic() + wall_timeout_s(READY_TIMEOUT_S)
    for proc, endpoint in out:
        ready = directory / f"{endpoint.node}-rxe-cc.ready"
        while not ready.exists():
            if proc.popen.poll() is not None:
                _out, err = proc.popen.communicate()
                raise RuntimeError(f"rxe_cc agent on {endpoint.node} exited: "
                                   f"{err.strip()[-400:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rxe_cc agent on {endpoint.node} did not start in "
                                   f"{wall_timeout_s(READY_TIMEOUT_S):.0f} s")
            time.sleep(0.01)
    return out
