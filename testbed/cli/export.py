"""`testbed export mininet FILE -o topo.py`: write a fabric as another tool's topology."""

from __future__ import annotations

import sys
from pathlib import Path

from testbed.cli.common import EXIT_OK, EXIT_USAGE, CliError, load_and_plan
from testbed.export.mininet_topo import export_mininet, mininet_dilation, topo_name

FORMATS = ["mininet"]


def add_parser(sub):
    p = sub.add_parser("export", help="write a fabric as a Mininet topology module (no root)")
    p.add_argument("format", choices=FORMATS, help="the tool to export to")
    p.add_argument("file", help="fabric YAML file")
    p.add_argument("-o", "--output", required=True, help="file to write (topo.py)")
    return p


def run(args) -> int:
    try:
        _, plan = load_and_plan(args.file)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    out = Path(args.output)
    try:
        out.write_text(export_mininet(plan, source=Path(args.file).name))
    except (OSError, ValueError) as exc:
        print(f"export: cannot write {out}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    d = mininet_dilation(plan)
    print(f"wrote {out}: Mininet topology {topo_name(plan)!r}, D={d}"
          + ("" if d == plan.dilation.factor else f" (the plan's is {plan.dilation.factor}; "
             "Mininet caps a link at 1000 Mbit/s)"))
    print(f"run it: sudo mn --custom {out} --topo {topo_name(plan)} --controller none "
          "--test fabricping")
    return EXIT_OK
