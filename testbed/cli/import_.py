"""`testbed import hpcc-ns3 CONFIG.txt [-o fabric.yaml]`: HPCC's ns-3 experiment -> a config.

The verb is `import`; the module is `import_` because `import` is a Python keyword.
The translation is testbed/interop/hpcc_ns3.py; this module only parses arguments,
writes the YAML and turns a refusal into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.cli.common import EXIT_OK, EXIT_USAGE
from testbed.interop.hpcc_ns3 import HpccImportError, translate

_DESCRIPTION = """\
Translate one of HPCC's ns-3 experiments (alibaba-edu/High-Precision-Congestion-Control:
a CONFIG.txt for scratch/third, and the TOPOLOGY_FILE and FLOW_FILE it names) into a
fabric config with explicit nodes and links and one `kind: flows` workload. Every HPCC
key that has no counterpart is listed in the output's header comment with what was done
instead (docs/hpcc-import.md has the table).

Relative file names inside CONFIG.txt (TOPOLOGY_FILE, FLOW_FILE, TRACE_FILE) are
resolved against the CURRENT WORKING DIRECTORY, as HPCC's third.cc opens them, not
against CONFIG.txt's directory: run the import from the directory HPCC's run.py runs
in (simulation/, the one holding mix/), e.g.
    cd High-Precision-Congestion-Control/simulation
    testbed import hpcc-ns3 mix/config.txt --cc dcqcn -o hpcc.yaml

CC_MODE 1 (DCQCN) and 8 (DCTCP) translate; 3 (HPCC), 7 (TIMELY) and 10 (HPCC-PINT)
are refused (exit 2) unless --cc names the congestion control to run instead."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "import", help="translate another tool's experiment into a fabric config "
                       "(hpcc-ns3: HPCC's ns-3 config.txt)",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tool", choices=("hpcc-ns3",), help="whose files: hpcc-ns3 (HPCC's ns-3)")
    p.add_argument("config", metavar="CONFIG.txt",
                   help="HPCC's config; the files it names are read relative to the working "
                        "directory")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the fabric YAML here (default: stdout)")
    p.add_argument("--cc", choices=("dcqcn", "dctcp"),
                   help="run this congestion control instead of the file's CC_MODE (needed "
                        "for CC_MODE 3, 7, 10; the file's DCQCN or DCTCP keys are used)")
    p.add_argument("--name", default="hpcc",
                   help="lab name of the generated config (default hpcc)")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        result = translate(args.config, cc_override=args.cc, lab=args.name)
    except HpccImportError as exc:
        print(f"testbed import: {exc}", file=sys.stderr)
        return EXIT_USAGE
    text = result.to_yaml()
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            print(f"testbed import: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
            return EXIT_USAGE
        print(f"{args.output}: written from {args.config} "
              f"({len(result.config['workload']['traffic'][0]['flows'])} flows)",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK
