"""One PFC agent process serving several nodes (agents/pfc --group, docs/pfc.md).

- the grouping rule (testbed/run/fabric_agents.pfc_groups): how many processes, which
  nodes each serves, every node exactly once;
- the --group file's refusals;
- per-node state separation: two nodes' Agents in one Loop, with their ports on
  socketpairs and their gates on a fake netlink, see only their own frames, timers and
  counters.
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from agents.pfc import __main__ as pfc
from agents.wire import pfc as pfcwire
from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.run.fabric_agents import (
    PFC_MAX_NODES_PER_PROCESS,
    PFC_ONE_PER_NODE_UP_TO,
    pfc_groups,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    text = (REPO / "configs/examples/incast-pfc.yaml").read_text()
    return compile_plan(load_config_text(text, "incast-pfc.yaml"))


class FakeNode:
    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role


def fabric(switches: int, hosts: int) -> list[FakeNode]:
    return ([FakeNode(f"h{i}", "host") for i in range(hosts)]
            + [FakeNode(f"s{i}", "switch") for i in range(switches)])


def names(groups) -> list[list[str]]:
    return [[n.name for n in g] for g in groups]


def test_one_per_node_is_one_process_per_node():
    nodes = fabric(4, 8)
    groups = pfc_groups(nodes, 1)          # type: ignore[arg-type]
    assert len(groups) == 12 and all(len(g) == 1 for g in groups)


def test_auto_keeps_one_process_per_node_on_small_fabrics():
    for switches, hosts in ((4, 8), (4, PFC_ONE_PER_NODE_UP_TO - 4)):
        groups = pfc_groups(fabric(switches, hosts), None, cpus=2)  # type: ignore[arg-type]
        assert all(len(g) == 1 for g in groups) and len(groups) == switches + hosts


def test_auto_is_one_process_per_cpu_below_the_cap():
    nodes = fabric(4, PFC_ONE_PER_NODE_UP_TO - 3)     # one node past one-per-node
    groups = names(pfc_groups(nodes, None, cpus=3))   # type: ignore[arg-type]
    assert len(groups) == 3
    # switches dealt first, round-robin: no process gets two before each has one
    assert sorted(sum(n.startswith("s") for n in g) for g in groups) == [1, 1, 2]
    assert sorted(sum(groups, [])) == sorted(n.name for n in nodes)


def test_auto_caps_nodes_per_process():
    nodes = fabric(12, 128)                # 140 nodes, the 128-host leaf-spine
    groups = pfc_groups(nodes, None, cpus=2)   # type: ignore[arg-type]
    assert len(groups) == -(-140 // PFC_MAX_NODES_PER_PROCESS)
    assert max(len(g) for g in groups) <= PFC_MAX_NODES_PER_PROCESS
    flat = [n.name for g in groups for n in g]
    assert sorted(flat) == sorted(n.name for n in nodes) and len(set(flat)) == 140


def test_auto_never_more_processes_than_nodes():
    nodes = fabric(1, PFC_ONE_PER_NODE_UP_TO)
    assert len(pfc_groups(nodes, None, cpus=64)) == len(nodes)   # type: ignore[arg-type]


def test_fixed_nodes_per_process():
    groups = pfc_groups(fabric(4, 8), 5)   # type: ignore[arg-type]
    assert [len(g) for g in groups] == [4, 4, 4]


def test_zero_nodes_per_process_refused():
    with pytest.raises(ValueError, match="1 or more"):
        pfc_groups(fabric(1, 1), 0)        # type: ignore[arg-type]


def test_group_file_refusals(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"nodes": []}))
    with pytest.raises(ValueError, match="non-empty"):
        pfc.read_group(str(path))
    path.write_text(json.dumps({"nodes": [{"node": "a", "plan": "p"}]}))
    with pytest.raises(ValueError, match=r"nodes\[0\] lacks netns"):
        pfc.read_group(str(path))
    entry = {"node": "a", "plan": "p", "netns": "/var/run/netns/x"}
    path.write_text(json.dumps({"nodes": [entry, entry]}))
    with pytest.raises(ValueError, match="listed twice"):
        pfc.read_group(str(path))


# --- two nodes in one loop ------------------------------------------------------------

class FakeRequester:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def request(self, message: bytes) -> None:
        self.sent.append(message)

    def close(self) -> None:
        pass


class Wires:
    """Each (port) socket the agents open is one end of a socketpair; the test holds the
    other (its peer's wire)."""

    def __init__(self) -> None:
        self.far: dict[str, list[socket.socket]] = {}

    def open(self, ifname: str, bypass: bool = True) -> socket.socket:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        a.setblocking(False)
        b.setblocking(False)
        self.far.setdefault(ifname, []).append(b)
        return a


class StopAfter:
    def __init__(self, n: int) -> None:
        self.n = n

    def should_stop(self) -> bool:
        self.n -= 1
        return self.n < 0


@pytest.fixture
def two_nodes(plan, tmp_path, monkeypatch):
    """Agents of h1 and h2 (both hosts: no node maps) in one Loop."""
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    wires: dict[str, Wires] = {}
    requesters: list[FakeRequester] = []

    def requester() -> FakeRequester:
        requesters.append(FakeRequester())
        return requesters[-1]

    monkeypatch.setattr(pfc.gates, "Requester", requester)
    monkeypatch.setattr(pfc.socket, "if_nametoindex", lambda _name: 7)
    monkeypatch.setattr(pfc, "PIN_ROOT", tmp_path / "nopins")
    loop = pfc.Loop()
    for node in ("h1", "h2"):
        w = wires[node] = Wires()
        monkeypatch.setattr(pfc, "_open_sock", w.open)
        agent = pfc.Agent(argparse.Namespace(
            plan=str(plan_path), node=node, events=str(tmp_path / f"{node}.jsonl"),
            watchdog_ns=0))
        loop.add(agent)
    yield loop, wires, requesters, tmp_path
    for agent in loop.agents:
        agent.close()
    loop.close()
    for w in wires.values():
        for socks in w.far.values():
            for s in socks:
                s.close()


def test_a_frame_pauses_only_its_own_node(two_nodes):
    loop, wires, requesters, tmp_path = two_nodes
    h1, h2 = loop.agents
    port = h2.ports[0]
    tc = next(iter(port.pfc_classes))
    # a PAUSE for the lossless class arrives on h2's NIC (its port socket's far end)
    wires["h2"].far[port.ifname][0].send(pfcwire.encode(b"\x02" * 6, {tc: pfcwire.MAX_QUANTA}))
    loop.run(StopAfter(2))
    s1, s2 = h1.snapshot(), h2.snapshot()
    row1 = next(r for r in s1["ports"] if r["tclass"] == tc)
    row2 = next(r for r in s2["ports"] if r["tclass"] == tc)
    assert (row2["pause_rx"], row2["paused"]) == (1, 1)
    assert (row1["pause_rx"], row1["paused"]) == (0, 0)
    # only h2's gate closed, through h2's own netlink socket
    assert [len(r.sent) for r in requesters] == [0, 1]
    assert h2.paused_state == {(port.ifname, tc): True} and h1.paused_state == {}
    # each node's snapshot says it shares its process, and the events stay per node
    assert s1["process_nodes"] == s2["process_nodes"] == 2
    events = [json.loads(x) for x in (tmp_path / "h2.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["pfc_paused"] and events[0]["node"] == "h2"
    assert not (tmp_path / "h1.jsonl").read_text()


def test_commands_reach_their_own_node(two_nodes):
    loop, _wires, _requesters, _tmp = two_nodes
    h1, h2 = loop.agents
    port = h2.ports[0]
    tc = next(iter(port.pfc_classes))
    reply = h2.command({"op": "pfc", "port": port.ifname, "tc": tc, "enabled": False})
    assert reply["enabled"] is False
    assert not h2.requests.enabled(port.ifname, tc)
    assert h1.requests.enabled(h1.ports[0].ifname, tc)
