"""Bring-up benchmark: wall time of `up` + `down` of leaf-spine fabrics, ours vs Mininet.

    sudo .venv/bin/python bench/bringup.py [--sizes 16,64,128] [--repeat N]
                                           [--skip-mininet] [--mininet-parity] [--no-profile]

For each size it compiles our plan, times apply_plan() (up) and destroy_lab() (down),
then has Debian's Mininet (bench/mininet_build.py under /usr/bin/python3) build the
module `testbed export mininet` writes for that plan (the same fabric) and times its
up and down. It prints a table
(medians over --repeat), our per-phase breakdown of `up`, Mininet's, and a cProfile
of our `up` at the largest size. See bench/README.md for what is and is not compared.

Needs root. Every lab it makes is torn down in `finally`, and after every run it
checks that no namespace of that lab is left, failing loudly otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed.config import load_config_text
from testbed.export.mininet_topo import export_mininet, topo_name
from testbed.net import LabState, apply_plan, destroy_lab
from testbed.net.probe import kernel_config_has
from testbed.plan import compile_plan
from testbed.plan.model import Plan

NETNS_RUN_DIR = "/var/run/netns"
MININET_PYTHON = "/usr/bin/python3"
MININET_SCRIPT = Path(__file__).with_name("mininet_build.py")

# hosts -> (spines, leaves, hosts_per_leaf)
SHAPES = {16: (2, 2, 8), 64: (4, 4, 16), 128: (4, 8, 16)}
# "bpf load start": the port programs' loads begin (bpftool runs beside the next steps)
OUR_PHASES = ["bpf load start", "namespaces", "netlink sockets", "veth", "flow steering",
              "addresses+queues", "neighbours", "routes", "port programs"]

YAML = """\
name: {name}
dilation: auto
topology:
  kind: leaf_spine
  spines: {spines}
  leaves: {leaves}
  hosts_per_leaf: {hosts_per_leaf}
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
"""


class LeftoverError(RuntimeError):
    """A run left namespaces (or a lab state file) behind."""


@dataclass(frozen=True)
class Shape:
    spines: int
    leaves: int
    hosts_per_leaf: int

    @property
    def hosts(self) -> int:
        return self.leaves * self.hosts_per_leaf

    def __str__(self) -> str:
        return f"{self.spines}x{self.leaves}x{self.hosts_per_leaf}"


def parse_size(text: str) -> Shape:
    """'128' (a known shape, or 16 hosts per leaf and 4 spines) or 'SxLxH'."""
    text = text.strip()
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text)
    if m:
        return Shape(*(int(g) for g in m.groups()))
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"size {text!r}: a host count or SPINESxLEAVESxHOSTS")
    hosts = int(text)
    if hosts in SHAPES:
        return Shape(*SHAPES[hosts])
    per_leaf = 16 if hosts % 16 == 0 else 8 if hosts % 8 == 0 else hosts
    return Shape(min(4, hosts // per_leaf), hosts // per_leaf, per_leaf)


@dataclass
class OurRun:
    compile_s: float
    up_s: float
    up_cpu_s: float        # CPU time of this process during up (user + sys)
    down_s: float
    phases: dict[str, float]
    tc_requests: int
    routes: int


@dataclass
class SizeResult:
    shape: Shape
    nodes: int = 0
    links: int = 0
    ours: list[OurRun] = field(default_factory=list)
    mininet: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------- ours

def make_plan(shape: Shape, tag: str) -> Plan:
    # Lab names: lower-case letters and digits, at most 16 characters; the pid keeps
    # two benchmarks (or a benchmark and a test) from meeting on one name.
    name = f"bu{shape.hosts}{tag}p{os.getpid() % 100000}"[:16]
    text = YAML.format(name=name, spines=shape.spines, leaves=shape.leaves,
                       hosts_per_leaf=shape.hosts_per_leaf)
    return compile_plan(load_config_text(text, "<bench/bringup.py>"))


def lab_namespaces(plan: Plan) -> list[str]:
    """Namespaces of this lab that exist now, read from /var/run/netns directly
    (not through the code under test)."""
    try:
        present = set(os.listdir(NETNS_RUN_DIR))
    except FileNotFoundError:
        return []
    wanted = {n.netns for n in plan.nodes}
    return sorted(n for n in present if n in wanted or n.startswith(plan.netns_prefix))


def check_clean(plan: Plan) -> None:
    left = lab_namespaces(plan)
    state = LabState.load(plan.lab)
    if left or state is not None:
        raise LeftoverError(
            f"lab {plan.lab!r} left {len(left)} namespaces behind ({', '.join(left[:5])}"
            f"{', ...' if len(left) > 5 else ''})"
            + (f" and its state file (status {state.status!r})" if state else "")
            + f"; run `testbed down {plan.lab}`")


@contextlib.contextmanager
def lab_guard(plan: Plan):
    """Whatever happens inside, the lab is destroyed and checked on the way out."""
    try:
        yield
    finally:
        try:
            destroy_lab(plan.lab)
        finally:
            check_clean(plan)


def run_ours(shape: Shape, profile: cProfile.Profile | None = None) -> tuple[Plan, OurRun]:
    t0 = time.perf_counter()
    plan = make_plan(shape, "p" if profile else "")
    compile_s = time.perf_counter() - t0
    check_clean(plan)       # nothing of that name may exist before we start
    with lab_guard(plan):
        t1, c1 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        try:
            report = apply_plan(plan)
        finally:
            if profile is not None:
                profile.disable()
        up_s, up_cpu_s = time.perf_counter() - t1, time.process_time() - c1
        if report.already_up:
            raise RuntimeError(f"lab {plan.lab!r} was already up: the timing would be void")
        t2 = time.perf_counter()
        destroy_lab(plan.lab)
        down_s = time.perf_counter() - t2
    return plan, OurRun(compile_s, up_s, up_cpu_s, down_s, dict(report.seconds), report.tc_requests,
                        report.routes)


# ---------------------------------------------------------------- Mininet

def export_topology(plan: Plan, directory: str) -> Path:
    """Our plan as the Mininet module `testbed export mininet` writes: Mininet builds
    that very module, so both columns are the same fabric."""
    path = Path(directory) / f"{topo_name(plan)}.py"
    path.write_text(export_mininet(plan, source="bench/bringup.py"))
    return path


def run_mininet(plan: Plan, parity: bool) -> dict:
    # netem only where the kernel has it (our `up` does the same); elsewhere Mininet's
    # netem commands would fail on every link and time nothing useful.
    netem = kernel_config_has("netem") is not False
    with tempfile.TemporaryDirectory(prefix="bringup-mininet-") as tmp:
        topo = export_topology(plan, tmp)
        # Same process group: a Ctrl-C at the terminal reaches the child too, and it
        # tears its network down itself (net.stop(), then kills any shell left).
        proc = subprocess.Popen([MININET_PYTHON, str(MININET_SCRIPT), str(topo), topo_name(plan),
                                 "1" if parity else "0", "1" if netem else "0"],
                                stdout=subprocess.PIPE, text=True)
        try:
            out, _ = proc.communicate()
        finally:
            if proc.poll() is None:
                _stop_child(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"mininet_build.py failed (exit {proc.returncode}); "
                           "its stderr is above")
    result = json.loads(out.strip().splitlines()[-1])
    if result["leftover_shells"]:
        raise LeftoverError(f"Mininet left {result['leftover_shells']} node shells running")
    return result


def _stop_child(proc: subprocess.Popen) -> None:
    """Give the Mininet child time to clean up after itself; ask harder if it does not."""
    for sig, wait_s in ((None, 5), (signal.SIGINT, 60), (signal.SIGTERM, 30)):
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait()
    print("bringup: killed mininet_build.py; run `mn -c` if it left anything",
          file=sys.stderr)


def mininet_version() -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "mininet"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


# ---------------------------------------------------------------- output

def fmt_table(header: list[str], rows: list[list[str]], right: bool = True) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells):
        return "  ".join((str(c).rjust(w) if right and i else str(c).ljust(w))
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths)]
                     + [line(r) for r in rows])


def med(values: list[float]) -> float:
    return statistics.median(values)


def main_table(results: list[SizeResult]) -> str:
    header = ["hosts", "shape SxLxH", "nodes", "links", "ours up s", "ours down s",
              "ours total", "mininet up s", "mininet down s", "mininet total", "ratio",
              "up ratio"]
    rows = []
    for r in results:
        up, down = med([o.up_s for o in r.ours]), med([o.down_s for o in r.ours])
        ours_total = med([o.up_s + o.down_s for o in r.ours])
        row = [r.shape.hosts, str(r.shape), r.nodes, r.links, f"{up:.2f}", f"{down:.3f}",
               f"{ours_total:.2f}"]
        if r.mininet:
            mup, mdown = med([m["up_s"] for m in r.mininet]), med([m["down_s"] for m in r.mininet])
            m_total = med([m["up_s"] + m["down_s"] for m in r.mininet])
            row += [f"{mup:.2f}", f"{mdown:.2f}", f"{m_total:.2f}", f"{m_total / ours_total:.2f}x",
                    f"{mup / up:.2f}x"]
        else:
            row += ["-", "-", "-", "-", "-"]
        rows.append(row)
    return fmt_table(header, rows)


def phase_table(results: list[SizeResult]) -> str:
    header = ["hosts", "compile", *OUR_PHASES, "other", "up", "up cpu", "tc reqs", "routes",
              "ms/ns", "ms/tc req"]
    rows = []
    for r in results:
        phases = {p: med([o.phases.get(p, 0.0) for o in r.ours]) for p in OUR_PHASES}
        up = med([o.up_s for o in r.ours])
        other = med([x.up_s - sum(x.phases.get(p, 0.0) for p in OUR_PHASES) for x in r.ours])
        o = r.ours[0]
        per_ns = 1000 * (phases["namespaces"] + phases["netlink sockets"]) / r.nodes
        per_tc = 1000 * phases["addresses+queues"] / max(1, o.tc_requests)
        rows.append([r.shape.hosts, f"{med([x.compile_s for x in r.ours]):.3f}",
                     *(f"{phases[p]:.3f}" for p in OUR_PHASES), f"{other:.3f}", f"{up:.3f}",
                     f"{med([x.up_cpu_s for x in r.ours]):.3f}",
                     o.tc_requests, o.routes, f"{per_ns:.2f}", f"{per_tc:.3f}"])
    return fmt_table(header, rows)


def mininet_phase_table(results: list[SizeResult]) -> str:
    names: list[str] = []
    for r in results:
        for m in r.mininet:
            names += [k for k in m["phases"] if k not in names]
    header = ["hosts", *names, "up", "down", "shell cmds up", "shell cmds down", "ms/cmd up"]
    rows = []
    for r in results:
        if not r.mininet:
            continue
        up = med([m["up_s"] for m in r.mininet])
        cmds = r.mininet[0]["up_commands"]
        rows.append([r.shape.hosts,
                     *(f"{med([m['phases'].get(k, 0.0) for m in r.mininet]):.3f}"
                       for k in names),
                     f"{up:.3f}", f"{med([m['down_s'] for m in r.mininet]):.3f}", cmds,
                     r.mininet[0]["down_commands"], f"{1000 * up / max(1, cmds):.2f}"])
    return fmt_table(header, rows)


def profile_text(profile: cProfile.Profile, top: int, sort: str = "cumulative") -> str:
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    stats.strip_dirs().sort_stats(sort).print_stats(top)
    lines = stream.getvalue().splitlines()
    # Drop pstats' preamble up to the column header; keep the header and the rows.
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    return "\n".join(ln.rstrip() for ln in lines[start:] if ln.strip())


NOTES = """\
notes:
  ours    up = apply_plan(plan): namespaces + sysctls, one netlink socket per namespace,
          veth pairs created straight into their namespaces, MAC + MTU + /31 address per
          interface, per port an HTB root + port class + 3 class HTB classes with a bfifo
          leaf each + DSCP u32 filters, links up, /31 + ECMP routes on every node.
          down = destroy_lab(): stop recorded processes, delete the namespaces (their
          veths and qdiscs go with them; the kernel finishes that asynchronously).
          compile_plan() is not in `up` (it is the `compile` column below).
  mininet up = the exported topology (testbed export mininet) built by Mininet():
          addHost per node (a bash shell in a new namespace) + addLink per link
          (TCLink: veth pair made inside the node, plan MACs, plan /31 and MTU on both
          ends, ethtool offloads, HTB root + one class at bw = plan wall rate; netem
          delay/loss only on a kernel with sch_netem) + build() (node config: lo up,
          plan sysctls incl. ip_forward=1 on routers) + start().
          {parity}
          down = net.stop(): `ip link del` per interface, then every shell is ended.
  ratio = mininet total / ours total; up ratio = mininet up / ours up (medians over
          {repeat} run(s) each). Our `down` returns at once while the kernel frees the
          namespaces in the background, so `ratio` leans on Mininet's slow `down`;
          `up ratio` is the like-for-like figure for bringing a fabric up."""

PARITY_ON = ("--mininet-parity: also every plan route (ECMP as nexthop lists).\n"
             "          Still no per-class queues, bfifo leaves or DSCP filters.")
PARITY_OFF = ("No routes, no per-class queues/filters (--mininet-parity adds the\n"
              "          routes: the exported Topo's routes=1).")


# ---------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,128",
                    help="comma list of host counts (16, 64, 128 have fixed shapes) or "
                         "SPINESxLEAVESxHOSTS_PER_LEAF (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size; medians reported")
    ap.add_argument("--skip-mininet", action="store_true", help="time only our builder")
    ap.add_argument("--mininet-parity", action="store_true",
                    help="have Mininet also set MTU and install every plan route")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the cProfile run of our `up` at the largest size")
    ap.add_argument("--profile-top", type=int, default=10, help="functions to list")
    args = ap.parse_args(argv)
    try:
        args.shapes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    return args


_MAIN_PID = os.getpid()


def _on_sigterm(signum, _frame):
    # pyroute2 forks helpers (netns create, netns sockets) and stops them with SIGTERM.
    # A forked copy must die as by default, never unwind our stack (it would run
    # lab_guard's destroy_lab in the child).
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signum)
    raise KeyboardInterrupt(f"signal {signum}")    # same clean-up path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    if os.geteuid() != 0:
        print("bench/bringup.py: needs root (namespaces, veth, tc)", file=sys.stderr)
        return 2
    if not args.skip_mininet and not Path(MININET_PYTHON).exists():
        print(f"bench/bringup.py: {MININET_PYTHON} missing; use --skip-mininet",
              file=sys.stderr)
        return 2

    import pyroute2
    print(f"bring-up benchmark: kernel {platform.release()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, pyroute2 {pyroute2.__version__}"
          + ("" if args.skip_mininet else f", mininet {mininet_version()}"))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          "(other work on this machine skews wall times)")
    print("topology: leaf-spine, hosts 100GBASE-CR1 2 m, fabric 400GBASE-DR4 100 m, "
          "dilation auto\n")

    results = []
    for shape in args.shapes:
        res = SizeResult(shape)
        for i in range(args.repeat):
            plan, ours = run_ours(shape)
            res.nodes, res.links = len(plan.nodes), len(plan.links)
            res.ours.append(ours)
            line = f"  {shape.hosts:>4} hosts run {i + 1}: ours up {ours.up_s:.2f} s down " \
                   f"{ours.down_s:.3f} s"
            if not args.skip_mininet:
                m = run_mininet(plan, args.mininet_parity)
                res.mininet.append(m)
                line += f"; mininet up {m['up_s']:.2f} s down {m['down_s']:.2f} s"
            print(line, flush=True)
        results.append(res)

    print()
    print(main_table(results))
    print(NOTES.format(parity=PARITY_ON if args.mininet_parity else PARITY_OFF,
                       repeat=args.repeat))
    print("\nours, `up` by phase (seconds, medians; report.seconds; other = state file, plan "
          "digest, checks):")
    print(phase_table(results))
    print("  up cpu = CPU time of this process during up (the gap to `up` is waiting: forked\n"
          "  helpers, the kernel, other load); ms/ns = (namespaces + netlink sockets) per\n"
          "  node; ms/tc req = addresses+queues per tc request")
    if any(r.mininet for r in results):
        print("\nmininet, `up` by phase (seconds, medians; shell cmds = node.cmd() calls):")
        print(mininet_phase_table(results))

    if not args.no_profile:
        biggest = max(args.shapes, key=lambda s: s.hosts)
        profile = cProfile.Profile()
        _, prof_run = run_ours(biggest, profile)
        print(f"\ncProfile of our `up` at {biggest.hosts} hosts ({biggest}), "
              f"{prof_run.up_s:.2f} s under the profiler, top {args.profile_top} by "
              "cumulative time:")
        print(profile_text(profile, args.profile_top))
        print(f"\nsame profile, top {args.profile_top} by internal time (where the CPU goes):")
        print(profile_text(profile, args.profile_top, "tottime"))

    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("leftovers: none (every lab's namespaces and state checked after each run)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        # Every lab was destroyed and checked on the way out (lab_guard), and the
        # Mininet child stopped its own network before we got here.
        print("\nbench/bringup.py: interrupted; nothing left behind", file=sys.stderr)
        sys.exit(130)
