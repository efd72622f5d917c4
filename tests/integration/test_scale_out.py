"""A fabric split over two "VMs" on this machine (issue 16): two underlay namespaces
joined by a veth, each with its own address, stand in for two VMs' networks, and
`testbed up FILE --vms VMS.yaml --vm NAME --underlay-netns NS` runs once per VM, each
with a state directory of its own (as each VM has its own /run), through the same code
path as on real VMs. The default fabric at D = 2000 goes on two VMs as its placement
says: a spine, a leaf and its four hosts each, the two crossing leaf-spine links as
VXLAN tunnels.

Checked: every node, port, MAC and address as a single-VM build makes them; every
ordered pair of hosts reaches the other; every link, tunnels included, delivers its
rate within 5 % in each direction; a PFC pause sent by the congested leaf on one VM
crosses the tunnel and pauses the spine on the other, with no loss in the lossless
class; and `testbed down` removes each part, leaving nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from agents.runtime.control import read_snapshot
from testbed.config import load_config_text
from testbed.config.vms import load_vms_text
from testbed.net import portprog
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import Plan, compile_plan
from testbed.plan.part import PartPlan, part_plan
from testbed.plan.partition import Placement, partition
from testbed.plan.paths import host_address
from testbed.run import smoke
from testbed.run.procs import socket_path, start_agent
from tests.conftest import REPO, unique_lab
from tests.integration.conftest import UNDERLAY_MTU, underlay_pair

pytestmark = [pytest.mark.root, pytest.mark.slow]

DILATION = 2000
VMS = f"""\
vms:
  - {{name: vm1, underlay: 192.0.2.11, cores: 2, wall_rate_budget: 2Gbps, mtu: {UNDERLAY_MTU}}}
  - {{name: vm2, underlay: 192.0.2.12, cores: 2, wall_rate_budget: 2Gbps, mtu: {UNDERLAY_MTU}}}
"""
LOSSLESS_TC, LOSSLESS_DSCP = 3, 26


@dataclass
class Split:
    plan: Plan
    placement: Placement
    parts: dict[str, PartPlan]
    state_dirs: dict[str, Path]
    underlay: dict[str, str]        # VM -> its underlay namespace
    up_output: dict[str, str]


def _testbed(vm_state: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "TESTBED_STATE_DIR": str(vm_state)}
    res = subprocess.run([sys.executable, "-m", "testbed", *argv], capture_output=True,
                         text=True, env=env, timeout=300)
    if check:
        assert res.returncode == 0, f"testbed {' '.join(argv)}: {res.stdout}\n{res.stderr}"
    return res


def _fabric(tmp: Path, lab: str) -> tuple[Path, Path, Plan]:
    doc = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    doc["name"], doc["dilation"] = lab, DILATION
    fabric = tmp / "fabric.yaml"
    fabric.write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp / "vms.yaml").write_text(VMS)
    return fabric, tmp / "vms.yaml", compile_plan(load_config_text(fabric.read_text(),
                                                                   str(fabric)))


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Iterator[Split]:
    tmp = tmp_path_factory.mktemp("split")
    lab = unique_lab("split")
    fabric, vms, plan = _fabric(tmp, lab)
    placement = partition(plan, load_vms_text(VMS, "vms.yaml").vms_file)
    state_dirs = {vm: tmp / f"state-{vm}" for vm in ("vm1", "vm2")}
    try:
        with underlay_pair(lab) as underlay:
            out = {}
            try:
                for vm in underlay:
                    res = _testbed(state_dirs[vm], "up", str(fabric), "--vms", str(vms),
                                   "--vm", vm, "--underlay-netns", underlay[vm])
                    out[vm] = res.stdout
                yield Split(plan, placement,
                            {vm: part_plan(plan, placement, vm) for vm in underlay},
                            state_dirs, underlay, out)
            finally:
                for state in state_dirs.values():
                    if state.exists():
                        _testbed(state, "down", lab, check=False)
    finally:
        left = [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}-")]
    assert not left, f"namespaces left behind: {left}"
    assert not (portprog.PIN_ROOT / lab).exists(), "port program pins left behind"


def _links(netns: str) -> list[dict]:
    res = subprocess.run(["ip", "-n", netns, "-d", "-j", "link", "show"], check=True,
                         capture_output=True, text=True)
    return json.loads(res.stdout)


def test_each_vm_builds_its_nodes_as_a_single_vm_build_would_and_a_tunnel_per_cut_link(
        split: Split) -> None:
    assert [t.link for t in split.placement.tunnels] and split.placement.cut_links == 2
    for vm, part in split.parts.items():
        assert "2 VXLAN tunnels" in split.up_output[vm], split.up_output[vm]
        for name in part.nodes:
            node = split.plan.node(name)
            links = {li["ifname"]: li for li in _links(node.netns)}
            for iface in node.interfaces:
                assert links[iface.ifname]["address"] == iface.mac
                assert links[iface.ifname]["mtu"] == iface.mtu_bytes
                assert "UP" in links[iface.ifname]["flags"]     # carrier comes a moment later
        vxlans = {li["ifname"]: li for li in _links(f"{split.plan.netns_prefix}vx-{vm}")
                  if li.get("linkinfo", {}).get("info_kind") == "vxlan"}
        assert sorted(vxlans) == sorted(f"vxlan{t.link}" for t in part.tunnels)
        for t in part.tunnels:
            data = vxlans[f"vxlan{t.link}"]["linkinfo"]["info_data"]
            assert (data["id"], data["local"], data["remote"], data["port"]) == (
                t.vni, t.local.underlay, t.remote.underlay, 4789)
            # the UDP socket is in the underlay namespace, the device is not
            assert vxlans[f"vxlan{t.link}"]["link_netnsid"] is not None
    # the two parts together hold every node once
    assert sorted(n for p in split.parts.values() for n in p.nodes) == sorted(
        n.name for n in split.plan.nodes)


def test_every_host_reaches_every_other_across_the_vms(split: Split, tmp_path) -> None:
    results = smoke.reachability(split.plan, str(tmp_path))
    assert len(results) == 8 * 7
    failed = {pair: r for pair, r in results.items() if r.get("received") != r.get("sent")}
    assert not failed, failed


def _directions(plan: Plan, links: list[int]) -> list[tuple[str, str]]:
    return [end for i in links for end in ((plan.links[i].a.node, plan.links[i].a.ifname),
                                           (plan.links[i].b.node, plan.links[i].b.ifname))]


def test_every_link_delivers_its_rate_within_5_percent_tunnels_included(
        split: Split, tmp_path) -> None:
    plan = split.plan
    tunnels = [t.link for t in split.placement.tunnels]
    roles = {n.name: n.role for n in plan.nodes}
    local_uplinks = [li.index for li in plan.links if li.index not in tunnels
                     and roles[li.a.node] == roles[li.b.node] == "switch"]
    host_links = [li.index for li in plan.links
                  if "host" in (roles[li.a.node], roles[li.b.node])]
    off = []
    for phase in (tunnels, local_uplinks, host_links):
        for res in smoke.port_streams(plan, _directions(plan, phase), str(tmp_path),
                                      wall_seconds=2.0):
            print(f"{res.src} -> {res.dst}: {res.ratio:.3f} of the link's rate")
            if abs(res.ratio - 1) > 0.05:
                off.append((res.src, res.dst, round(res.ratio, 3)))
    assert not off, off


def _pfc_snapshot(split: Split, vm: str, node: str) -> dict:
    agents = split.state_dirs[vm] / split.plan.lab / "agents"
    return read_snapshot(socket_path(agents, f"{node}-pfc", split.plan.lab), timeout_s=5)


def _pause_rx(split: Split, vm: str, node: str, port: str) -> int:
    rows = _pfc_snapshot(split, vm, node)["ports"]
    return next(r["pause_rx"] for r in rows if r["port"] == port and r["tclass"] == LOSSLESS_TC)


def test_a_pfc_pause_crosses_the_tunnel_and_the_lossless_class_loses_nothing(
        split: Split, tmp_path) -> None:
    """A 4:1 incast of lossless traffic from vm1's hosts into h5 on vm2: leaf2 pauses
    the spines feeding it, spine1 (on vm1) through the tunnel."""
    plan = split.plan
    vm_of = split.placement.nodes
    receiver = "h5"
    leaf = plan.node(receiver).interfaces[0].peer.node
    crossing = [t for t in split.placement.tunnels if leaf in (t.a.node, t.b.node)]
    assert crossing, "the receiver's leaf has no link to another VM in this placement"
    far = [(t.b if t.a.node == leaf else t.a) for t in crossing]
    before = {(e.node, e.ifname): _pause_rx(split, vm_of[e.node], e.node, e.ifname)
              for e in far}
    senders = [h.name for h in plan.hosts() if vm_of[h.name] != vm_of[receiver]][:4]
    assert len(senders) == 4
    _incast(plan, senders, receiver, tmp_path, wall_seconds=2.0)
    after = {(e.node, e.ifname): _pause_rx(split, vm_of[e.node], e.node, e.ifname)
             for e in far}
    crossed = {k: after[k] - before[k] for k in after}
    print(f"PFC frames received through the tunnel: {crossed}")
    assert any(v > 0 for v in crossed.values()), crossed
    # nothing lost in the lossless class at any port of either VM
    for node in plan.nodes:
        for iface in node.interfaces:
            counters = portprog.read_counters(portprog.pin_dir_of(plan.lab, node.name,
                                                                  iface.ifname))
            c = counters.get(LOSSLESS_TC)
            if c is not None:
                assert c.tail_drops == c.mmu_drops == c.desc_drops == 0, (node.name, c)
                assert c.dep_unmatched == 0, (node.name, iface.ifname, c)


def _incast(plan: Plan, senders: list[str], receiver: str, tmp_path: Path,
            wall_seconds: float) -> None:
    """Each sender at 1.1 x its NIC's rate into `receiver`, lossless class, at once."""
    d = plan.timebase
    ready = tmp_path / "recv.ready"
    recv = start_agent(plan.lab, plan.node(receiver).netns, "agents.udp",
                       ["recv", "--port", "5001", "--ready-file", str(ready),
                        "--dilation", str(d.factor)], "recv-incast")
    procs = []
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for src in senders:
            nic = plan.node(src).interfaces[0]
            procs.append(start_agent(
                plan.lab, plan.node(src).netns, "agents.udp",
                ["send", "--dst", host_address(plan, receiver), "--dport", "5001",
                 "--rate-bps", str(round(nic.egress.rate_bps * 1.1)),
                 "--size", str(plan.mtu_bytes - 28), "--dscp", str(LOSSLESS_DSCP),
                 "--duration-ns", str(round(d.to_fabric_ns_from_wall_s(wall_seconds))),
                 "--dilation", str(d.factor)], f"send-{src}"))
        for p in procs:
            p.result(timeout_s=wall_seconds * 3 + 20)
        time.sleep(1.0)         # the paused queues drain
    finally:
        for p in [*procs, recv]:
            p.stop()


def test_down_removes_one_part_and_leaves_the_other(split: Split) -> None:
    """Run last in the module: vm2's part comes down while vm1's stays whole (its
    namespaces and its pins), then vm1's."""
    lab = split.plan.lab
    res = _testbed(split.state_dirs["vm2"], "down", lab)
    assert "removed" in res.stdout
    here = set(list_testbed_namespaces())
    for name in split.parts["vm2"].nodes:
        assert split.plan.node(name).netns not in here
    for name in split.parts["vm1"].nodes:
        assert split.plan.node(name).netns in here
        assert (portprog.PIN_ROOT / lab / name).exists()
    assert f"tb-{lab}-vx-vm1" in here and f"tb-{lab}-vx-vm2" not in here
    _testbed(split.state_dirs["vm1"], "down", lab)


def _part_run(tmp: Path, fabric: Path, vms: Path, vm: str, underlay: str,
              start_at_ns: int) -> subprocess.Popen:
    env = {**os.environ, "TESTBED_STATE_DIR": str(tmp / f"state-{vm}")}
    return subprocess.Popen(
        [sys.executable, "-m", "testbed", "run", str(fabric), "--vms", str(vms), "--vm", vm,
         "--underlay-netns", underlay, "--start-at-unix-ns", str(start_at_ns),
         "--stop-file", str(tmp / f"stop-{vm}"), "--runs-dir", str(tmp / f"runs-{vm}"),
         "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_run_over_two_vms_merges_into_one_run_directory_covering_every_node(
        tmp_path) -> None:
    """The default fabric's workload (an incast into h8 from h1, h2 on vm1 and h5, h6 on
    vm2) run as two parts with one common start, as Ansible's run.yml drives it: each
    part until its own senders are done, then until the controller's stop file; then
    `merge_parts`. The merged run has every node's ports, every stream's result, the
    pauses that crossed the tunnel, and invariants that held; merging without vm2's
    part names vm2 and its nodes and keeps vm1's data."""
    from testbed.run.merge import merge_parts

    lab = unique_lab("dist")
    fabric, vms, plan = _fabric(tmp_path, lab)
    procs: dict[str, subprocess.Popen] = {}
    try:
        with underlay_pair(lab) as underlay:
            start = time.time_ns() + 8_000_000_000       # room for both builds
            for vm, netns in underlay.items():
                procs[vm] = _part_run(tmp_path, fabric, vms, vm, netns, start)
            # the controller: once every part's senders are done, every part may stop
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(
                    list((tmp_path / f"runs-{vm}").glob("*/senders-done")) for vm in procs):
                assert all(p.poll() is None for p in procs.values()), {
                    vm: p.communicate() for vm, p in procs.items() if p.poll() is not None}
                time.sleep(0.1)
            for vm in procs:
                (tmp_path / f"stop-{vm}").touch()
            outs = {vm: p.communicate(timeout=120) for vm, p in procs.items()}
    finally:
        for vm, p in procs.items():
            if p.poll() is None:
                p.kill()
                p.wait()
            _testbed(tmp_path / f"state-{vm}", "down", lab, check=False)
    assert all(p.returncode == 0 for p in procs.values()), outs
    assert not [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}-")]
    parts = {vm: Path(outs[vm][0].strip().splitlines()[-1]) for vm in procs}
    for vm, part in parts.items():
        assert json.loads((part / "part.json").read_text())["vm"] == vm

    merged = merge_parts(list(parts.values()), tmp_path / "merged")
    s = merged.summary
    assert sorted({p["node"] for p in s["ports"]}) == sorted(n.name for n in plan.nodes)
    rows = [r for w in s["workloads"] for r in w["results"]]
    assert sorted(r["src"] for r in rows) == ["h1", "h2", "h5", "h6"], rows
    assert all(r["rx_packets"] == r["tx_packets"] > 0 and r["lost"] == 0 for r in rows), rows
    # pauses crossed a tunnel (which one depends on the spine ECMP picked for h1, h2:
    # leaf2 pauses spine1 across it, or spine2 pauses leaf1 across it)
    ends = {(e.node, e.ifname) for t in partition(
        plan, load_vms_text(VMS, "vms.yaml").vms_file).tunnels for e in (t.a, t.b)}
    assert sum(p["pause_rx"] for p in s["ports"] if (p["node"], p["port"]) in ends) > 0, \
        [p for p in s["ports"] if (p["node"], p["port"]) in ends]
    assert s["totals"]["drops"] == 0
    assert all(c["held"] is True for c in s["invariants"]["checks"].values()), \
        s["invariants"]
    assert [p["vm"] for p in s["parts"]] == ["vm1", "vm2"] and s["missing_vms"] == []
    # vm2 measured its clock against vm1 (the VMs file's first) over the underlay: one
    # clock here, so the offset is 0 within the measurement's own bound (rtt / 2)
    clock = s["parts"][1]["clock"]
    assert clock["reference"] == "vm1" and clock["exchanges"] > 0, clock
    assert abs(clock["offset_ns"]) <= clock["uncertainty_ns"], clock
    assert s["parts"][0]["clock"] is None
    assert (merged.run_dir / "report.html").exists()
    report = (merged.run_dir / "report.html").read_text()
    assert all(n.name in report for n in plan.nodes)
    md = (merged.run_dir / "report.md").read_text()
    assert "ran over several VMs" in md and "against vm1" in md, md

    alone = merge_parts([parts["vm1"]], tmp_path / "merged").summary
    assert alone["missing_vms"] == ["vm2"]
    assert any("vm2" in n and "h8" in n for n in alone["fidelity"]), alone["fidelity"]
    assert {p["node"] for p in alone["ports"]} == set(split_nodes(plan, "vm1"))


def split_nodes(plan: Plan, vm: str) -> list[str]:
    placement = partition(plan, load_vms_text(VMS, "vms.yaml").vms_file)
    return [n for n, v in placement.nodes.items() if v == vm]
