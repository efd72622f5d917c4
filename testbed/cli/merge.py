"""`testbed merge PART_DIR...`: one run directory from the VMs' parts of a run over several
VMs (`testbed run FILE --vms V --vm NAME`), with its summary and report (docs/scale-out.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from testbed.cli.common import EXIT_OK, EXIT_USAGE


def add_parser(sub):
    p = sub.add_parser("merge", help="merge the part run directories of a run over several "
                                     "VMs into one run directory and report")
    p.add_argument("parts", nargs="+", metavar="PART_DIR",
                   help="each VM's part run directory (fetched from the VMs)")
    p.add_argument("--runs-dir", default="runs", help="where the merged run directory goes "
                                                      "(default runs/)")
    return p


def run(args) -> int:
    from testbed.run.merge import MergeError, merge_parts

    try:
        merged = merge_parts([Path(p) for p in args.parts], Path(args.runs_dir))
    except MergeError as exc:
        print(f"merge: {exc}", file=sys.stderr)
        return EXIT_USAGE
    s = merged.summary
    print(f"merge: {len(s['parts'])} part(s), {len({p['node'] for p in s['ports']})} nodes; "
          f"drops {s['totals']['drops']:,}, ECN marks {s['totals']['ecn_marks']:,}, pause "
          f"frames {s['totals']['pause_frames']:,}")
    for note in s["fidelity"]:
        print(f"fidelity: {note}")
    print(f"report: {merged.run_dir / 'report.html'}")
    print(merged.run_dir)
    return EXIT_OK
