"""Command-line entry point: wires one module per verb, and nothing else.

Each verb module has `add_parser(sub)` and `run(args) -> int`; it parses its
arguments and calls the pipeline, and holds no logic a test would want to
call directly. Exit codes:
0 success, 1 operational failure, 2 bad input (config or arguments).
"""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS = ["validate", "phy", "plan", "probe", "up", "down", "status", "smoke", "run", "report",
         "calibrate", "incident", "compare", "import", "export", "mininet", "merge"]
# A verb whose module name differs: `import` is a Python keyword.
MODULES = {"import": "import_"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="testbed",
        description="Emulate a lossless RoCEv2 fabric on Linux namespaces.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERBS:
        module = importlib.import_module(f"testbed.cli.{MODULES.get(name, name)}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    normalize = getattr(args, "_normalize", None)
    if normalize is not None:       # a verb whose flags argparse alone cannot tell apart
        normalize(parser, args)
    try:
        if getattr(args, "vm", False) is True:
            from testbed.cli.vmmode import run_in_vm_mode

            return run_in_vm_mode(args, argv)
        return args._run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
