"""`testbed validate FILE`: check a config (and that it compiles to a plan)."""

from __future__ import annotations

import sys

from testbed.cli.common import EXIT_OK, CliError, load_and_plan


def add_parser(sub):
    p = sub.add_parser("validate", help="check a fabric config; all problems at once, exit 2")
    p.add_argument("file", help="fabric YAML file")
    return p


def run(args) -> int:
    try:
        _, plan = load_and_plan(args.file)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    for warning in plan.warnings:
        print(f"{args.file}: warning: {warning}", file=sys.stderr)
    hosts, switches = len(plan.hosts()), len(plan.switches())
    print(f"{args.file}: ok: lab {plan.lab!r}, {hosts} hosts, {switches} switches, "
          f"{len(plan.links)} links, dilation {plan.dilation.factor} ({plan.dilation.mode})")
    return EXIT_OK
