"""`testbed calibrate`: measure this machine's per-port wall-rate budget for `dilation: auto`."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict

from testbed.cli.common import (
    EXIT_OK,
    CliError,
    even_host_count,
    positive_seconds,
    require_root,
)
from testbed.cli.vmmode import add_vm_flag


def add_parser(sub):
    p = sub.add_parser("calibrate", help="measure the wall rate this machine sustains with "
                       "fidelity; store it as the budget dilation: auto uses")
    p.add_argument("--hosts", type=even_host_count, default=4,
                   help="hosts in the trial fabric (even)")
    p.add_argument("--seconds", type=positive_seconds, default=2.0,
                   help="wall seconds per trial")
    p.add_argument("--dry-run", action="store_true", help="measure, do not store")
    add_vm_flag(p)
    return p


def run(args) -> int:
    from testbed.run.calibrate import calibrate
    from testbed.run.calibration import save_budget

    try:
        require_root("calibrate")
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    if args.hosts < 2 or args.hosts % 2:
        print("calibrate: --hosts must be an even number >= 2", file=sys.stderr)
        return 2
    budget, trials = calibrate(args.hosts, args.seconds)
    loaded_ports = args.hosts * 2        # every host NIC and every switch port carry a stream
    data = {"max_wall_port_rate_bps": budget,
            "aggregate_wall_bps": budget * loaded_ports,
            "measured_unix": time.time(), "hosts": args.hosts,
            "trials": [asdict(t) for t in trials]}
    print(f"calibrate: budget {budget / 1e6:g} Mb/s per port "
          f"({budget * loaded_ports / 1e9:.2f} Gb/s aggregate over {loaded_ports} ports)")
    if not args.dry_run:
        path = save_budget(data)
        where = " in VM runs (--vm)" if os.environ.get("TESTBED_VM") == "1" else ""
        print(f"calibrate: stored in {path}; `dilation: auto` now uses it{where}")
    return EXIT_OK
