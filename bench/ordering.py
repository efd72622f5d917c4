"""Does the fabric keep a flow's packets in order? Without flow steering, and with it.

    sudo .venv/bin/python bench/ordering.py [--seconds 3] [--repeat 1] [--flip-ms 2]
                                            [--only alone,loaded,iperf3,line-rate]
                                            [--variants off,rps,napi]

A leaf-spine lab at D = 100: one spine, two leaves, four hosts on each (h1..h4 on
leaf1, h5..h8 on leaf2), so every flow hN -> hN+4 crosses leaf-spine-leaf on one
path in one class. Each scenario runs on a fresh lab per variant:
- off: `apply_plan(plan, keep_order=False)`, the fabric as the builder made it before
  (no RPS, ARP on every link);
- rps: as `up` builds it (RPS on every port, testbed/net/steering.py, and static
  neighbours, testbed/net/builder.py step 4);
- napi (only when asked for): as built, then RPS turned off again (rps_cpus 0) and
  veth's NAPI mode on every port (`ethtool -K IF gro on tso off`), the alternative
  fix: a veth with GRO on receives into a ring one NAPI poll drains.

- alone: one agents.udp flow h1 -> h5 (1000-byte payloads at 15 Gb/s fabric, 150 Mb/s
  wall), its sender's CPU affinity flipped between the CPUs every --flip-ms;
- loaded: the same flow, same flipping, while h2..h4 -> h6..h8 carry iperf3 -u -b 0
  -l 4000 (agents.udp senders at 1.1 x line rate if iperf3 is missing), which keeps
  both CPUs busy, the way a real workload does;
- iperf3: four iperf3 -u -b 0 -l 4000 streams h1..h4 -> h5..h8, every client flipped
  (before steering, one iperf3 stream on this path at D = 100 had 650 datagrams out of
  order in 5 s); skipped without iperf3;
- line-rate: one agents.udp flow h1 -> h5 at 1.1 x the NIC's line rate with MTU-sized
  payloads for --seconds (no flipping): does the fabric still deliver the port rate.

Columns: `reordered` is the receiver's count of datagrams that arrived after a later
one of the same flow (agents.udp `reordered`, iperf3 `out_of_order`), `lost` what
never arrived (see the drop columns for where),
`recv Mb/s` the wall rate received (all streams), `cpu busy` / `softirq` the machine's
(/proc/stat, both CPUs: the machine is shared, so others' work is in it), `drops
nic/switch` tail drops in the lab's HTB classes at host NICs and at switch ports,
`backlog drops` packets dropped at full per-CPU backlogs (/proc/net/softnet_stat,
machine-wide), `rcvbuf drops` datagrams the receiving sockets had no room for (Udp
RcvbufErrors of the lab's hosts)
and `cpu0/cpu1` the backlog packets each CPU processed (with RPS a flow is processed
on one CPU). Not part of the test run (see bench/README.md).

Needs root. Every lab is torn down in `finally` (SIGTERM included), every process it
starts is recorded in the lab's state and ended by pid; after each lab the script
checks that no namespace of it is left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.config import load_config_text  # noqa: E402
from testbed.net import LabState, apply_plan, destroy_lab, namespaces, steering  # noqa: E402
from testbed.net.counters import read_counters  # noqa: E402
from testbed.plan import compile_plan  # noqa: E402
from testbed.plan.model import Plan  # noqa: E402
from testbed.run.procs import AgentProcess, start_agent, start_process  # noqa: E402

NETNS_RUN_DIR = "/var/run/netns"
DILATION = 100
PORT = 5001
IPERF_PORT = 5201
SCENARIOS = ["alone", "loaded", "iperf3", "line-rate"]
VARIANTS = ["off", "rps", "napi"]
YAML = """\
name: {name}
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: 1
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
"""
_labs = iter(range(1000))


@dataclass
class Result:
    scenario: str
    variant: str
    sent: int = 0
    received: int = 0
    reordered: int = 0
    lost: int = 0
    recv_wall_bps: float = 0.0
    busy: float = 0.0
    softirq: float = 0.0
    backlog_drops: int = 0
    host_drops: int = 0         # tail drops in the hosts' NIC queues
    switch_drops: int = 0       # tail drops in switch ports' queues
    rcvbuf_drops: int = 0       # datagrams the receivers' sockets had no room for
    per_cpu: list[int] = field(default_factory=list)
    flips: int = 0
    note: str = ""


# ---------------------------------------------------------------- machine counters

def cpu_times() -> list[int]:
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:]]


def softnet() -> list[tuple[int, int]]:
    """(processed, dropped) per CPU."""
    with open("/proc/net/softnet_stat") as fh:
        return [(int(cols[0], 16), int(cols[1], 16)) for cols in (ln.split() for ln in fh)]


class Window:
    """What the machine did between start() and stop()."""

    def start(self) -> None:
        self.cpu0, self.net0 = cpu_times(), softnet()

    def stop(self, result: Result) -> None:
        cpu = [b - a for a, b in zip(self.cpu0, cpu_times(), strict=True)]
        total = sum(cpu[:8]) or 1
        idle = cpu[3] + cpu[4]
        result.busy = 1 - idle / total
        result.softirq = cpu[6] / total
        net = softnet()
        result.per_cpu = [b[0] - a[0] for a, b in zip(self.net0, net, strict=True)]
        result.backlog_drops = sum(b[1] - a[1] for a, b in zip(self.net0, net, strict=True))


# ---------------------------------------------------------------- the lab

def make_plan() -> Plan:
    name = f"ro{os.getpid() % 100000}{next(_labs)}"[:16]
    return compile_plan(load_config_text(YAML.format(name=name, dilation=DILATION),
                                         "<bench/ordering.py>"))


def check_clean(plan: Plan) -> None:
    try:
        left = sorted(n for n in os.listdir(NETNS_RUN_DIR) if n.startswith(plan.netns_prefix))
    except FileNotFoundError:
        left = []
    if left or LabState.load(plan.lab) is not None:
        raise RuntimeError(f"lab {plan.lab} left namespaces {left} or its state behind")


def address(plan: Plan, host: str) -> str:
    return plan.node(host).interfaces[0].address.split("/")[0]


class Flipper:
    """Moves processes between the CPUs this script may use, every `period_s`."""

    def __init__(self, pids: list[int], period_s: float) -> None:
        self.pids, self.period_s = pids, period_s
        self.cpus = sorted(os.sched_getaffinity(0))
        self.flips = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flipper", daemon=True)

    def __enter__(self) -> Flipper:
        if self.period_s > 0 and len(self.cpus) > 1:
            self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        k = 0
        while not self._stop.wait(self.period_s):
            cpu = self.cpus[k % len(self.cpus)]
            for pid in self.pids:
                try:
                    os.sched_setaffinity(pid, {cpu})
                except (ProcessLookupError, PermissionError):
                    pass
            self.flips += 1
            k += 1


def wait_ready(path: Path, proc: AgentProcess, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not become ready")
        time.sleep(0.01)


def udp_receiver(plan: Plan, host: str, tmp: Path) -> AgentProcess:
    ready = tmp / f"recv-{host}.ready"
    ready.unlink(missing_ok=True)
    d = plan.timebase
    proc = start_agent(plan.lab, plan.node(host).netns, "agents.udp",
                       ["recv", "--port", str(PORT), "--ready-file", str(ready),
                        "--idle-exit-ns", str(round(d.to_fabric_ns_from_wall_s(1.0))),
                        "--dilation", str(d.factor)], f"recv-{host}")
    wait_ready(ready, proc)
    return proc


def udp_sender(plan: Plan, src: str, dst: str, rate_bps: int, size: int,
               seconds: float) -> AgentProcess:
    d = plan.timebase
    return start_agent(plan.lab, plan.node(src).netns, "agents.udp",
                       ["send", "--dst", address(plan, dst), "--dport", str(PORT),
                        "--sport", "40000", "--rate-bps", str(rate_bps), "--size", str(size),
                        "--duration-ns", str(round(d.to_fabric_ns_from_wall_s(seconds))),
                        "--dilation", str(d.factor)], f"send-{src}")


def iperf3_pair(plan: Plan, src: str, dst: str, seconds: float,
                procs: list[AgentProcess]) -> tuple[AgentProcess, AgentProcess]:
    server = start_process(plan.lab, plan.node(dst).netns,
                           ["iperf3", "-s", "-1", "-J", "-p", str(IPERF_PORT)], f"iperf3-s-{dst}")
    procs.append(server)
    time.sleep(0.2)     # iperf3 has no ready file; its listen takes a few ms
    client = start_process(plan.lab, plan.node(src).netns,
                           ["iperf3", "-c", address(plan, dst), "-p", str(IPERF_PORT), "-u",
                            "-b", "0", "-l", "4000", "-t", f"{seconds:g}", "-J"],
                           f"iperf3-c-{src}")
    procs.append(client)
    return server, client


def iperf3_json(proc: AgentProcess, timeout_s: float) -> dict:
    try:
        out, err = proc.popen.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.stop()
        out, err = proc.popen.communicate()
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        raise RuntimeError(f"{proc.name}: no JSON ({err.strip()[-300:]})") from None


# ---------------------------------------------------------------- scenarios

def one_udp_flow(plan: Plan, args, tmp: Path, result: Result, *, load: bool,
                 line_rate: bool = False) -> None:
    nic = plan.node("h1").interfaces[0].egress
    procs: list[AgentProcess] = []
    window = Window()
    try:
        receiver = udp_receiver(plan, "h5", tmp)
        procs.append(receiver)
        servers = []
        if load:
            for k in (2, 3, 4):
                if shutil.which("iperf3"):
                    servers.append(iperf3_pair(plan, f"h{k}", f"h{k + 4}", args.seconds + 0.5,
                                               procs)[0])
                else:
                    procs.append(udp_receiver(plan, f"h{k + 4}", tmp))
                    procs.append(udp_sender(plan, f"h{k}", f"h{k + 4}",
                                            round(nic.rate_bps * 1.1), 4000,
                                            args.seconds + 0.5))
            result.note = "load: iperf3" if servers else "load: agents.udp"
        if line_rate:
            size, rate, flip = plan.mtu_bytes - 28, round(nic.rate_bps * 1.1), 0.0
        else:
            size, rate, flip = 1000, round(nic.rate_bps * 0.15), args.flip_ms / 1000
        window.start()
        sender = udp_sender(plan, "h1", "h5", rate, size, args.seconds)
        procs.append(sender)
        with Flipper([sender.pid], flip) as flipper:
            sent = sender.result(timeout_s=args.seconds * 3 + 10)
        got = receiver.result(timeout_s=15)
        window.stop(result)
        result.flips = flipper.flips
        result.sent, result.received = sent["packets"], got["packets"]
        result.reordered, result.lost = got["reordered"], got["lost"]
        result.recv_wall_bps = got["wall_bps"]
        if got.get("socket_drops"):
            result.note += f" receiver socket drops {got['socket_drops']}"
        for server in servers:
            iperf3_json(server, 15)
    finally:
        for proc in procs:
            proc.stop()


def iperf3_streams(plan: Plan, args, result: Result) -> None:
    procs: list[AgentProcess] = []
    window = Window()
    try:
        window.start()
        pairs = [iperf3_pair(plan, f"h{k}", f"h{k + 4}", args.seconds, procs) for k in (1, 2, 3, 4)]
        with Flipper([c.pid for _s, c in pairs], args.flip_ms / 1000) as flipper:
            clients = [iperf3_json(c, args.seconds * 3 + 10) for _s, c in pairs]
        servers = [iperf3_json(s, 15) for s, _c in pairs]
        window.stop(result)
        result.flips = flipper.flips
        seconds = 0.0
        for client, server in zip(clients, servers, strict=True):
            udp = server["end"]["streams"][0]["udp"]
            result.sent += client["end"]["sum"]["packets"]
            result.received += udp["packets"] - udp["lost_packets"]
            result.lost += udp["lost_packets"]
            result.reordered += udp["out_of_order"]
            seconds = max(seconds, udp["seconds"])
        result.recv_wall_bps = result.received * (4000 + 66) * 8 / max(seconds, 1e-9)
        result.note = "4 streams"
    finally:
        for proc in procs:
            proc.stop()


def qdisc_drops(plan: Plan) -> dict[str, int]:
    roles = {n.name: n.role for n in plan.nodes}
    out = {"host": 0, "switch": 0}
    for cls in read_counters(plan)[1]:
        out[roles[cls.node]] += cls.drops
    return out


def udp_rcvbuf_errors(plan: Plan) -> int:
    """Udp RcvbufErrors summed over the lab's hosts (a per-namespace counter)."""
    total = 0
    for node in plan.hosts():
        with namespaces.inside(node.netns), open("/proc/thread-self/net/snmp") as fh:
            rows = [line.split() for line in fh if line.startswith("Udp:")]
        total += int(rows[1][rows[0].index("RcvbufErrors")])
    return total


def veth_napi(plan: Plan) -> None:
    """The alternative to RPS: veth's NAPI mode on every port. With GRO on, a veth
    receives into a ring that one NAPI poll drains (a FIFO per port whoever sends);
    veth uses the ring only for packets from a device without TSO, so TSO goes off."""
    for node in plan.nodes:
        for iface in node.interfaces:
            subprocess.run(["nsenter", f"--net={NETNS_RUN_DIR}/{node.netns}", "ethtool", "-K",
                            iface.ifname, "gro", "on", "tso", "off"], check=True,
                           capture_output=True)


def napi_packets(plan: Plan) -> int:
    """Packets the lab's veths received through their NAPI rings (ethtool -S)."""
    total = 0
    for node in plan.nodes:
        for iface in node.interfaces:
            out = subprocess.run(["nsenter", f"--net={NETNS_RUN_DIR}/{node.netns}", "ethtool",
                                  "-S", iface.ifname], check=True, capture_output=True,
                                 text=True).stdout
            total += sum(int(line.split(":")[1]) for line in out.splitlines()
                         if line.strip().startswith("rx_queue_") and "_xdp_packets" in line)
    return total


def run_scenario(scenario: str, variant: str, args, tmp: Path) -> Result:
    """variant: off (the builder with keep_order=False), rps (as built), napi (as built,
    then RPS off and veth NAPI on every port)."""
    plan = make_plan()
    try:
        report = apply_plan(plan, keep_order=variant != "off")
        result = Result(scenario, variant)
        if variant == "napi":
            steering.write_rps_cpus({n.netns: [i.ifname for i in n.interfaces]
                                     for n in plan.nodes}, "0")
            veth_napi(plan)
        elif variant == "rps":
            result.note = report.ordering
        before, rcvbuf = qdisc_drops(plan), udp_rcvbuf_errors(plan)
        if scenario == "iperf3":
            iperf3_streams(plan, args, result)
        else:
            one_udp_flow(plan, args, tmp, result, load=scenario == "loaded",
                         line_rate=scenario == "line-rate")
        after = qdisc_drops(plan)
        result.host_drops = after["host"] - before["host"]
        result.switch_drops = after["switch"] - before["switch"]
        result.rcvbuf_drops = udp_rcvbuf_errors(plan) - rcvbuf
        if variant == "napi":
            result.note += f" {napi_packets(plan)} packets through NAPI rings"
        return result
    finally:
        destroy_lab(plan.lab)
        check_clean(plan)


# ---------------------------------------------------------------- output

def fmt_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells):
        return "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def combine(results: list[Result]) -> Result:
    """Counts summed over repeats, rates and shares as medians."""
    out = Result(results[0].scenario, results[0].variant, note=results[0].note)
    for r in results:
        out.sent += r.sent
        out.received += r.received
        out.reordered += r.reordered
        out.lost += r.lost
        out.backlog_drops += r.backlog_drops
        out.host_drops += r.host_drops
        out.switch_drops += r.switch_drops
        out.rcvbuf_drops += r.rcvbuf_drops
        out.flips += r.flips
    out.recv_wall_bps = statistics.median(r.recv_wall_bps for r in results)
    out.busy = statistics.median(r.busy for r in results)
    out.softirq = statistics.median(r.softirq for r in results)
    out.per_cpu = [sum(col) for col in zip(*(r.per_cpu for r in results), strict=True)]
    return out


def table(results: list[Result]) -> str:
    header = ["scenario", "variant", "sent", "received", "reordered", "reordered %",
              "lost", "recv Mb/s", "cpu busy", "softirq", "drops nic/switch", "backlog drops",
              "rcvbuf drops", "cpu0/cpu1", "flips", "note"]
    rows = []
    for r in results:
        rows.append([r.scenario, r.variant, r.sent,
                     r.received, r.reordered, f"{100 * r.reordered / max(r.received, 1):.3f}",
                     r.lost, f"{r.recv_wall_bps / 1e6:.0f}", f"{100 * r.busy:.0f} %",
                     f"{100 * r.softirq:.0f} %", f"{r.host_drops}/{r.switch_drops}",
                     r.backlog_drops, r.rcvbuf_drops,
                     "/".join(str(n) for n in r.per_cpu), r.flips, r.note.strip()])
    return fmt_table(header, rows)


def _on_sigterm(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")     # same clean-up path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="traffic per scenario")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--flip-ms", type=float, default=2.0,
                        help="move the senders to the next CPU this often (0: never)")
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--variants", default="off,rps",
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default off,rps)")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}")
    scenarios = [s for s in args.only.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    if os.geteuid() != 0:
        print("bench/ordering.py: needs root (namespaces, veth, tc)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    # pyroute2 (read_counters) forks helpers and stops them with SIGTERM: a child must
    # not run this script's clean-up.
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    if "iperf3" in scenarios and not shutil.which("iperf3"):
        print("iperf3 not installed: skipping the iperf3 scenario")
        scenarios.remove("iperf3")
    print(f"kernel {os.uname().release}, CPUs {sorted(os.sched_getaffinity(0))}, "
          f"load average {os.getloadavg()[0]:.2f}, D = {DILATION}, {args.seconds:g} s per run, "
          f"senders flipped every {args.flip_ms:g} ms")
    tmp = Path(f"/run/testbed/bench-ordering-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for scenario in scenarios:
            for variant in variants:
                runs = [run_scenario(scenario, variant, args, tmp) for _ in range(args.repeat)]
                results.append(combine(runs))
                print(f"  {scenario}, {variant}: "
                      f"{results[-1].reordered} of {results[-1].received} reordered", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(results))
    print("\noff: the builder with keep_order=False (no RPS, ARP); rps: as `up` builds "
          "(RPS on every port, static neighbours); napi: as built, then RPS off and veth "
          "NAPI (gro on, tso off) on every port")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
