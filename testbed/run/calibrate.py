"""`testbed calibrate`: the highest per-port wall rate this machine keeps with fidelity.

Each trial builds a small single-switch fabric whose 100G ports run at a
candidate wall rate W (D = 100G / W), drives every port in both directions
at line rate (a UDP sender may not be set above it), and passes when every
stream arrived at >= 95 % of the line rate, no port fell short while backlogged and no sender fell
behind its schedule. W rises through 1-2-5 steps until a trial fails; the
last passing W becomes the budget `dilation: auto` uses.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agents.timebase import Dilation
from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.run.runner import RunOptions, run_config

PORT_BPS = 100_000_000_000
CANDIDATE_WALL_BPS = [50_000_000, 100_000_000, 200_000_000, 500_000_000, 1_000_000_000,
                      2_000_000_000]
PASS_RATIO = 0.95

TRIAL = """\
name: calib{n}
dilation: {dilation}
max_wall_port_rate: {wall}
topology:
  kind: single_switch
  hosts: {hosts}
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
    - name: load
      kind: udp_pairs
      pairs: {pairs}
      duration: {duration_ns}ns
"""


@dataclass
class Trial:
    wall_port_bps: int
    dilation: int
    worst_ratio: float
    fidelity: list[str]
    passed: bool


def run_trial(n: int, wall_bps: int, hosts: int, seconds: float) -> Trial:
    dilation = PORT_BPS // wall_bps
    half = hosts // 2
    pairs = [[f"h{i}", f"h{i + half}"] for i in range(1, half + 1)]
    pairs += [[b, a] for a, b in pairs]
    text = TRIAL.format(n=n, dilation=dilation, wall=wall_bps, hosts=hosts, pairs=pairs,
                        duration_ns=int(Dilation(dilation).to_fabric_ns_from_wall_s(seconds)))
    loaded = load_config_text(text, "<calibrate>")
    plan = compile_plan(loaded)
    with tempfile.TemporaryDirectory(prefix="tb-calibrate-") as tmp:
        result = run_config(loaded, plan, RunOptions(runs_root=Path(tmp), say=lambda _m: None))
    rows = [r for w in result.summary["workloads"] for r in w["results"]]
    worst = min((r["rx_fabric_bps"] / PORT_BPS for r in rows), default=0.0)
    notes = [f for f in result.summary["fidelity"]
             if "netem" not in f and "budget" not in f]
    return Trial(wall_bps, dilation, worst, notes, worst >= PASS_RATIO and not notes)


def calibrate(hosts: int = 4, seconds: float = 2.0,
              say: Callable[[str], None] = print) -> tuple[int, list[Trial]]:
    trials: list[Trial] = []
    budget = CANDIDATE_WALL_BPS[0]
    for n, wall in enumerate(CANDIDATE_WALL_BPS):
        trial = run_trial(n, wall, hosts, seconds)
        trials.append(trial)
        say(f"calibrate: {wall / 1e6:g} Mb/s per port (D={trial.dilation}): worst stream "
            f"{100 * trial.worst_ratio:.1f} % of line rate"
            + ("" if trial.passed else f" - FAIL {'; '.join(trial.fidelity)[:200]}"))
        if not trial.passed:
            break
        budget = wall
    return budget, trials
