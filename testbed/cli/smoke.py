"""`testbed smoke [FILE]`: build a fabric, prove it forwards, print counters, tear it down.

Checks: UDP echo between every ordered pair of hosts; a stream sent above a
host's line rate arrives at the PHY-derived dilated rate; flows with
different source ports spread over the first leaf's uplinks (ECMP).
"""

from __future__ import annotations

import sys
import tempfile

from rich.table import Table

from testbed.cli.common import (
    EXIT_OK,
    CliError,
    load_and_plan,
    positive_seconds,
    require_root,
    wide_console,
)
from testbed.cli.vmmode import add_vm_flag, require_kernel_features
from testbed.units import format_rate

DEFAULT_CONFIG = "configs/default.yaml"


def add_parser(sub):
    p = sub.add_parser("smoke", help="up + reachability + line rate + ECMP check + down")
    p.add_argument("file", nargs="?", default=DEFAULT_CONFIG,
                   help=f"fabric YAML file (default {DEFAULT_CONFIG})")
    p.add_argument("--keep", action="store_true", help="leave the fabric up afterwards")
    p.add_argument("--seconds", type=positive_seconds, default=3.0,
                   help="wall seconds of the rate test")
    add_vm_flag(p)
    return p


def run(args) -> int:
    from testbed.net import apply_plan, destroy_lab
    from testbed.run import smoke

    console = wide_console()
    try:
        _, plan = load_and_plan(args.file)
        require_root("smoke")
        require_kernel_features(plan, "smoke", args.file)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    hosts = [h.name for h in plan.hosts()]
    if len(hosts) < 2:
        print("smoke: the fabric needs at least two hosts", file=sys.stderr)
        return 2
    failures: list[str] = []
    report = apply_plan(plan, progress=lambda m: console.print(f"up: {m}"))
    console.print(f"[bold]up[/]: lab {plan.lab!r}, {len(plan.nodes)} namespaces, dilation "
                  f"D={plan.dilation.factor} ({plan.dilation.mode}) in "
                  f"{sum(report.seconds.values()):.2f}s")
    try:
        with tempfile.TemporaryDirectory(prefix="tb-smoke-") as tmp:
            pairs = smoke.reachability(plan, tmp)
            bad = [p for p, r in pairs.items() if r.get("replies", 0) != r.get("count", -1)]
            rtts = [r["rtt_fabric_ns"]["avg"] for r in pairs.values() if r.get("replies")]
            mean_rtt_us = sum(rtts) / max(1, len(rtts)) / 1e3
            console.print(f"[bold]reachability[/]: {len(pairs) - len(bad)}/{len(pairs)} ordered "
                          f"host pairs answer UDP echo; mean RTT {mean_rtt_us:.1f} us fabric")
            if bad:
                failures.append(f"no echo for {len(bad)} pairs, e.g. {bad[:3]}")

            src, dst = hosts[0], hosts[-1]
            before = smoke.link_tx_bytes(plan)
            res = smoke.stream(plan, src, dst, tmp, wall_seconds=args.seconds, flows=16)
            after = smoke.link_tx_bytes(plan)
            console.print(
                f"[bold]line rate[/]: {src} -> {dst} sent at 1.1x line rate; received "
                f"{format_rate(res.receiver.get('fabric_bps', 0))} fabric "
                f"({format_rate(res.receiver.get('wall_bps', 0))} wall) of "
                f"{format_rate(res.expected_fabric_bps)} expected: {res.ratio:.3f}x")
            if abs(res.ratio - 1) > 0.05:
                failures.append(f"line rate off by {100 * (res.ratio - 1):+.1f} %")
            leaf = plan.node(src).interfaces[0].peer.node
            spread = smoke.uplink_spread(plan, before, after, leaf)
            if spread:
                console.print(f"[bold]ECMP[/]: 16 flows over {leaf}'s uplinks: " + ", ".join(
                    f"{k} {v / 1e6:.2f} MB" for k, v in spread.items()))
                if sum(1 for v in spread.values() if v > 0.1 * sum(spread.values())) < 2:
                    failures.append(f"ECMP did not spread flows over {leaf}'s uplinks")

        from testbed.net.counters import read_counters

        ifaces, _ = read_counters(plan)
        table = Table(title="interface counters (busiest 12)")
        for col in ("node", "port", "tx bytes", "tx packets", "rx bytes", "drops"):
            table.add_column(col, justify="left" if col in ("node", "port") else "right")
        for c in sorted(ifaces, key=lambda c: -c.tx_bytes)[:12]:
            table.add_row(c.node, c.ifname, f"{c.tx_bytes:,}", f"{c.tx_packets:,}",
                          f"{c.rx_bytes:,}", str(c.tx_dropped + c.rx_dropped))
        console.print(table)
    finally:
        if not args.keep:
            removed = destroy_lab(plan.lab)
            console.print(f"[bold]down[/]: removed {len(removed)} namespaces")
    if failures:
        for f in failures:
            console.print(f"[red]FAIL[/]: {f}")
        return 1
    console.print("[green]smoke: all checks passed[/]")
    return EXIT_OK
