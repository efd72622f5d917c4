"""How fast PFC reacts, in fabric time: from a queue crossing a threshold to the upstream
class stopping (XOFF) or starting again (XON).

Runs the 7:1 incast example with PFC on (configs/examples/incast-pfc.yaml) at its
default dilation and reads the run's events:
- `pfc_xoff` / `pfc_xon` (sent by a switch): when the frame left, and how long before
  that the packet that crossed the threshold passed the port program (`crossed_ns_ago`:
  the port program posts the crossing to the agent's ring buffer at that packet);
- `pfc_paused` / `pfc_resumed` (logged by the upstream agent once its gate is closed or
  open again).
Pause reaction = paused - (xoff sent - crossed); resume latency = resumed - (xon sent -
crossed). Refresh XOFFs (no new pause) are skipped. Prints a table per hop kind and
overall: median and p99, and the two parts (detect: crossing to frame sent; frame + gate:
frame sent to the gate switched).

    sudo .venv/bin/python bench/pfc.py [--repeat N] [--dilation D] [--pfc-nodes-per-process N]

`--pfc-nodes-per-process` (auto, or N: 1 is a process per node) is how the PFC agents are
grouped into processes (testbed/run/fabric_agents.py pfc_groups; auto is one per node on
this 12-node fabric); `--compare` runs one per node and N per process (default 6: two
processes) interleaved, `--repeat` runs of each, and prints both tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.config import load_config_text  # noqa: E402
from testbed.plan import compile_plan  # noqa: E402
from testbed.results.store import Store  # noqa: E402
from testbed.run.pfc_reaction import percentile, reactions  # noqa: E402
from testbed.run.runner import RunOptions, run_config  # noqa: E402

Row = tuple[str, str, float, float, float]


def one_run(n: int, dilation: str | None, per_process: int | None = None
            ) -> list[Row]:
    text = (REPO / "configs/examples/incast-pfc.yaml").read_text()
    text = text.replace("name: incaston", f"name: benchpfc{n}")
    if dilation:
        text = text.replace("dilation: auto", f"dilation: {dilation}")
    loaded = load_config_text(text, "incast-pfc.yaml")
    plan = compile_plan(loaded)
    with tempfile.TemporaryDirectory(prefix="tb-benchpfc-") as tmp:
        result = run_config(loaded, plan, RunOptions(runs_root=Path(tmp), say=lambda _m: None,
                                                     pfc_nodes_per_process=per_process))
        store = Store(result.run_dir / "counters.sqlite")
        events = {k: store.events(k) for k in ("pfc_xoff", "pfc_xon", "pfc_paused",
                                               "pfc_resumed")}
        store.close()
    roles = {node.name: node.role for node in plan.nodes}
    found = (reactions(events["pfc_xoff"], events["pfc_paused"], roles, "pause")
             + reactions(events["pfc_xon"], events["pfc_resumed"], roles, "resume"))
    return [(r.what, r.hop, r.total_ns, r.detect_ns, r.apply_ns) for r in found]


def print_table(rows: list[Row], title: str) -> None:
    print(title)
    print(f"{'':8}{'hop':<22}{'n':>6}{'median':>10}{'p99':>10}{'detect med':>12}"
          f"{'frame+gate med':>16}")
    for what in ("pause", "resume"):
        mine = [r for r in rows if r[0] == what]
        groups: dict[str, list] = {"all": mine}
        for row in mine:
            groups.setdefault(row[1], []).append(row)
        for name, group in groups.items():
            if not group:
                continue
            total = [r[2] / 1e3 for r in group]
            detect = statistics.median(r[3] / 1e3 for r in group)
            print(f"{what:<8}{name:<22}{len(group):>6}{statistics.median(total):>10.3f}"
                  f"{percentile(total, 0.99):>10.3f}{detect:>12.3f}"
                  f"{statistics.median(r[4] / 1e3 for r in group):>16.3f}")


def main() -> int:
    from testbed.cli.common import pfc_nodes_per_process

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dilation", help="override the example's dilation: auto")
    parser.add_argument("--pfc-nodes-per-process", type=pfc_nodes_per_process, default=None,
                        metavar="N|auto", help="PFC agent grouping (default auto)")
    parser.add_argument("--compare", action="store_true",
                        help="one process per node against --pfc-nodes-per-process (default "
                             "here 6: the 12 nodes in 2 processes), runs interleaved")
    args = parser.parse_args()
    grouped = args.pfc_nodes_per_process or 6
    settings: list[int | None] = ([1, grouped] if args.compare
                                  else [args.pfc_nodes_per_process])
    rows: dict[int | None, list[Row]] = {
        s: [] for s in settings}
    for n in range(args.repeat):
        for setting in settings:
            rows[setting] += one_run(n, args.dilation, setting)
    for setting, mine in rows.items():
        label = "auto" if setting is None else f"{setting} per process"
        if not mine:
            print(f"no XOFF/pause pairs were recorded (PFC nodes: {label})")
            return 1
        print_table(mine, f"PFC reaction, fabric time (us), {args.repeat} runs of the 7:1 "
                          f"incast example (D {args.dilation or 'auto'}, PFC nodes: {label}):")
    return 0


if __name__ == "__main__":
    sys.exit(main())
