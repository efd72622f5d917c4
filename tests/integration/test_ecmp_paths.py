"""Paths through the ECMP fabric as the kernel forwards them, and RoCE QPs pinned to one.

A two-spine leaf-spine with 100G host and fabric links, so the leaf's uplink to a spine is
the bottleneck of two streams that hash onto it. testbed/net/paths.py predicts each
flow's hops from the kernels' own route lookups; the first test sends real datagrams
and reads the ports' counters, the others run RoCE entries pinned with `via:` (the
incident library's ecmp-collision and its control) and report each stream's goodput.
The streams run without congestion control (cc: none), so PFC alone shares a congested
uplink: DCQCN, which has not settled in a run this short, would cut both below their
share and blur the collision (measured with DCQCN over 3 ms: 30 and 39 Gb/s).
"""

from __future__ import annotations

import socket
import time

import pytest

from testbed.config import load_config_text
from testbed.net import namespaces
from testbed.net.counters import read_counters
from testbed.net.namespaces import list_testbed_namespaces
from testbed.net.paths import PathError, RouteLookup, flow_path, pick_sport, pick_sports
from testbed.plan import Plan, compile_plan
from testbed.plan.paths import host_address
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab
from tests.integration.conftest import built_lab

pytestmark = pytest.mark.root

FABRIC = """\
name: {name}
dilation: {d}
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: {per_leaf}
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 100GBASE-CR1, length: 2m}}
"""

DPORT = 4791
PROBES = 20          # datagrams per source port


def _tx_packets(plan: Plan) -> dict[tuple[str, str], int]:
    ifaces, _ = read_counters(plan)
    return {(c.node, c.ifname): c.tx_packets for c in ifaces}


def _send(plan: Plan, src: str, dst_ip: str, sport: int) -> None:
    with namespaces.inside(plan.node(src).netns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((host_address(plan, src), sport))
        for _ in range(PROBES):
            sock.sendto(b"p" * 64, (dst_ip, DPORT))
            time.sleep(0.0005)
    finally:
        sock.close()


def _uplink(plan: Plan, leaf: str, spine: str) -> str:
    return next(i.ifname for i in plan.node(leaf).interfaces if i.peer.node == spine)


def test_forwarded_datagrams_take_the_path_flow_path_predicts():
    with built_lab(FABRIC, "ecmpp", d=100, per_leaf=1) as plan:
        src, dst = "h1", "h2"
        dst_ip = host_address(plan, dst)
        with namespaces.inside(plan.node(dst).netns):
            sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # no ICMP back
        sink.bind((dst_ip, DPORT))
        try:
            with RouteLookup(plan) as lookup:
                spines_seen = set()
                for sport in range(49152, 49152 + 24):
                    path = flow_path(plan, src, dst_ip, sport, DPORT, lookup=lookup)
                    assert path[0] == ("h1", "eth0") and path[1][0] == "leaf1"
                    assert path[-1][0] == "leaf2" and len(path) == 4
                    spine = path[2][0]
                    spines_seen.add(spine)
                    other = "spine2" if spine == "spine1" else "spine1"
                    before = _tx_packets(plan)
                    _send(plan, src, dst_ip, sport)
                    time.sleep(0.1)
                    after = _tx_packets(plan)
                    moved = {k: after[k] - before.get(k, 0) for k in after}
                    for hop in path:
                        assert moved[hop] >= PROBES, (sport, hop, path, moved)
                    assert moved[("leaf1", _uplink(plan, "leaf1", other))] < PROBES, (
                        sport, path, moved)
                # an L4 hash over 24 ports uses both spines
                assert spines_seen == {"spine1", "spine2"}
                # the lowest port through each spine, and each really goes that way
                for spine in ("spine1", "spine2"):
                    sport = pick_sport(plan, src, dst, [spine], dport=DPORT, lookup=lookup)
                    assert 49152 <= sport < 49152 + 24
                    before = _tx_packets(plan)
                    _send(plan, src, dst_ip, sport)
                    time.sleep(0.1)
                    after = _tx_packets(plan)
                    up = ("leaf1", _uplink(plan, "leaf1", spine))
                    assert after[up] - before[up] >= PROBES, (spine, sport)
                picked = pick_sports(plan, src, dst, ["spine1"], dport=DPORT, count=3,
                                     lookup=lookup)
                ports = [p for p, _ in picked]
                assert ports == sorted(ports) and len(set(ports)) == 3
                assert all(("spine1", p[2][1]) == p[2] for _, p in picked)
                # a port range in which no port goes through spine2
                one = [p for p in range(49152, 49152 + 24) if flow_path(
                    plan, src, dst_ip, p, DPORT, lookup=lookup)[2][0] == "spine1"][0]
                with pytest.raises(PathError, match=r"entry x: only 0 of 1 source port.*"
                                   r"through spine2; port \d+ goes h1:eth0 -> leaf1:"):
                    pick_sport(plan, src, dst, ["spine2"], dport=DPORT,
                               ports=range(one, one + 1), entry="entry x", lookup=lookup)
                with pytest.raises(PathError, match="no equal-cost path from h1 to h2 crosses"):
                    pick_sport(plan, src, dst, ["leaf9"], dport=DPORT, lookup=lookup)
        finally:
            sink.close()


# 25 Mb/s of wall rate per 100G port: a CPU-starved Python sender (a loaded 2-core VM)
# reads as a slow stream, which would blur the difference this measures.
RUN_DILATION = 4000
PINNED_RUN = FABRIC + """\
workload:
  drain: 100us
  traffic:
    - {{name: a, kind: roce_pairs, pairs: [[h1, h3]], duration: {duration}, cc: none,
        via: [spine1]}}
    - {{name: b, kind: roce_pairs, pairs: [[h2, h4]], duration: {duration}, cc: none,
        via: [{via_b}]}}
"""


def _pinned_run(tmp_path, via_b: str) -> tuple[Plan, dict, dict, list[dict]]:
    lab = unique_lab("ecmpr")
    loaded = load_config_text(PINNED_RUN.format(name=lab, d=RUN_DILATION, per_leaf=2,
                                                duration="5ms", via_b=via_b), "pinned.yaml")
    plan = compile_plan(loaded)
    said: list[str] = []
    result = run_config(loaded, plan, RunOptions(runs_root=tmp_path, say=said.append))
    assert not [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}-")]
    store = Store(result.run_dir / "counters.sqlite")
    try:
        rows = {r["workload"]: r for r in store.results()}
        packets = store.last_values("class_packets")
        events = store.events("path_pinned")
    finally:
        store.close()
    assert result.summary["interrupted"] is False, said
    pinned_lines = [m for m in said if m.startswith("paths: ")]
    print("", *pinned_lines, sep="\n")
    assert len(pinned_lines) == 2 and all(" -> leaf1:" in m for m in pinned_lines), said
    return plan, rows, packets, events


def _data_packets(plan: Plan, packets: dict, node: str, peer: str) -> int:
    port = next(i.ifname for i in plan.node(node).interfaces if i.peer.node == peer)
    return int(packets.get((node, port, 3), 0))


def _check_pinned(plan: Plan, rows: dict, events: list[dict], vias: dict[str, str]) -> None:
    assert sorted(e["traffic"] for e in events) == ["a", "b"]
    for e in events:
        spine = vias[e["traffic"]]
        assert e["via"] == [spine] and len(e["sports"]) == 1
        assert f"-> {spine}:" in e["paths"][0]
        assert rows[e["traffic"]]["sports"] == e["sports"]
        assert rows[e["traffic"]]["via"] == [spine]
    for name, row in rows.items():
        assert row["error"] is None and row["verified"] is True, (name, row)


def test_two_qps_pinned_through_one_spine_share_its_uplink_while_the_other_idles(tmp_path):
    plan, rows, packets, events = _pinned_run(tmp_path, "spine1")
    _check_pinned(plan, rows, events, {"a": "spine1", "b": "spine1"})
    sent = sum(r["tx_packets"] for r in rows.values())
    via1 = _data_packets(plan, packets, "leaf1", "spine1")
    via2 = _data_packets(plan, packets, "leaf1", "spine2")
    print(f"\ncollided (both via spine1): a {rows['a']['gbps']:.1f} Gb/s, "
          f"b {rows['b']['gbps']:.1f} Gb/s; leaf1->spine1 {via1} packets, "
          f"leaf1->spine2 {via2}, spine2->leaf2 "
          f"{_data_packets(plan, packets, 'spine2', 'leaf2')}")
    assert via1 >= 0.99 * sent
    assert via2 < 0.01 * sent
    assert _data_packets(plan, packets, "spine2", "leaf2") < 0.01 * sent
    # one 100G uplink for two 100G senders: about half each, together the uplink
    for name in ("a", "b"):
        assert 35 <= rows[name]["gbps"] <= 60, rows[name]
    assert rows["a"]["gbps"] + rows["b"]["gbps"] <= 100


def test_qps_pinned_through_different_spines_each_get_the_line_rate(tmp_path):
    plan, rows, packets, events = _pinned_run(tmp_path, "spine2")
    _check_pinned(plan, rows, events, {"a": "spine1", "b": "spine2"})
    via1 = _data_packets(plan, packets, "leaf1", "spine1")
    via2 = _data_packets(plan, packets, "leaf1", "spine2")
    print(f"\nspread (a via spine1, b via spine2): a {rows['a']['gbps']:.1f} Gb/s, "
          f"b {rows['b']['gbps']:.1f} Gb/s; leaf1->spine1 {via1} packets, "
          f"leaf1->spine2 {via2}")
    assert via1 >= 0.99 * rows["a"]["tx_packets"] and via2 >= 0.99 * rows["b"]["tx_packets"]
    for name in ("a", "b"):
        assert rows[name]["gbps"] >= 80, rows[name]
