"""One flow, one path, one class: the fabric delivers it in order whatever CPU sends it.

A leaf-spine lab at D = 100 (one spine, two leaves, four hosts each). The measured
flow h1 -> h5 crosses leaf-spine-leaf while the test moves its sender between the
CPUs every 2 ms; three iperf3 streams h2..h4 -> h6..h8 keep both CPUs busy. Without
RPS on the ports a flow's packets wait in two CPUs' backlogs and overtake each other
(docs/datapath.md "Ordering"; built with keep_order=False this test saw 245 of 41 792
and 144 of 36 785 datagrams out of order); with it none may.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from agents.timebase import Dilation
from testbed.config import load_config_text
from testbed.net import apply_plan, destroy_lab, portprog, steering
from testbed.net.namespaces import exists
from testbed.plan import Plan, compile_plan
from testbed.run.procs import AgentProcess, start_agent, start_process
from tests.conftest import unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

FLOW_SECONDS = 3.0
FLIP_S = 0.002
PORT = 5001
# The initial namespace's own RPS default, before any lab of this module is built
# (kernels before 6.2, Debian 12's 6.1 among them, have no rps_default_mask: None).
DEFAULT_MASK_PATH = "/proc/sys/net/core/rps_default_mask"
ORIGINAL_DEFAULT_MASK = (open(DEFAULT_MASK_PATH).read().strip()
                         if os.path.exists(DEFAULT_MASK_PATH) else None)
YAML = """\
name: {name}
dilation: 100
topology:
  kind: leaf_spine
  spines: 1
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[tuple[Plan, str]]:
    plan = compile_plan(load_config_text(YAML.format(name=unique_lab("roord")), "<test>"))
    try:
        report = apply_plan(plan)
        yield plan, report.ordering
    finally:
        destroy_lab(plan.lab)
    assert not any(exists(n.netns) for n in plan.nodes)


def address(plan: Plan, host: str) -> str:
    return plan.node(host).interfaces[0].address.split("/")[0]


def path_ports(plan: Plan, hops: list[str]) -> list[tuple[str, str]]:
    """(node, egress ifname) along hops, e.g. h1 leaf1 spine1 leaf2 h5."""
    out = []
    for here, there in zip(hops, hops[1:], strict=False):
        iface = next(i for i in plan.node(here).interfaces if i.peer.node == there)
        out.append((here, iface.ifname))
    return out


def flip_cpus(pid: int, stop: threading.Event) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    k = 0
    while not stop.wait(FLIP_S):
        try:
            os.sched_setaffinity(pid, {cpus[k % len(cpus)]})
        except ProcessLookupError:
            return
        k += 1


def send_one_flow(plan: Plan, tmp_path, procs: list[AgentProcess]) -> tuple[dict, dict]:
    """h1 -> h5, 1000-byte datagrams at 15 Gb/s fabric, the sender moved every 2 ms."""
    d = Dilation(plan.dilation.factor)
    ready = tmp_path / "recv.ready"
    receiver = start_agent(plan.lab, plan.node("h5").netns, "agents.udp",
                           ["recv", "--port", str(PORT), "--ready-file", str(ready),
                            "--idle-exit-ns", str(round(d.to_fabric_ns_from_wall_s(1.0))),
                            "--dilation", str(d.factor)], "recv-h5")
    procs.append(receiver)
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert receiver.popen.poll() is None and time.monotonic() < deadline, "no receiver"
        time.sleep(0.01)
    rate = round(plan.node("h1").interfaces[0].egress.rate_bps * 0.15)
    sender = start_agent(plan.lab, plan.node("h1").netns, "agents.udp",
                         ["send", "--dst", address(plan, "h5"), "--dport", str(PORT),
                          "--sport", "40000", "--rate-bps", str(rate), "--size", "1000",
                          "--duration-ns", str(round(d.to_fabric_ns_from_wall_s(FLOW_SECONDS))),
                          "--dilation", str(d.factor)], "send-h1")
    procs.append(sender)
    stop = threading.Event()
    flipper = threading.Thread(target=flip_cpus, args=(sender.pid, stop), daemon=True)
    flipper.start()
    try:
        sent = sender.result(timeout_s=FLOW_SECONDS * 3 + 10)
    finally:
        stop.set()
        flipper.join()
    return sent, receiver.result(timeout_s=15)


def test_every_port_steers_flows_and_knows_its_peer(lab):
    plan, ordering = lab
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to steer")
    assert ordering.startswith("rps cpus"), ordering
    mask = steering.cpu_mask(os.sched_getaffinity(0))
    ports = {n.netns: [i.ifname for i in n.interfaces] for n in plan.nodes}
    masks = steering.read_rps_cpus(ports)
    assert len(masks) == sum(len(v) for v in ports.values())
    for (netns, ifname), per_queue in masks.items():
        assert per_queue and all(int(m.replace(",", ""), 16) == int(mask.replace(",", ""), 16)
                                 for m in per_queue), (netns, ifname, per_queue)
    mac = {(n.name, i.ifname): i.mac for n in plan.nodes for i in n.interfaces}
    for node in plan.nodes:
        neigh = json.loads(subprocess.run(["ip", "-n", node.netns, "-j", "neigh"],
                                          capture_output=True, text=True, check=True).stdout)
        got = {(e["dev"], e["dst"]): (e["lladdr"], e["state"]) for e in neigh}
        want = {(i.ifname, i.peer.address.split("/")[0]):
                (mac[(i.peer.node, i.peer.ifname)], ["PERMANENT"]) for i in node.interfaces}
        assert got == want, node.name
    # The initial namespace keeps its own default (read from this, the initial, one).
    if ORIGINAL_DEFAULT_MASK is not None:
        with open(DEFAULT_MASK_PATH) as fh:
            assert fh.read().strip() == ORIGINAL_DEFAULT_MASK


def test_a_flow_alone_is_in_order_and_every_port_program_sees_every_packet(lab, tmp_path):
    plan, _ = lab
    ports = path_ports(plan, ["h1", "leaf1", "spine1", "leaf2", "h5"])

    def arrivals():
        out = {}
        for port in ports:
            # Fresh maps: the builder (this process) closed the ones portprog caches.
            maps = portprog.open_port(portprog.pin_dir_of(plan.lab, *port))
            try:
                out[port] = sum(c.packets for c in maps.read().values())
            finally:
                maps.close()
        return out

    procs: list[AgentProcess] = []
    try:
        before = arrivals()
        sent, got = send_one_flow(plan, tmp_path, procs)
        after = arrivals()
    finally:
        for proc in procs:
            proc.stop()
    assert sent["packets"] > 5000
    assert got["reordered"] == 0, got
    assert got["lost"] == got["socket_drops"], got      # nothing lost in the fabric
    # No ARP on the fabric (static neighbours): the flow is all each path port carried.
    assert {p: after[p] - before[p] for p in ports} == {p: sent["packets"] for p in ports}


def test_a_flow_among_busy_cpus_is_in_order(lab, tmp_path):
    plan, _ = lab
    if not shutil.which("iperf3"):
        pytest.skip("iperf3 not installed (make system-deps installs it)")
    procs: list[AgentProcess] = []
    try:
        for k in (2, 3, 4):
            procs.append(start_process(plan.lab, plan.node(f"h{k + 4}").netns,
                                       ["iperf3", "-s", "-1", "-p", "5201"], f"iperf3-s-{k}",
                                       stdout=subprocess.DEVNULL))
        time.sleep(0.2)
        for k in (2, 3, 4):
            procs.append(start_process(plan.lab, plan.node(f"h{k}").netns,
                                       ["iperf3", "-c", address(plan, f"h{k + 4}"), "-p", "5201",
                                        "-u", "-b", "0", "-l", "4000",
                                        "-t", f"{FLOW_SECONDS + 0.5:g}"], f"iperf3-c-{k}",
                                       stdout=subprocess.DEVNULL))
        sent, got = send_one_flow(plan, tmp_path, procs)
    finally:
        for proc in procs:
            proc.stop()
    assert got["packets"] > 5000, got
    assert got["reordered"] == 0, (f"{got['reordered']} of {got['packets']} datagrams "
                                   f"out of order ({sent['packets']} sent)")


def test_without_a_per_namespace_default_every_ports_rps_cpus_is_written(build, monkeypatch):
    # Older kernels: the builder writes rps_cpus through sysfs in a private mount
    # namespace. Forced here; nothing of it may show in this process's mounts.
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to steer")
    monkeypatch.setattr(steering, "default_mask_per_namespace", lambda: False)
    def sysfs_mounts():
        with open("/proc/self/mountinfo") as fh:
            return [line for line in fh if " - sysfs " in line]

    mounts_before = sysfs_mounts()
    text = YAML.format(name=unique_lab("rosysf")).replace("hosts_per_leaf: 4",
                                                          "hosts_per_leaf: 1")
    plan = build(compile_plan(load_config_text(text, "<test>")))
    assert sysfs_mounts() == mounts_before
    ports = {n.netns: [i.ifname for i in n.interfaces] for n in plan.nodes}
    masks = steering.read_rps_cpus(ports)
    want = int(steering.cpu_mask(os.sched_getaffinity(0)), 16)
    assert {k: [int(m, 16) for m in v] for k, v in masks.items()} == {
        (ns, i): [want] for ns, names in ports.items() for i in names}
    for node in plan.nodes:     # the namespaces' own default stayed empty
        if ORIGINAL_DEFAULT_MASK is None:
            break               # a kernel without the sysctl
        out = subprocess.run(["ip", "netns", "exec", node.netns, "cat",
                              "/proc/sys/net/core/rps_default_mask"],
                             capture_output=True, text=True, check=True).stdout
        assert int(out.strip().replace(",", ""), 16) == 0
