"""`testbed status [NAME]`: labs that are up; with NAME, the lab's port counters."""

from __future__ import annotations

import sys

from rich.table import Table

from testbed.cli.common import EXIT_OK, CliError, add_format, lab_name_arg, print_json, wide_console


def add_parser(sub):
    p = sub.add_parser("status", help="list labs; with a name, show its port counters")
    p.add_argument("name", nargs="?", help="lab name for per-port counters")
    add_format(p)
    return p


def _labs() -> dict:
    from testbed.net import list_states
    from testbed.net.namespaces import exists, list_testbed_namespaces

    labs = []
    owned: set[str] = set()
    for state in list_states():
        present = [ns for ns in state.netns if exists(ns)]
        owned.update(state.netns)
        labs.append({"lab": state.lab, "status": state.status, "namespaces": len(state.netns),
                     "namespaces_present": len(present), "builder_pid": state.builder_pid,
                     "run_dir": state.run_dir})
    leftovers = [ns for ns in list_testbed_namespaces() if ns not in owned]
    return {"labs": labs, "leftover_namespaces": leftovers}


def run(args) -> int:
    from testbed.net import load_lab_plan

    console = wide_console()
    if args.name:
        try:
            lab_name_arg(args.name)
        except CliError as exc:
            print(f"status: {exc}", file=sys.stderr)
            return exc.code
        plan = load_lab_plan(args.name)
        if plan is None:
            print(f"status: no lab {args.name!r} is up", file=sys.stderr)
            return 1
        from testbed.net.counters import counters_as_dicts

        data = counters_as_dicts(plan)
        if args.format == "json":
            print_json({"lab": args.name, **data})
            return EXIT_OK
        table = Table(title=f"lab {args.name}: egress classes")
        for col in ("node", "port", "tc", "bytes", "packets", "drops", "backlog"):
            table.add_column(col, justify="right" if col not in ("node", "port") else "left")
        for c in data["classes"]:
            table.add_row(c["node"], c["ifname"], str(c["tc"]), str(c["bytes"]),
                          str(c["packets"]), str(c["drops"]), str(c["backlog_bytes"]))
        console.print(table)
        return EXIT_OK
    data = _labs()
    if args.format == "json":
        print_json(data)
        return EXIT_OK
    if not data["labs"]:
        print("no labs are up")
    else:
        table = Table(title="labs")
        for col in ("lab", "status", "namespaces", "builder pid"):
            table.add_column(col)
        for lab in data["labs"]:
            table.add_row(lab["lab"], lab["status"],
                          f"{lab['namespaces_present']}/{lab['namespaces']}",
                          str(lab["builder_pid"]))
        console.print(table)
    if data["leftover_namespaces"]:
        print(f"leftover namespaces (no lab owns them; `testbed down --all` removes them): "
              f"{', '.join(data['leftover_namespaces'])}")
    return EXIT_OK
