"""What the data-plane agents cost in memory: peak RSS and PSS of every agent process of a
real run, by agent kind.

    sudo .venv/bin/python bench/agent_memory.py                       # default + 7:1 RoCE incast
    sudo .venv/bin/python bench/agent_memory.py --only hosts --hosts 32   # a 31:1 leaf-spine incast
    sudo .venv/bin/python bench/agent_memory.py --only hosts --hosts 128 --duration 1ms
    sudo .venv/bin/python bench/agent_memory.py --only allreduce --hosts 128
    ... --pfc-nodes-per-process 1      # PFC agents one process per node (as before)

Each scenario is one `run_config` (the path `testbed run` takes: bring-up, PFC agents,
workload, collector, report, down) in a temporary runs directory. While it runs, a thread
reads the lab's state (testbed/net/state.py: every agent process the run starts is
recorded there with its pid and start time) every `--period` seconds and, for each live
agent, /proc/PID/status (VmRSS, and VmHWM: the kernel's own peak RSS of the process, so a
short spike between two samples still counts) and /proc/PID/smaps_rollup (Pss). RSS counts
every page a process maps, shared library pages included in each process again; PSS
divides a shared page among the processes that map it, so the sum of PSS is what the
agents together take from the machine. It only reads /proc; it never signals a process.

Scenarios:
- `default`: configs/default.yaml (a 4:1 UDP incast on 8 hosts, no PFC);
- `incast7`: configs/examples/dcqcn-on.yaml (7:1 RoCE incast, PFC and DCQCN on the default
  fabric) with the duration cut to `--duration` (default 2ms fabric: ~4 s wall at D 2000);
- `hosts`: a leaf-spine fabric of `--hosts` N hosts (16 per leaf, 2 leaves below 32 hosts,
  2 spines up to 2 leaves, else 4) running an N-1:1 RoCE incast (PFC, DCQCN) for
  `--duration`. N = 16 takes about a minute here. N = 128 starts 137 agent processes (127
  clients, one RoCE responder on the receiving host serving all 127 streams, 9 PFC
  processes serving the 140 nodes) and needs a few GB of free memory and a few minutes on
  2 CPUs (the run itself will say it could not keep up: memory, not fidelity, is measured);
- `allreduce`: a leaf-spine of `--hosts` N hosts, 8 per leaf (N/8 leaves, 4 spines above
  16 hosts), PFC on, one all-reduce (`--algorithm`, default rhd) of `--size` over all N
  ranks (one rank process per host), no warm-up, one iteration.

The table, per kind (pfc, roce client, roce server, udp, ...): processes, peak RSS per
process (VmHWM: min / median / max), their sum, peak PSS per process (sampled: min /
median / max) and its sum, and the largest sum over the agents alive at one sample (RSS
and PSS): that last one is what the machine had to hold at once. The bench process itself
(the run's control plane) is shown apart. Needs root. Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.cli.common import pfc_nodes_per_process  # noqa: E402
from testbed.config import load_config_text  # noqa: E402
from testbed.net.state import LabState, process_start_time  # noqa: E402
from testbed.plan import compile_plan  # noqa: E402
from testbed.run.runner import RunOptions, run_config  # noqa: E402

HOSTS_YAML = """\
name: {name}
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: {spines}
  leaves: {leaves}
  hosts_per_leaf: {per_leaf}
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
qos:
  default:
    pfc: {{enabled: true}}
workload:
  drain: 200us
  traffic:
    - name: incast
      kind: roce_incast
      senders: [{senders}]
      receiver: h{n}
      cc: dcqcn
      duration: {duration}
"""

ALLREDUCE_YAML = """\
name: {name}
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: {spines}
  leaves: {leaves}
  hosts_per_leaf: 8
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
qos:
  default:
    pfc: {{enabled: true}}
workload:
  drain: 200us
  traffic:
    - name: allreduce
      kind: allreduce
      algorithm: {algorithm}
      ranks: [{ranks}]
      sizes: {{min: {size}, max: {size}, factor: 2}}
      dtype: float32
      warmup: 0
      iterations: 1
"""


def kib(path: str, key: str) -> int | None:
    """The `key:` line of a /proc file, in KiB (None if the process is gone)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def kind_of(pid: int) -> str:
    """'roce client', 'pfc', 'udp', ... from the command line: `-m agents.NAME [MODE]`;
    a child of the run's zygote (its command line is the zygote's) by the name the zygote
    gave it (/proc/PID/comm: 'pfc', 'roce client'), the zygote itself as 'zygote'."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if "agents.runtime.zygote" in argv:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return "?"
        return "zygote" if comm.startswith("python") else comm
    if "-m" in argv:
        i = argv.index("-m")
        module = argv[i + 1] if i + 1 < len(argv) else "?"
        name = module.removeprefix("agents.")
        mode = argv[i + 2] if i + 2 < len(argv) else ""
        if name == "roce" and mode in ("client", "server"):
            return f"roce {mode}"
        return name
    return Path(argv[0]).name if argv and argv[0] else "?"


@dataclass
class Proc:
    kind: str
    hwm_kib: int = 0          # VmHWM: peak RSS, from the kernel
    pss_kib: int = 0          # largest Pss seen in a sample


@dataclass
class Sampler:
    lab: str
    period_s: float
    procs: dict[tuple[int, str], Proc] = field(default_factory=dict)
    peak_rss_kib: int = 0     # largest sum of VmRSS over agents alive at one sample
    peak_pss_kib: int = 0
    peak_alive: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        state = LabState.load(self.lab)
        if state is None:
            return
        rss_sum = pss_sum = alive = 0
        for rec in state.processes:
            if process_start_time(rec.pid) != rec.start_time:
                continue                      # exited (or the pid is someone else's now)
            key = (rec.pid, rec.start_time)
            proc = self.procs.get(key)
            if proc is None:
                proc = self.procs[key] = Proc(kind_of(rec.pid))
            status = f"/proc/{rec.pid}/status"
            rss, hwm = kib(status, "VmRSS"), kib(status, "VmHWM")
            pss = kib(f"/proc/{rec.pid}/smaps_rollup", "Pss")
            if rss is None or hwm is None:
                continue
            # a process still in `ip netns exec`/nsenter has not exec'd python yet
            if proc.kind in ("ip", "nsenter"):
                proc.kind = kind_of(rec.pid)
            proc.hwm_kib = max(proc.hwm_kib, hwm)
            proc.pss_kib = max(proc.pss_kib, pss or 0)
            rss_sum += rss
            pss_sum += pss or 0
            alive += 1
        self.samples += 1
        if rss_sum > self.peak_rss_kib:
            self.peak_rss_kib, self.peak_alive = rss_sum, alive
        self.peak_pss_kib = max(self.peak_pss_kib, pss_sum)

    def loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except (OSError, RuntimeError):
                pass                          # the state file between writes: next time
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()


def fabric_text(scenario: str, args: argparse.Namespace) -> tuple[str, str]:
    """(config text, file name) of a scenario."""
    tag = f"am{os.getpid() % 100000}"
    if scenario == "default":
        text = (REPO / "configs/default.yaml").read_text()
        return text.replace("name: default", f"name: {tag}d"), "default.yaml"
    if scenario == "incast7":
        text = (REPO / "configs/examples/dcqcn-on.yaml").read_text()
        text = text.replace("name: dcqcnon", f"name: {tag}i")
        text = text.replace("duration: 30ms", f"duration: {args.duration}")
        if args.dilation != "auto":
            text = text.replace("dilation: auto", f"dilation: {args.dilation}")
        return text, "dcqcn-on.yaml"
    n = args.hosts
    if scenario == "allreduce":
        if n % 8 or n < 16:
            raise SystemExit(f"--hosts {n}: the all-reduce has 8 ranks per leaf, 2 leaves "
                             "or more (a multiple of 8, at least 16)")
        return ALLREDUCE_YAML.format(
            name=f"{tag}a{n}", dilation=args.dilation, spines=2 if n <= 16 else 4,
            leaves=n // 8, algorithm=args.algorithm, size=args.size,
            ranks=", ".join(f"h{i}" for i in range(1, n + 1))), f"allreduce-{n}.yaml"
    leaves = max(2, -(-n // 16))
    if n % leaves:
        raise SystemExit(f"--hosts {n}: not a multiple of {leaves} leaves")
    return HOSTS_YAML.format(
        name=f"{tag}h{n}", dilation=args.dilation, spines=2 if leaves <= 2 else 4,
        leaves=leaves, per_leaf=n // leaves, n=n,
        senders=", ".join(f"h{i}" for i in range(1, n)), duration=args.duration), \
        f"incast-{n}.yaml"


def run_one(scenario: str, args: argparse.Namespace) -> tuple[Sampler, float, int]:
    text, fname = fabric_text(scenario, args)
    loaded = load_config_text(text, fname)
    plan = compile_plan(loaded)
    sampler = Sampler(plan.lab, args.period)
    thread = threading.Thread(target=sampler.loop, daemon=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tb-benchmem-") as tmp:
        thread.start()
        try:
            result = run_config(loaded, plan, RunOptions(
                runs_root=Path(tmp), say=(print if args.verbose else (lambda _m: None)),
                pfc_nodes_per_process=args.pfc_nodes_per_process))
        finally:
            sampler.stop()
            thread.join()
            # run_config takes its lab down on every way out it sees (SIGINT and SIGTERM
            # included); this is for the ones it does not (a failure in its own clean-up).
            if LabState.load(plan.lab) is not None:
                from testbed.net import destroy_lab
                for line in destroy_lab(plan.lab):
                    print(f"  (clean-up: {line})")
    if result.failed or result.fault:
        print(f"  ({scenario}: the run said: {result.failed or result.fault})")
    return sampler, time.monotonic() - t0, kib("/proc/self/status", "VmHWM") or 0


def mb(k: float) -> str:
    return f"{k / 1024:.1f}"


def table(scenario: str, s: Sampler, wall_s: float, self_hwm: int) -> None:
    kinds: dict[str, list[Proc]] = {}
    unseen = 0
    for p in s.procs.values():
        if p.hwm_kib == 0:
            unseen += 1        # exited (or not yet exec'd) between the state and /proc
            continue
        kinds.setdefault(p.kind, []).append(p)
    seen = len(s.procs) - unseen
    print(f"\n{scenario}: {seen} agent processes, {s.samples} samples, "
          f"{wall_s:.0f} s wall (MB = MiB)"
          + (f"; {unseen} more exited before a sample read them" if unseen else ""))
    head = (f"{'kind':<14}{'n':>5}  {'RSS min':>8}{'median':>8}{'max':>8}{'sum':>9}  "
            f"{'PSS min':>8}{'median':>8}{'max':>8}{'sum':>9}")
    print(head)
    print("-" * len(head))
    tot_rss = tot_pss = 0
    for kind in sorted(kinds, key=lambda k: -sum(p.hwm_kib for p in kinds[k])):
        ps = kinds[kind]
        rss = sorted(p.hwm_kib for p in ps)
        pss = sorted(p.pss_kib for p in ps)
        tot_rss += sum(rss)
        tot_pss += sum(pss)
        print(f"{kind:<14}{len(ps):>5}  {mb(rss[0]):>8}{mb(statistics.median(rss)):>8}"
              f"{mb(rss[-1]):>8}{mb(sum(rss)):>9}  {mb(pss[0]):>8}"
              f"{mb(statistics.median(pss)):>8}{mb(pss[-1]):>8}{mb(sum(pss)):>9}")
    print(f"{'all agents':<14}{seen:>5}  {'':>24}{mb(tot_rss):>9}  {'':>24}"
          f"{mb(tot_pss):>9}   (sums of per-process peaks)")
    print(f"at one sample: {s.peak_alive} alive, RSS {mb(s.peak_rss_kib)} MB, "
          f"PSS {mb(s.peak_pss_kib)} MB (largest sums)")
    print(f"control plane (this process): peak RSS {mb(self_hwm)} MB")


_BENCH_PID = os.getpid()


def _terminate(signum: int, _frame: object) -> None:
    if os.getpid() != _BENCH_PID:
        # a child forked without exec (pyroute2 forks one per namespace socket) inherits
        # this handler: it must die as asked, not unwind the bench's stack (whose
        # clean-up would remove the runs directory under the bench's feet)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="default,incast7",
                        help="scenarios, comma separated: default, incast7, hosts, allreduce")
    parser.add_argument("--hosts", type=int, default=16, help="hosts of the `hosts` scenario")
    parser.add_argument("--duration", default="2ms", help="fabric time of the RoCE incasts")
    parser.add_argument("--algorithm", default="rhd",
                        help="allreduce scenario: ring, rhd, tree or ina (default rhd)")
    parser.add_argument("--size", default="256KiB", help="allreduce scenario: message size")
    parser.add_argument("--dilation", default="auto")
    parser.add_argument("--period", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--verbose", action="store_true", help="print the run's own lines")
    parser.add_argument("--pfc-nodes-per-process", type=pfc_nodes_per_process, default=None,
                        metavar="N|auto",
                        help="PFC agent grouping (default auto; 1: one process per node)")
    args = parser.parse_args()
    # A SIGTERM outside run_config (which handles its own) ends the bench through its
    # finally clauses, as Ctrl-C does: no lab is left behind.
    signal.signal(signal.SIGTERM, _terminate)
    if os.geteuid() != 0:
        print("needs root (it builds a lab)", file=sys.stderr)
        return 2
    for scenario in [x.strip() for x in args.only.split(",") if x.strip()]:
        if scenario not in ("default", "incast7", "hosts", "allreduce"):
            parser.error(f"unknown scenario {scenario!r}")
        name = {"hosts": f"hosts {args.hosts} ({args.hosts - 1}:1)",
                "allreduce": f"allreduce {args.algorithm}, {args.hosts} ranks, 8 per leaf, "
                             f"{args.size}"}.get(scenario, scenario)
        table(name, *run_one(scenario, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
