"""`testbed calibrate`: measure what this machine carries (the capacity `dilation: auto`
uses, and the per-port wall-rate budget a config may pin) and store it."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict

from testbed.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    CliError,
    even_host_count,
    positive_seconds,
    require_root,
)
from testbed.cli.vmmode import add_vm_flag


def add_parser(sub):
    p = sub.add_parser("calibrate", help="measure what this machine carries (packets through "
                       "a hop per core, each agent kind's cost per packet, the per-port "
                       "wall-rate budget); store it for dilation: auto")
    p.add_argument("--hosts", type=even_host_count, default=4,
                   help="hosts in the trial fabric (even)")
    p.add_argument("--seconds", type=positive_seconds, default=2.0,
                   help="wall seconds per trial")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the capacity trials; the medians are kept (default 3)")
    p.add_argument("--dry-run", action="store_true", help="measure, do not store")
    p.add_argument("--only", choices=("capacity", "budget"), default=None,
                   help="measure only the capacity (hops and agents) or only the per-port "
                        "budget (default: both)")
    add_vm_flag(p)
    return p


def run(args) -> int:
    from testbed.run.calibrate import TrialFailed, calibrate, measure_capacity
    from testbed.run.calibration import (
        CalibrationError,
        calibration_path,
        read_calibration,
        save_budget,
    )

    try:
        require_root("calibrate")
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    if args.hosts < 2 or args.hosts % 2:
        print("calibrate: --hosts must be an even number >= 2", file=sys.stderr)
        return 2
    data: dict = {"measured_unix": time.time()}
    if args.only != "budget":
        try:
            cap = measure_capacity(args.seconds, args.rounds)
        except TrialFailed as exc:
            print(f"calibrate: {exc}; nothing stored", file=sys.stderr)
            return EXIT_FAIL
        data["capacity"] = {
            "hop_pps_per_core": round(cap.hop_pps_per_core, 1), "cores": cap.cores,
            "agents": {k: {"send_core_s": v / 2, "recv_core_s": v / 2}
                       for k, v in cap.agent_core_s.items()}
            | {"pfc": {"note": "woken by pause events, not packets: its per-packet work "
                               "is the port program's, inside the hop cost"}},
            "measured_unix": time.time(), "trials": [asdict(t) for t in cap.trials],
            "notes": cap.notes}
        print(f"calibrate: a hop costs {cap.hop_core_s * 1e6:.2f} us of CPU "
              f"({cap.hop_pps_per_core:,.0f} packets/s per core); per packet sent and "
              "received: " + ", ".join(f"{k} {v * 1e6:.1f} us"
                                       for k, v in cap.agent_core_s.items())
              + f"; {cap.cores} cores")
        for note in cap.notes:
            print(f"calibrate: note: {note}")
    if args.only != "capacity":
        budget, trials = calibrate(args.hosts, args.seconds)
        loaded_ports = args.hosts * 2    # every host NIC and every switch port carry a stream
        data |= {"max_wall_port_rate_bps": budget, "aggregate_wall_bps": budget * loaded_ports,
                 "hosts": args.hosts, "trials": [asdict(t) for t in trials]}
        print(f"calibrate: budget {budget / 1e6:g} Mb/s per port "
              f"({budget * loaded_ports / 1e9:.2f} Gb/s aggregate over {loaded_ports} ports)")
    if not args.dry_run:
        try:
            old = read_calibration(calibration_path())
        except CalibrationError:
            old = {}
        # measuring one part keeps the other's last measurement
        keep = {k: v for k, v in old.items() if k not in data and k not in ("format", "derating")}
        path = save_budget({**keep, **data})
        where = " in VM runs (--vm)" if os.environ.get("TESTBED_VM") == "1" else ""
        print(f"calibrate: stored in {path}; `dilation: auto` now uses it{where}")
    return EXIT_OK
