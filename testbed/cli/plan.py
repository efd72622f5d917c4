"""`testbed plan FILE`: compile a config into the plan `up` would apply; with `--vms
VMS.yaml`, also how it is spread over those VMs (testbed/plan/partition.py)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from testbed.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    add_format,
    load_and_plan,
    wide_console,
)
from testbed.config import ConfigError
from testbed.config.vms import check_vms_for_fabric, load_vms
from testbed.net.probe import kernel_config_has
from testbed.plan import Plan
from testbed.plan.part import PartPlan, part_plan
from testbed.plan.partition import Placement, partition
from testbed.units import format_duration, format_rate, format_size


def add_parser(sub):
    p = sub.add_parser("plan", help="print the plan a config compiles to (no root needed)")
    p.add_argument("file", help="fabric YAML file")
    p.add_argument("--vms", metavar="VMS.yaml",
                   help="spread the fabric over these VMs: show each node's VM, the VXLAN "
                        "tunnels of the links that cross VMs and each VM's share of the load "
                        "(--format json: the placement alone; docs/scale-out.md)")
    add_format(p)
    return p


def print_plan_table(plan: Plan, console: Console) -> None:
    d = plan.dilation
    console.print(f"lab [bold]{plan.lab}[/]: {len(plan.hosts())} hosts, {len(plan.switches())} "
                  f"switches, {len(plan.links)} links, MTU {plan.mtu_bytes}, RoCE MTU "
                  f"{plan.roce_mtu_bytes}")
    console.print(f"dilation D={d.factor} ({d.mode}): busiest port "
                  f"{format_rate(d.busiest_port_bps)}"
                  f" -> {format_rate(d.busiest_wall_port_bps)} wall")
    console.print(f"  why: {escape(d.why())}", soft_wrap=True)
    links = Table(title="links", show_lines=False)
    for col in ("#", "a", "b", "subnet", "port type", "length", "rate", "wall rate", "delay",
                "wall delay", "frame loss"):
        links.add_column(col)
    for link in plan.links:
        links.add_row(str(link.index), f"{link.a.node}:{link.a.ifname}",
                      f"{link.b.node}:{link.b.ifname}", link.subnet, link.port_type,
                      f"{link.length_m:g}m", format_rate(link.rate_bps),
                      format_rate(link.wall_rate_bps), format_duration(link.delay_ns),
                      format_duration(link.wall_delay_ns), f"{link.frame_loss_ratio:.2g}")
    console.print(links)
    first = plan.nodes[0].interfaces[0] if plan.nodes and plan.nodes[0].interfaces else None
    if first is not None:
        qos = Table(title=f"traffic classes on {plan.nodes[0].name}:{first.ifname}")
        for col in ("tc", "name", "dscp", "htb class", "prio", "buffer", "ECN kmin/kmax/pmax",
                    "PFC xoff/xon/headroom"):
            qos.add_column(col)
        for c in first.egress.classes:
            ecn = (f"{format_size(c.ecn.kmin_bytes)}/{format_size(c.ecn.kmax_bytes)}/{c.ecn.pmax:g}"
                   if c.ecn else "-")
            pfc = (f"{format_size(c.pfc.xoff_bytes)}/{format_size(c.pfc.xon_bytes)}/"
                   f"{format_size(c.pfc.headroom_bytes)}" if c.pfc else "-")
            qos.add_row(str(c.tc), c.name, ",".join(map(str, c.dscp)) or "(default)", c.classid,
                        str(c.prio), format_size(c.limit_bytes), ecn, pfc)
        console.print(qos)
    console.print(f"note: {delay_note(kernel_has_netem())}")
    for warning in plan.warnings:
        console.print(f"[yellow]warning[/]: {escape(warning)}")


def kernel_has_netem() -> bool | None:
    """netem and IFB in the running kernel's build (None: cannot tell without root)."""
    found = [kernel_config_has(f) for f in ("netem", "ifb")]
    if all(found):
        return True
    return None if None in found and False not in found else False


def delay_note(has_netem: bool | None) -> str:
    """What `up` will do with the links' propagation and FEC delays on this kernel."""
    if has_netem:
        return ("link propagation and FEC delays (dilated) and PHY loss are emulated by netem "
                "at each port's peer ingress (this kernel has sch_netem and IFB)")
    if has_netem is None:
        return ("link propagation and FEC delays are emulated by netem where the kernel has "
                "sch_netem and IFB (`testbed probe` says); without them a base RTT on the "
                "fabric is shorter than these delays make it (`--vm` has them)")
    return ("link propagation and FEC delays are not emulated (this kernel has no sch_netem "
            "or no IFB): a base RTT on the fabric is shorter than these delays make it; "
            "`--vm` runs on a kernel that has them")


def print_placement_table(placement: Placement, console: Console) -> None:
    p = placement
    console.print(f"placement over {len(p.vms)} VMs ({p.algorithm}): {p.cut_links} link(s) "
                  f"cut, {format_rate(p.cut_wall_bps)} of wall rate through tunnels; underlay "
                  f"MTU {p.underlay_mtu_bytes} needed (fabric MTU {p.fabric_mtu_bytes} + "
                  f"{p.vxlan_overhead_bytes} VXLAN)")
    vms = Table(title="VMs: share of the load (wall rate)")
    for col in ("vm", "underlay", "cores", "nodes", "node ports", "tunnel ends", "load",
                "share", "target", "budget", "use"):
        vms.add_column(col)
    for vm in p.vms:
        vms.add_row(vm.name, vm.underlay, str(vm.cores), f"{len(vm.nodes)}/{vm.node_room}",
                    format_rate(vm.node_wall_bps), format_rate(vm.tunnel_wall_bps),
                    format_rate(vm.load_wall_bps), f"{vm.share:.0%}",
                    format_rate(vm.target_wall_bps), format_rate(vm.budget_wall_bps),
                    f"{vm.utilisation:.0%}")
    console.print(vms)
    nodes = Table(title="placement")
    for col in ("vm", "nodes"):
        nodes.add_column(col)
    for vm in p.vms:
        nodes.add_row(vm.name, " ".join(vm.nodes) or "-")
    console.print(nodes)
    if p.tunnels:
        tunnels = Table(title=f"VXLAN tunnels (UDP {p.tunnels[0].udp_port})")
        for col in ("#", "a", "b", "vms", "vni", "underlay", "wall rate"):
            tunnels.add_column(col)
        for t in p.tunnels:
            tunnels.add_row(str(t.link), f"{t.a.node}:{t.a.ifname}", f"{t.b.node}:{t.b.ifname}",
                            f"{t.a.vm} - {t.b.vm}", str(t.vni),
                            f"{t.a.underlay} - {t.b.underlay}",
                            format_rate(t.a.wall_rate_bps))
        console.print(tunnels)
    for warning in p.warnings:
        console.print(f"[yellow]warning[/]: {escape(warning)}")


def placement_of(vms_path: str, fabric_path: str, plan: Plan) -> Placement:
    """The placement of `plan` over the VMs file's VMs; its problems printed one a line
    and CliError (exit 2)."""
    try:
        loaded = load_vms(vms_path)
        check_vms_for_fabric(loaded, fabric_file=fabric_path, fabric_mtu_bytes=plan.mtu_bytes,
                             roce_mtu_bytes=plan.roce_mtu_bytes, n_links=len(plan.links),
                             n_nodes=len(plan.nodes))
    except ConfigError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        raise CliError(f"{len(exc.problems)} problem(s) in {vms_path}", EXIT_USAGE) from None
    return partition(plan, loaded.vms_file, fabric_file=fabric_path)


def same_plan_everywhere(fabric_path: str, loaded) -> None:
    """Every VM must build from one plan: `dilation: auto` takes D from this machine's
    calibrated budget unless the fabric gives `max_wall_port_rate`. CliError (exit 2)."""
    fabric = loaded.fabric
    if fabric.dilation == "auto" and fabric.max_wall_port_rate_bps is None:
        raise CliError(
            f"{fabric_path}: dilation: auto picks D from each machine's own calibration, so "
            "VMs could build different plans; give the fabric a fixed `dilation:` or a "
            "`max_wall_port_rate:` (the slowest VM's calibrated per-port budget; `testbed "
            f"plan {fabric_path}` shows the D this machine picks)", EXIT_USAGE)


def part_of(vms_path: str, vm: str, fabric_path: str,
            plan: Plan) -> tuple[Placement, PartPlan]:
    """The placement of `plan` over the VMs file's VMs, and VM `vm`'s part of it; CliError
    (exit 2) for a bad VMs file or a VM it does not name."""
    placement = placement_of(vms_path, fabric_path, plan)
    try:
        return placement, part_plan(plan, placement, vm)
    except ValueError as exc:
        raise CliError(f"{vms_path}: {exc}", EXIT_USAGE) from None


def run(args) -> int:
    try:
        _, plan = load_and_plan(args.file)
        placement = placement_of(args.vms, args.file, plan) if args.vms else None
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    if args.format == "json":
        sys.stdout.write(placement.to_json() if placement else plan.to_json())
    else:
        console = wide_console()
        print_plan_table(plan, console)
        if placement is not None:
            print_placement_table(placement, console)
    return EXIT_OK
