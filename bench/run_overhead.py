"""Fixed cost per run: where the wall time of `testbed run` goes besides the workload.

    sudo .venv/bin/python bench/run_overhead.py                    # configs/default.yaml, 3 runs
    sudo .venv/bin/python bench/run_overhead.py --repeat 5 configs/examples/incast-pfc.yaml
    sudo .venv/bin/python bench/run_overhead.py --keep-runs /tmp/runs   # keep run dirs
    sudo .venv/bin/python bench/run_overhead.py --zygote both --repeat 5   # exec vs zygote

Runs `python -m testbed run CONFIG --quiet` as a child process N times per config (one
after the other), times the whole process, and reads the run's own `timings.json`
(docs/run-format.md): one CLOCK_MONOTONIC interval per stage, and the builder's steps of
`up`. Prints per stage the wall time (median, min, max over the runs), the builder's
steps, `process` (the child's whole wall time), `interpreter+cli` (process minus every
stage: Python start, imports, argument parsing, printing the result table), and
`fixed cost` = process - workload, the number issue 19 wants under 1 s for the default
fabric. `workload` is the dilated workload itself (t0 to the senders' end); `planned
workload` is its planned span x D, for comparison. `issue stages` is the sum the issue
names: up + agent start-up (fabric and workload agents) + the start margin + drain +
stop + down.

`--zygote both` runs each config with TESTBED_ZYGOTE=0 (every agent started by exec) and
=1 (forked from the run's zygote) interleaved, run for run, so both see the same load;
it prints a table for each and their medians side by side. `--zygote 0` / `1` sets the
switch for every run; the default leaves the environment as it is.

Needs root (it builds the fabric). Every run tears its fabric down itself; the bench
checks after each run that the lab is gone and stops if not. Run directories go to a
temporary directory removed at the end unless --keep-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.net.state import LabState
from testbed.run.timings import FIXED_COST_PHASES, PHASES

REPO = Path(__file__).resolve().parent.parent


# the stages issue 19 wants under 1 s together, beside the dilated workload
ISSUE_STAGES = ("up", "fabric_agents", "workload_agents", "start_margin", "drain",
                "stop_agents", "down")


def run_once(config: str, runs_dir: Path, zygote: str | None = None
             ) -> tuple[float, dict, Path]:
    """(process wall seconds, timings.json, run directory) of one `testbed run`;
    `zygote` the TESTBED_ZYGOTE it runs with (None: as the environment has it)."""
    argv = [sys.executable, "-m", "testbed", "run", config, "--runs-dir", str(runs_dir),
            "--quiet"]
    env = dict(os.environ)
    if zygote is not None:
        env["TESTBED_ZYGOTE"] = zygote
    start = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env)
    wall = time.perf_counter() - start
    lines = res.stdout.strip().splitlines()
    if not lines or not Path(lines[-1]).is_dir():
        raise SystemExit(f"run_overhead: `{' '.join(argv)}` printed no run directory "
                         f"(exit {res.returncode}):\n{res.stderr.strip()[-2000:]}")
    run_dir = Path(lines[-1])
    timings_path = run_dir / "timings.json"
    if not timings_path.exists():
        raise SystemExit(f"run_overhead: {run_dir} has no timings.json (a testbed from "
                         "before timings.json?)")
    timings = json.loads(timings_path.read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    if LabState.load(summary["lab"]) is not None:
        raise SystemExit(f"run_overhead: lab {summary['lab']!r} is still up after the run; "
                         f"run `testbed down {summary['lab']}`")
    if res.returncode != 0:
        print(f"  note: the run exited {res.returncode} (its fidelity notes: "
              f"{summary.get('fidelity')}); its timings are counted all the same",
              file=sys.stderr)
    return wall, timings, run_dir


def stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def table_rows(runs: list[tuple[float, dict]]) -> list[tuple[str, list[float]]]:
    rows: list[tuple[str, list[float]]] = []
    for phase in PHASES:
        rows.append((phase, [t["seconds"].get(phase, 0.0) for _w, t in runs]))
    steps: list[str] = []
    for _w, t in runs:
        steps += [s for s in t["up_steps"] if s not in steps]
    for step in steps:
        rows.append((f"  up: {step}", [t["up_steps"].get(step, 0.0) for _w, t in runs]))
    process = [w for w, _t in runs]
    staged = [sum(t["seconds"].values()) for _w, t in runs]
    rows.append(("interpreter+cli", [p - s for p, s in zip(process, staged, strict=True)]))
    rows.append(("process", process))
    rows.append(("planned workload", [t["planned_workload_wall_s"] for _w, t in runs]))
    fixed = [w - t["seconds"].get("workload", 0.0) for w, t in runs]
    rows.append(("fixed cost", fixed))
    rows.append(("  of it in stages", [sum(v for k, v in t["seconds"].items()
                                           if k in FIXED_COST_PHASES) for _w, t in runs]))
    rows.append(("issue stages (up..down)", [sum(t["seconds"].get(k, 0.0)
                                                  for k in ISSUE_STAGES) for _w, t in runs]))
    return rows


def table(config: str, runs: list[tuple[float, dict]]) -> str:
    rows = table_rows(runs)
    paths = sorted({t.get("agent_start", {}).get("path", "?") for _w, t in runs})
    out = [f"{config}: {len(runs)} run(s), agents started by {', '.join(paths)}, wall seconds",
           f"{'stage':<34} {'median':>8} {'min':>8} {'max':>8}"]
    for name, values in rows:
        med, lo, hi = stats(values)
        out.append(f"{name:<34} {med:8.3f} {lo:8.3f} {hi:8.3f}")
    return "\n".join(out)


def side_by_side(config: str, by_switch: dict[str, list[tuple[float, dict]]]) -> str:
    """Medians of TESTBED_ZYGOTE=0 and =1, and their difference."""
    rows0, rows1 = table_rows(by_switch["0"]), table_rows(by_switch["1"])
    out = [f"{config}: medians, exec (TESTBED_ZYGOTE=0) vs zygote (=1), wall seconds",
           f"{'stage':<34} {'exec':>8} {'zygote':>8} {'delta':>8}"]
    for (name, v0), (_n, v1) in zip(rows0, rows1, strict=True):
        m0, m1 = statistics.median(v0), statistics.median(v1)
        out.append(f"{name:<34} {m0:8.3f} {m1:8.3f} {m1 - m0:+8.3f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=["configs/default.yaml"])
    parser.add_argument("--repeat", type=int, default=3, help="runs per config (default 3)")
    parser.add_argument("--keep-runs", type=Path, metavar="DIR",
                        help="keep the run directories under DIR")
    parser.add_argument("--zygote", choices=("env", "0", "1", "both"), default="env",
                        help="TESTBED_ZYGOTE of the runs: as the environment has it (env), "
                        "0, 1, or both interleaved (default env)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("run_overhead: needs root (it builds the fabric)", file=sys.stderr)
        return 2
    runs_dir = args.keep_runs or Path(tempfile.mkdtemp(prefix="tb-run-overhead-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} CPUs; other work on this machine skews wall times)")
    try:
        choices: dict[str, list[str | None]] = {"env": [None], "0": ["0"], "1": ["1"],
                                                "both": ["0", "1"]}
        switches = choices[args.zygote]
        for config in args.configs:
            by_switch: dict[str, list[tuple[float, dict]]] = {str(z): [] for z in switches}
            for k in range(args.repeat):
                for z in switches:
                    wall, timings, run_dir = run_once(config, runs_dir, z)
                    print(f"  {config} run {k + 1}"
                          f"{'' if z is None else f' TESTBED_ZYGOTE={z}'}: {wall:.2f} s, "
                          f"workload {timings['seconds'].get('workload', 0.0):.2f} s "
                          f"({run_dir.name})", flush=True)
                    by_switch[str(z)].append((wall, timings))
            for runs in by_switch.values():
                print()
                print(table(config, runs))
            if args.zygote == "both":
                print()
                print(side_by_side(config, by_switch))
            print()
    finally:
        if args.keep_runs is None:
            shutil.rmtree(runs_dir, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
