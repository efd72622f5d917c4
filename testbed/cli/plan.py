"""`testbed plan FILE`: compile a config into the plan `up` would apply."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from testbed.cli.common import EXIT_OK, CliError, add_format, load_and_plan, wide_console
from testbed.net.probe import kernel_config_has
from testbed.plan import Plan
from testbed.units import format_duration, format_rate, format_size


def add_parser(sub):
    p = sub.add_parser("plan", help="print the plan a config compiles to (no root needed)")
    p.add_argument("file", help="fabric YAML file")
    add_format(p)
    return p


def print_plan_table(plan: Plan, console: Console) -> None:
    d = plan.dilation
    console.print(f"lab [bold]{plan.lab}[/]: {len(plan.hosts())} hosts, {len(plan.switches())} "
                  f"switches, {len(plan.links)} links, MTU {plan.mtu_bytes}, RoCE MTU "
                  f"{plan.roce_mtu_bytes}")
    console.print(f"dilation D={d.factor} ({d.mode}): busiest port "
                  f"{format_rate(d.busiest_port_bps)}"
                  f" -> {format_rate(d.busiest_wall_port_bps)} wall "
                  f"(budget {format_rate(d.max_wall_port_rate_bps)})")
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


def run(args) -> int:
    try:
        _, plan = load_and_plan(args.file)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    if args.format == "json":
        sys.stdout.write(plan.to_json())
    else:
        print_plan_table(plan, wide_console())
    return EXIT_OK
