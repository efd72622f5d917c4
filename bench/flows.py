"""What a long generated-flows run costs, and that it grows linearly, not without bound.

Runs `kind: flows` on the default fabric (8 hosts, leaf-spine, D from `dilation: auto`)
with web-search flows at a target load for several fabric durations, and prints per
run: flows, fabric and wall time, counters.sqlite bytes (and per fabric ms), the
database's point rows, the flows table's rows, the largest resident set of one flows
agent and of all the run's agents together (sampled from /proc every 0.2 s wall), and
the run process's own peak RSS. A bounded pipeline shows the same cost per fabric ms
at every duration (the agents keep only finished flows' records; the collector writes
each sample once), and a flat per-agent RSS.

    .venv/bin/python bench/flows.py [--load 0.3] [--durations-ms 1,2,5] [--dilation auto]

Needs root (real namespaces); everything it creates is removed.
"""

from __future__ import annotations

import argparse
import os
import resource
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.config import load_config_text  # noqa: E402
from testbed.plan import compile_plan  # noqa: E402
from testbed.run.runner import RunOptions, run_config  # noqa: E402

CONFIG = """\
name: benchflows{n}
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  sample_period: {period}
  traffic:
    - name: web
      kind: flows
      cc: dcqcn
      generate: {{distribution: {dist}, load: {load}, duration: {duration}, seed: 1}}
"""


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _rss_kb(pid: int) -> tuple[str, int]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return cmd, rss
    except (OSError, StopIteration):
        return "", 0


class RssWatch(threading.Thread):
    """Largest RSS of one flows agent, and of all agents at once, while the run runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.max_flows_kb = 0
        self.max_total_kb = 0

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.wait(0.2):
            total = 0
            for pid in _descendants(me):
                cmd, kb = _rss_kb(pid)
                if "agents." not in cmd:
                    continue
                total += kb
                if "agents.flows" in cmd:
                    self.max_flows_kb = max(self.max_flows_kb, kb)
            self.max_total_kb = max(self.max_total_kb, total)


def one(n: int, duration_ms: float, args: argparse.Namespace, root: Path) -> dict:
    text = CONFIG.format(n=n, dilation=args.dilation, load=args.load, dist=args.distribution,
                         duration=f"{duration_ms}ms", period=args.sample_period)
    loaded = load_config_text(text, "bench-flows.yaml")
    plan = compile_plan(loaded)
    watch = RssWatch()
    watch.start()
    t0 = time.monotonic()
    result = run_config(loaded, plan, RunOptions(runs_root=root, say=lambda _m: None))
    wall_s = time.monotonic() - t0
    watch.stop.set()
    watch.join()
    db = result.run_dir / "counters.sqlite"
    with sqlite3.connect(db) as c:
        points = c.execute("SELECT COUNT(*) FROM points").fetchone()[0]
        flows = c.execute("SELECT COUNT(*), COUNT(fct_ns) FROM flows").fetchone()
    fabric_ms = result.summary.get("duration_fabric_ns", 0) / 1e6
    return {"duration_ms": duration_ms, "D": plan.dilation.factor, "flows": flows[0],
            "finished": flows[1], "fabric_ms": fabric_ms, "wall_s": wall_s,
            "db_kb": db.stat().st_size / 1024, "points": points,
            "flows_agent_mb": watch.max_flows_kb / 1024,
            "agents_mb": watch.max_total_kb / 1024,
            "self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "notes": len(result.summary.get("fidelity", []))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", type=float, default=0.3)
    p.add_argument("--durations-ms", default="1,2,5")
    p.add_argument("--dilation", default="auto")
    p.add_argument("--distribution", default="web_search")
    p.add_argument("--sample-period", default="100us")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, d in enumerate(float(x) for x in args.durations_ms.split(",")):
            rows.append(one(n, d, args, Path(tmp)))
            r = rows[-1]
            print(f"  done {d} ms: {r['flows']} flows in {r['wall_s']:.0f} s", file=sys.stderr)
    print(f"web flows at load {args.load}, default fabric, sample period {args.sample_period}")
    print(f"{'generated':>9} {'D':>5} {'flows':>6} {'done':>6} {'fabric':>8} {'wall':>7} "
          f"{'db':>8} {'db/ms':>7} {'points':>8} {'agent':>7} {'agents':>7} {'run':>6} "
          f"{'notes':>5}")
    print(f"{'ms':>9} {'':>5} {'':>6} {'':>6} {'ms':>8} {'s':>7} {'KiB':>8} {'KiB':>7} "
          f"{'rows':>8} {'MiB':>7} {'MiB':>7} {'MiB':>6} {'':>5}")
    for r in rows:
        print(f"{r['duration_ms']:>9g} {r['D']:>5} {r['flows']:>6} {r['finished']:>6} "
              f"{r['fabric_ms']:>8.2f} {r['wall_s']:>7.1f} {r['db_kb']:>8.0f} "
              f"{r['db_kb'] / max(r['fabric_ms'], 1e-9):>7.0f} {r['points']:>8} "
              f"{r['flows_agent_mb']:>7.1f} {r['agents_mb']:>7.0f} {r['self_mb']:>6.0f} "
              f"{r['notes']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
