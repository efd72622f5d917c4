"""`testbed up FILE`: build the fabric in network namespaces (`--dry-run`: print the plan).

`testbed up FILE --vms VMS.yaml --vm NAME` builds one VM's part of a fabric spread over
several VMs: its nodes, exactly as a single-VM build makes them, and a VXLAN tunnel end
for each link to another VM (docs/scale-out.md). `--vm` alone still means VM mode (the
whole run inside qemu with Debian's stock kernel)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from testbed.cli.common import (
    EXIT_OK,
    CliError,
    add_pfc_grouping_flag,
    load_and_plan,
    require_root,
    wide_console,
)
from testbed.cli.plan import part_of, print_plan_table, same_plan_everywhere
from testbed.cli.vmmode import add_vm_part_flags, require_kernel_features

if TYPE_CHECKING:     # testbed.net pulls in pyroute2: imported where a verb runs, not here
    from testbed.net import BuildReport
    from testbed.plan import Plan
    from testbed.plan.part import PartPlan


def add_parser(sub):
    p = sub.add_parser("up", help="build a fabric (idempotent); needs root")
    p.add_argument("file", nargs="?", help="fabric YAML file")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    add_vm_part_flags(p)
    add_pfc_grouping_flag(p)
    return p


def run(args) -> int:
    from testbed.net import BuildError, apply_plan

    part = None
    try:
        loaded, plan = load_and_plan(args.file)
        if args.vms:
            same_plan_everywhere(args.file, loaded)
            _, part = part_of(args.vms, args.vm, args.file, plan)
        if args.dry_run:
            print_plan_table(plan, wide_console())
            if part is not None:
                _print_part(part)
            return EXIT_OK
        require_root("up")
        require_kernel_features(plan, "up", args.file)
        report = apply_plan(plan, progress=lambda m: print(f"up: {m}", flush=True),
                            part=part, underlay_netns=args.underlay_netns)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    except BuildError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 1
    what = f"lab {plan.lab!r}" + (f" (VM {part.vm}'s part)" if part else "")
    if report.already_up:
        print(f"{what} is already up with this plan; nothing to do")
        return EXIT_OK
    pfc_note = _start_pfc(plan, report, args.pfc_nodes_per_process)
    total = sum(report.seconds.values())
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items())
    tunnels = f", {report.tunnels} VXLAN tunnels" if part else ""
    print(f"{what} is up: {report.namespaces} namespaces, {report.veth_pairs} links"
          f"{tunnels}, {report.routes} routes, {report.tc_requests} tc requests in "
          f"{total:.2f}s ({steps}); dilation D={plan.dilation.factor}")
    print(f"datapath: {report.datapath or 'none'}; {pfc_note}")
    print(f"flow order: {report.ordering}")
    print(f"link delay: {report.delay or 'none'}")
    print(f"namespaces: {plan.netns_prefix}*   tear down: testbed down {plan.lab}")
    return EXIT_OK


def _print_part(part: PartPlan) -> None:
    print(f"VM {part.vm}: nodes {' '.join(part.nodes)}; {len(part.local_links)} local "
          f"link(s); {len(part.tunnels)} tunnel(s), underlay MTU {part.underlay_mtu_bytes}")
    for t in part.tunnels:
        print(f"  link {t.link}: {t.local.node}:{t.local.ifname} -> {t.remote.vm} "
              f"{t.remote.node}:{t.remote.ifname}  vni {t.vni}  {t.local.underlay} -> "
              f"{t.remote.underlay}:{t.udp_port}")


def _start_pfc(plan: Plan, report: BuildReport, nodes_per_process: int | None = None) -> str:
    """PFC agents are part of the fabric: they outlive this command, `down` ends them.
    A part starts those of its own nodes, from the plan its lab recorded (which holds
    those nodes only)."""
    from testbed.net import LabState, load_lab_plan
    from testbed.run.fabric_agents import has_pfc, start_pfc_agents

    if not has_pfc(plan):
        return "no PFC class configured"
    if report.datapath != "bpf":
        return "PFC not running (no port programs)"
    state = LabState.load(plan.lab)
    built = load_lab_plan(plan.lab)
    if state is None or built is None:  # apply_plan wrote them just now: a `down` ran since
        return "PFC not started (the lab's state is gone; was it taken down?)"
    started = start_pfc_agents(built, state.plan_path, state.directory / "agents",
                               parent_watch=False, nodes_per_process=nodes_per_process)
    return (f"PFC agents on {len(started)} nodes (events in "
            f"{state.directory / 'agents'}/*-pfc.events.jsonl)")
