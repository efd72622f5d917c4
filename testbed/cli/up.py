"""`testbed up FILE`: build the fabric in network namespaces (`--dry-run`: print the plan)."""

from __future__ import annotations

import sys

from testbed.cli.common import (
    EXIT_OK,
    CliError,
    load_and_plan,
    require_root,
    wide_console,
)
from testbed.cli.plan import print_plan_table


def add_parser(sub):
    p = sub.add_parser("up", help="build a fabric (idempotent); needs root")
    p.add_argument("file", help="fabric YAML file")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    return p


def run(args) -> int:
    from testbed.net import BuildError, apply_plan

    try:
        _, plan = load_and_plan(args.file)
        if args.dry_run:
            print_plan_table(plan, wide_console())
            return EXIT_OK
        require_root("up")
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
    total = sum(report.seconds.values())
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items())
    print(f"lab {plan.lab!r} is up: {report.namespaces} namespaces, {report.veth_pairs} links, "
          f"{report.routes} routes, {report.tc_requests} tc requests in {total:.2f}s ({steps}); "
          f"dilation D={plan.dilation.factor}")
    print(f"namespaces: {plan.netns_prefix}*   tear down: testbed down {plan.lab}")
    return EXIT_OK
