"""The three ratios issue 19 is judged by, measured side by side in one run.

1. **transport vs iperf3**: one RoCE QP pair on one veth against `iperf3 -u -l 4096` on
   the same veth (bench/transport.py's two measurements, run back to back): received
   packets per second, and their ratio.
2. **the 8:1 incast, wall vs fabric time**: `testbed run configs/flows/incast-8to1.yaml`
   (eight 1 MB flows into one host through one 100G switch) timed as a whole process:
   compile, up, agents, the dilated workload, drain, results, report, down. The fabric
   time it stands for is the span of its results/fct.txt (last finish - first start).
   Beside it, HPCC's ns-3 (`scratch/third`) simulating the same incast on this machine,
   timed the same way, its fabric time read from its own FCT file (both are HPCC's
   format). Fetching and building HPCC's ns-3 is the user's choice: give its built
   `simulation` directory with `--ns3-dir` (run as `./waf --run 'scratch/third CONFIG'`)
   or a command template with `--ns3-cmd` (`{config}` is replaced by the config path);
   without either, that column is skipped and the table says why.
3. **bring-up vs Mininet**: `apply_plan` of a leaf-spine of `--hosts` hosts against
   Debian's Mininet building the same fabric (bench/bringup.py's two measurements).

    sudo .venv/bin/python bench/ratios.py [--seconds 4] [--hosts 128] [--repeat 1]
                                          [--ns3-dir DIR | --ns3-cmd CMD] [--skip ...]

Each figure is the median of `--repeat` runs. The goals (issue 19) are printed beside
the ratios; nothing here asserts them. Everything made is removed, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

INCAST_CONFIG = REPO / "configs" / "flows" / "incast-8to1.yaml"
INCAST_SENDERS = 8
INCAST_FLOW_BYTES = 1_000_000

# HPCC ns-3's config for the same incast: run.py's dcqcn template (ECN at 100G 400 KB /
# 1600 KB / 0.2, DCQCN timers) with configs/flows/incast-8to1.yaml's 2 MiB switch buffer
# and 1000-byte payloads replaced by the 4096-byte path MTU our RoCE flows use. The flows
# start at 2 s, as HPCC's flow files do; the simulated span is read from the FCT file.
NS3_CONFIG = """\
ENABLE_QCN 1
USE_DYNAMIC_PFC_THRESHOLD 1
PACKET_PAYLOAD_SIZE 4096
TOPOLOGY_FILE {dir}/topology.txt
FLOW_FILE {dir}/flow.txt
TRACE_FILE {dir}/trace.txt
TRACE_OUTPUT_FILE {dir}/mix.tr
FCT_OUTPUT_FILE {dir}/fct.txt
PFC_OUTPUT_FILE {dir}/pfc.txt
SIMULATOR_STOP_TIME 2.1
CC_MODE 1
ALPHA_RESUME_INTERVAL 1
RATE_DECREASE_INTERVAL 4
CLAMP_TARGET_RATE 0
RP_TIMER 300
EWMA_GAIN 0.00390625
FAST_RECOVERY_TIMES 1
RATE_AI 20Mb/s
RATE_HAI 200Mb/s
MIN_RATE 1000Mb/s
DCTCP_RATE_AI 1000Mb/s
ERROR_RATE_PER_LINK 0.0000
L2_CHUNK_SIZE 4000
L2_ACK_INTERVAL 1
L2_BACK_TO_ZERO 0
HAS_WIN 0
GLOBAL_T 1
VAR_WIN 0
FAST_REACT 0
U_TARGET 0.95
MI_THRESH 0
INT_MULTI 1
MULTI_RATE 0
SAMPLE_FEEDBACK 0
PINT_LOG_BASE 1.01
PINT_PROB 1.0
RATE_BOUND 1
ACK_HIGH_PRIO 1
LINK_DOWN 0 0 0
ENABLE_TRACE 0
KMAX_MAP 1 100000000000 1600
KMIN_MAP 1 100000000000 400
PMAX_MAP 1 100000000000 0.20
BUFFER_SIZE 2
QLEN_MON_FILE {dir}/qlen.txt
QLEN_MON_START 2000000000
QLEN_MON_END 2100000000
"""


def ns3_files(directory: Path) -> Path:
    """Write config.txt, topology.txt (9 hosts and switch 9, 100 Gb/s, 10 ns: a 2 m DAC),
    flow.txt (h0..h7 -> h8, 1 MB each at 2 s) and an empty trace into `directory`."""
    hosts = INCAST_SENDERS + 1
    switch = hosts
    links = [f"{h} {switch} 100Gbps 0.01us 0" for h in range(hosts)]
    (directory / "topology.txt").write_text(
        f"{hosts + 1} 1 {hosts}\n{switch}\n" + "\n".join(links) + "\n")
    flows = [f"{h} {INCAST_SENDERS} 3 200 {INCAST_FLOW_BYTES} 2.0" for h in range(INCAST_SENDERS)]
    (directory / "flow.txt").write_text(f"{len(flows)}\n" + "\n".join(flows) + "\n")
    (directory / "trace.txt").write_text("0\n")
    config = directory / "config.txt"
    config.write_text(NS3_CONFIG.format(dir=directory))
    return config


def fct_span_ns(path: Path) -> tuple[int, float]:
    """(finished flows, last finish - first start in ns) of an HPCC-format FCT file
    (`sip dip sport dport size start_ns fct_ns standalone_fct_ns` per line)."""
    starts, ends = [], []
    for line in path.read_text().split("\n"):
        fields = line.split()
        if len(fields) < 7:
            continue
        start, fct = int(fields[5]), int(fields[6])
        starts.append(start)
        ends.append(start + fct)
    if not starts:
        raise RuntimeError(f"{path}: no finished flow")
    return len(starts), float(max(ends) - min(starts))


@dataclass
class Timed:
    wall_s: float
    fabric_ns: float
    flows: int
    detail: str

    @property
    def ratio(self) -> float:
        return self.wall_s / (self.fabric_ns / 1e9)


def run_ours_incast(runs_dir: Path) -> Timed:
    argv = [sys.executable, "-m", "testbed", "run", str(INCAST_CONFIG), "--runs-dir",
            str(runs_dir), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"testbed run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    if not run_dir.is_absolute():
        run_dir = REPO / run_dir
    flows, span = fct_span_ns(run_dir / "results" / "fct.txt")
    summary = json.loads((run_dir / "summary.json").read_text())
    dilation = summary.get("dilation", {})
    factor = dilation.get("factor") if isinstance(dilation, dict) else dilation
    notes = summary.get("fidelity") or []
    return Timed(wall, span, flows, f"D={factor}, {len(notes)} fidelity notes")


def run_ns3_incast(command: str, cwd: Path | None) -> Timed:
    with tempfile.TemporaryDirectory(prefix="tb-ratios-ns3-") as tmp:
        config = ns3_files(Path(tmp))
        argv = shlex.split(command.replace("{config}", str(config)))
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"ns-3 failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        flows, span = fct_span_ns(Path(tmp) / "fct.txt")
    return Timed(wall, span, flows, "HPCC ns-3 scratch/third")


def median_timed(runs: list[Timed]) -> Timed:
    mid = sorted(runs, key=lambda t: t.wall_s)[len(runs) // 2]
    return Timed(statistics.median(t.wall_s for t in runs), mid.fabric_ns, mid.flows, mid.detail)


def transport_rows(seconds: float, repeat: int) -> tuple[dict, dict]:
    import transport
    with tempfile.TemporaryDirectory(prefix="tb-ratios-") as tmp, transport.Link() as link:
        roce, iperf = [], []
        for _ in range(repeat):
            roce.append(transport.roce(link, seconds, Path(tmp)))
            iperf.append(transport.iperf(link, seconds))
    return transport.median_row(roce), transport.median_row(iperf)


def bringup_rows(hosts: int, repeat: int) -> tuple[float, float]:
    import bringup
    shape = bringup.parse_size(str(hosts))
    ours, theirs = [], []
    for _ in range(repeat):
        plan, run = bringup.run_ours(shape)
        ours.append(run.up_s)
        theirs.append(bringup.run_mininet(plan, parity=False)["up_s"])
    return statistics.median(ours), statistics.median(theirs)


def print_table(rows: list[list[str]]) -> None:
    import bringup
    print(bringup.fmt_table(["comparison", "ours", "reference", "ratio", "goal"], rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="per transport run (wall)")
    ap.add_argument("--hosts", type=int, default=128, help="bring-up fabric size")
    ap.add_argument("--repeat", type=int, default=1, help="runs per figure; medians shown")
    ns3 = ap.add_mutually_exclusive_group()
    ns3.add_argument("--ns3-dir", type=Path,
                     help="HPCC's built ns-3 `simulation` directory (runs ./waf there)")
    ns3.add_argument("--ns3-cmd", help="command that runs HPCC's scratch/third; {config} "
                     "is replaced by the config file's path")
    ap.add_argument("--skip", action="append", default=[],
                    choices=("transport", "incast", "bringup"), help="leave a comparison out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench/ratios.py needs root (namespaces, veth, tc)", file=sys.stderr)
        return 2
    print(f"issue 19's ratios: kernel {platform.release()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}, medians of {args.repeat}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at start")
    rows: list[list[str]] = []
    skipped: list[str] = []

    if "transport" not in args.skip:
        r, i = transport_rows(args.seconds, args.repeat)
        rows.append(["transport: received pps, 1 QP vs iperf3 -u -l 4096",
                     f"{r['rx_pps']:,.0f}", f"{i['rx_pps']:,.0f}",
                     f"{r['rx_pps'] / i['rx_pps']:.0%}", ">= 70 %"])

    if "incast" not in args.skip:
        with tempfile.TemporaryDirectory(prefix="tb-ratios-runs-") as runs:
            ours = median_timed([run_ours_incast(Path(runs)) for _ in range(args.repeat)])
        rows.append([f"8:1 incast of 1 MB: wall / fabric ({ours.detail})",
                     f"{ours.wall_s:.2f} s / {ours.fabric_ns / 1e3:.0f} us = {ours.ratio:,.0f}",
                     "", "", "< 200"])
        command, cwd = None, None
        if args.ns3_dir is not None:
            command, cwd = "./waf --run 'scratch/third {config}'", args.ns3_dir
        elif args.ns3_cmd:
            command = args.ns3_cmd
        if command is None:
            skipped.append("HPCC ns-3: no build given (--ns3-dir or --ns3-cmd); fetching and "
                           "building it is the user's choice")
        else:
            ns3 = median_timed([run_ns3_incast(command, cwd) for _ in range(args.repeat)])
            rows.append(["8:1 incast of 1 MB: ours vs HPCC ns-3, wall / fabric",
                         f"{ours.ratio:,.0f}", f"{ns3.ratio:,.0f}",
                         f"{ours.ratio / ns3.ratio:.2f}x", "1x (ns-3's)"])
            rows.append(["8:1 incast of 1 MB: whole-run wall time",
                         f"{ours.wall_s:.2f} s", f"{ns3.wall_s:.2f} s",
                         f"{ours.wall_s / ns3.wall_s:.2f}x", ""])

    if "bringup" not in args.skip:
        ours_up, mn_up = bringup_rows(args.hosts, args.repeat)
        rows.append([f"bring-up, {args.hosts}-host leaf-spine: up (s), Mininet / ours",
                     f"{ours_up:.2f} s", f"{mn_up:.2f} s", f"{mn_up / ours_up:.1f}x", ">= 8x"])

    print()
    print_table(rows)
    for s in skipped:
        print(f"skipped: {s}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
