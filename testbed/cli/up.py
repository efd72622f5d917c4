"""`testbed up FILE`: build the fabric in network namespaces (`--dry-run`: print the plan)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from testbed.cli.common import (
    EXIT_OK,
    CliError,
    load_and_plan,
    require_root,
    wide_console,
)
from testbed.cli.plan import print_plan_table
from testbed.cli.vmmode import add_vm_flag, require_kernel_features

if TYPE_CHECKING:     # testbed.net pulls in pyroute2: imported where a verb runs, not here
    from testbed.net import BuildReport
    from testbed.plan import Plan


def add_parser(sub):
    p = sub.add_parser("up", help="build a fabric (idempotent); needs root")
    p.add_argument("file", help="fabric YAML file")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    add_vm_flag(p)
    return p


def run(args) -> int:
    from testbed.net import BuildError, apply_plan

    try:
        _, plan = load_and_plan(args.file)
        if args.dry_run:
            print_plan_table(plan, wide_console())
            return EXIT_OK
        require_root("up")
        require_kernel_features(plan, "up", args.file)
        report = apply_plan(plan, progress=lambda m: print(f"up: {m}", flush=True))
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    except BuildError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 1
    if report.already_up:
        print(f"lab {plan.lab!r} is already up with this plan; nothing to do")
        return EXIT_OK
    pfc_note = _start_pfc(plan, report)
    total = sum(report.seconds.values())
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items())
    print(f"lab {plan.lab!r} is up: {report.namespaces} namespaces, {report.veth_pairs} links, "
          f"{report.routes} routes, {report.tc_requests} tc requests in {total:.2f}s ({steps}); "
          f"dilation D={plan.dilation.factor}")
    print(f"datapath: {report.datapath or 'none'}; {pfc_note}")
    print(f"flow order: {report.ordering}")
    print(f"namespaces: {plan.netns_prefix}*   tear down: testbed down {plan.lab}")
    return EXIT_OK


def _start_pfc(plan: Plan, report: BuildReport) -> str:
    """PFC agents are part of the fabric: they outlive this command, `down` ends them."""
    from testbed.net import LabState
    from testbed.run.fabric_agents import has_pfc, start_pfc_agents

    if not has_pfc(plan):
        return "no PFC class configured"
    if report.datapath != "bpf":
        return "PFC not running (no port programs)"
    state = LabState.load(plan.lab)
    if state is None:       # apply_plan wrote it just now: a `down` ran in between
        return "PFC not started (the lab's state is gone; was it taken down?)"
    started = start_pfc_agents(plan, state.plan_path, state.directory / "agents",
                               parent_watch=False)
    return (f"PFC agents on {len(started)} nodes (events in "
            f"{state.directory / 'agents'}/*-pfc.events.jsonl)")
