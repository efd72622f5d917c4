"""`testbed phy`: evaluate one link's PHY, or list the port-type catalogue."""

from __future__ import annotations

import argparse
import json
import sys

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from testbed.cli.common import CliError, check_arg
from testbed.config.models import Fabric, Link
from testbed.phy import PORT_TYPES, PhyResult, UnknownPortType, evaluate
from testbed.units import UnitError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "phy",
        help="evaluate a link's PHY (rate, delay, BER, frame loss, power) or list port types",
        description="Evaluate one link of PORT_TYPE and LENGTH with the PHY model "
                    "(docs/phy.md), or list the catalogue with --list.",
    )
    p.add_argument("port_type", nargs="?", metavar="PORT_TYPE",
                   help="IEEE 802.3 port type, e.g. 400GBASE-DR4")
    p.add_argument("--length", "-l", metavar="LEN", help="link length, e.g. 2m, 100m, 2km")
    p.add_argument("--mtu", metavar="BYTES", default="9000",
                   help="frame size for the frame-loss ratio (default 9000)")
    p.add_argument("--format", choices=("table", "json"), default="table",
                   help="output format (default table)")
    p.add_argument("--list", action="store_true", help="list the known port types")
    return p


def run(args: argparse.Namespace) -> int:
    if args.list:
        _print_catalogue(args.format)
        return 0
    if not args.port_type:
        return _fail("give a PORT_TYPE and --length (or --list to see the port types)")
    if args.length is None:
        return _fail(f"--length is required, e.g. testbed phy {args.port_type} --length 2m")
    try:
        length_m = check_arg("--length", args.length, Link, "length_m")
        mtu_bytes = check_arg("--mtu", args.mtu, Fabric, "mtu_bytes")
    except CliError as exc:
        return _fail(str(exc))
    try:
        result = evaluate(args.port_type, length_m, mtu_bytes)
    except (UnitError, UnknownPortType, ValueError) as exc:
        return _fail(str(exc))
    if args.format == "json":
        print(json.dumps(result.to_dict(), sort_keys=True, indent=2))
    else:
        _print_result(result)
    return 0


def _fail(message: str) -> int:
    print(f"testbed phy: {message}", file=sys.stderr)
    return 2


def _console() -> Console:
    return Console(file=sys.stdout, highlight=False, soft_wrap=False)


def _g(x: float) -> str:
    return f"{x:g}"


def _exact(x: float) -> str:
    """25.78125 stays 25.78125 (':g' would round it to 25.7812)."""
    return repr(float(x)).removesuffix(".0")


def _sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def _print_result(r: PhyResult) -> None:
    table = Table(title=escape(f"{r.port_type}, {_g(r.length_m)} m"), show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value")
    reach = "within" if r.within_reach else "BEYOND"
    rows = [
        ("medium", r.medium),
        ("lanes", f"{r.lanes} x {_exact(r.lane_rate_gbps)} Gb/s"),
        ("modulation", f"{r.modulation}, {r.bits_per_symbol} bit/symbol, {_exact(r.baud_gbd)} GBd"),
        ("raw rate", f"{_exact(r.raw_rate_gbps)} Gb/s"),
        ("FEC", f"{r.fec}, corrects {r.fec_t} symbols/codeword"),
        ("FEC threshold BER", _sci(r.fec_ber_threshold)),
        ("MAC rate", f"{_g(r.mac_rate_gbps)} Gb/s"),
        ("propagation delay", f"{r.propagation_delay_ns:.1f} ns"),
        ("FEC/DSP delay", f"{r.fec_delay_ns:.1f} ns"),
        ("one-way delay", f"{r.delay_ns:.1f} ns"),
        ("modulation SNR penalty", f"{r.snr_penalty_db:.2f} dB"),
        ("insertion loss", f"{r.insertion_loss_db:.2f} dB"),
        ("margin to FEC threshold", f"{r.fec_margin_db:+.2f} dB"),
        ("pre-FEC BER", _sci(r.pre_fec_ber)),
        ("RS symbol error ratio", _sci(r.symbol_error_ratio)),
        ("post-FEC codeword error", _sci(r.post_fec_codeword_error)),
        (f"frame loss ({r.mtu_bytes} B MTU)",
         f"{_sci(r.frame_loss_ratio)} ({r.codewords_per_frame} codewords/frame)"),
        ("power", f"{_g(r.power_w)} W per end, {_g(r.link_power_w)} W per link"),
        ("reach", f"{_g(r.max_reach_m)} m ({reach})"),
    ]
    for name, value in rows:
        table.add_row(escape(name), escape(value))
    console = _console()
    console.print(table)
    for warning in r.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")


def _print_catalogue(fmt: str) -> None:
    if fmt == "json":
        out = [
            {"port_type": p.name, "medium": p.medium, "lanes": p.lanes,
             "modulation": p.modulation, "lane_rate_gbps": p.lane_rate_gbps,
             "baud_gbd": p.baud_gbd, "mac_rate_gbps": p.mac_rate_gbps, "fec": p.fec.name,
             "max_reach_m": p.max_reach_m, "power_w": p.power_w, "standard": p.standard}
            for p in PORT_TYPES.values()
        ]
        print(json.dumps(out, sort_keys=True, indent=2))
        return
    table = Table(title="PHY port types", box=box.SIMPLE_HEAD)
    for col in ("port type", "medium", "lanes", "MAC", "FEC", "reach", "W/end"):
        table.add_column(col, no_wrap=True,
                         justify="right" if col in ("MAC", "reach", "W/end") else "left")
    for p in PORT_TYPES.values():
        table.add_row(
            escape(p.name), p.medium, f"{p.lanes} x {_exact(p.lane_rate_gbps)}G {p.modulation}",
            f"{p.mac_rate_gbps:g}G", p.fec.short, f"{_g(p.max_reach_m)} m", _g(p.power_w),
        )
    _console().print(table)
