"""How fast PFC reacts, in fabric time: from a queue crossing XOFF to the upstream class stopping.

Runs the 7:1 incast example with PFC on (configs/examples/incast-pfc.yaml)
at its default dilation and reads the run's events:
- `pfc_xoff` (sent by a switch): when the frame left, and how long before
  that the congested queue crossed XOFF (interpolated between the agent's
  last two polls: the detection delay);
- `pfc_paused` (logged by the upstream agent once its TBF gate is closed and
  its virtual queue frozen).
Reaction = paused - (sent - detection). Refresh XOFFs (no new pause) are
skipped. Prints a table per hop kind and overall: median and p99, and the
two parts (detect, frame + gate).

    sudo .venv/bin/python bench/pfc.py [--repeat N] [--dilation D]
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
from testbed.run.runner import RunOptions, run_config  # noqa: E402
from testbed.run.store import Store  # noqa: E402

MATCH_WINDOW_NS = 50_000     # a pause that starts later than this after an XOFF is not its own


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def one_run(n: int, dilation: str | None) -> list[tuple[str, float, float, float]]:
    text = (REPO / "configs/examples/incast-pfc.yaml").read_text()
    text = text.replace("name: incaston", f"name: benchpfc{n}")
    if dilation:
        text = text.replace("dilation: auto", f"dilation: {dilation}")
    loaded = load_config_text(text, "incast-pfc.yaml")
    plan = compile_plan(loaded)
    with tempfile.TemporaryDirectory(prefix="tb-benchpfc-") as tmp:
        result = run_config(loaded, plan, RunOptions(runs_root=Path(tmp), say=lambda _m: None))
        store = Store(result.run_dir / "counters.sqlite")
        xoffs = store.events("pfc_xoff")
        paused = store.events("pfc_paused")
        store.close()
    roles = {node.name: node.role for node in plan.nodes}
    out = []
    # Each pause the upstream started is paired with the latest XOFF sent to
    # it before then (XOFFs to a port already paused start nothing).
    for p in paused:
        before = [x for x in xoffs
                  if (x["peer_node"], x["peer_port"]) == (p["node"], p["port"])
                  and 0 <= p["ts_fabric_ns"] - x["ts_fabric_ns"] <= MATCH_WINDOW_NS
                  and x.get("crossed_ns_ago") is not None]
        if not before:
            continue
        x = before[-1]
        detect = x["crossed_ns_ago"]
        apply = p["ts_fabric_ns"] - x["ts_fabric_ns"]
        hop = f"{x['node'].rstrip('0123456789')} -> {roles[x['peer_node']]}"
        out.append((hop, detect + apply, detect, apply))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dilation", help="override the example's dilation: auto")
    args = parser.parse_args()
    rows: list[tuple[str, float, float, float]] = []
    for n in range(args.repeat):
        rows += one_run(n, args.dilation)
    if not rows:
        print("no XOFF/pause pairs were recorded")
        return 1
    groups: dict[str, list] = {"all": rows}
    for row in rows:
        groups.setdefault(row[0], []).append(row)
    print(f"PFC reaction, fabric time (us), {args.repeat} runs of the 7:1 incast example "
          f"(D {args.dilation or 'auto'}):")
    print(f"{'hop':<22}{'n':>5}{'median':>10}{'p99':>10}{'detect med':>12}{'frame+gate med':>16}")
    for name, group in groups.items():
        total = [r[1] / 1e3 for r in group]
        print(f"{name:<22}{len(group):>5}{statistics.median(total):>10.2f}"
              f"{pct(total, 0.99):>10.2f}{statistics.median(r[2] / 1e3 for r in group):>12.2f}"
              f"{statistics.median(r[3] / 1e3 for r in group):>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
