"""What `up` leaves in the kernel, read back with ip(8) and tc(8) and checked against the plan.

The regression net for the builder's fast path (batched netlink, tc templates,
namespaces made without forking): every link, address, route, HTB class, leaf
qdisc, DSCP filter and sysctl the plan asks for is there with the plan's values,
nothing else is, and the initial namespace is exactly as it was. Failures injected
into a plan must name the node, the request and the kernel's reason, and leave
nothing behind.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from testbed.net import BuildError, LabState, apply_plan, destroy_lab, namespaces
from testbed.plan.model import EgressPlan, NodePlan, Plan
from tests.integration.conftest import initial_namespace_snapshot, plan_from_file

pytestmark = pytest.mark.root

PLANS = {
    # 2 spines x 2 leaves x 4 hosts: ECMP over both spines, 100G and 400G ports.
    "leaf-spine": "configs/default.yaml",
    # A dual-homed host (ECMP at a host), a custom class plan, explicit links.
    "explicit": "tests/golden/explicit.yaml",
}

CARRIER_FLAGS = {"NO-CARRIER", "LOWER_UP", "M-DOWN"}

_forks = {"n": 0}
os.register_at_fork(before=lambda: _forks.__setitem__("n", _forks["n"] + 1))


# ---------------------------------------------------------------- reading the kernel

def run(*argv: str) -> str:
    res = subprocess.run(argv, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(argv)}: {res.stderr.strip()}"
    return res.stdout


def run_json(*argv: str):
    return json.loads(run(*argv) or "[]")


def parse_rate_bps(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)bit", text)
    assert m, f"not a tc rate: {text!r}"
    return round(float(m.group(1)) * 1000 ** " KMGT".index(m.group(2) or " "))


def parse_htb_classes(text: str) -> dict[str, dict[str, str]]:
    """`tc -d class show dev X` -> {classid: {key: value}}; tc's JSON has no HTB fields."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if words[:2] != ["class", "htb"]:
            continue
        fields: dict[str, str] = {}
        rest = words[3:]
        while rest:
            if rest[0] == "root":
                fields["parent"] = "root"
                rest = rest[1:]
            else:
                fields.setdefault(rest[0], rest[1])
                rest = rest[2:]
        out[words[2]] = fields
    return out


def tos_match(match: dict) -> tuple[int, int]:
    """(TOS value, TOS mask) of a u32 key, whatever offset the key was stored at."""
    value, mask, off = int(match["value"], 16), int(match["mask"], 16), int(match["off"])
    at = 1 - off          # the TOS byte's place in the 32-bit window that starts at `off`
    assert 0 <= at < 4, f"u32 key at offset {off} does not cover the TOS byte: {match}"
    shift = 8 * (3 - at)
    assert mask & ~(0xFF << shift) == 0, f"u32 key matches more than the TOS byte: {match}"
    return (value >> shift) & 0xFF, (mask >> shift) & 0xFF


@dataclass
class Port:
    qdiscs: list[dict]
    classes: dict[str, dict[str, str]]
    filters: list[dict]


@dataclass
class NodeState:
    links: dict[str, dict]
    addrs: dict[str, list[dict]]
    routes: list[dict]
    nsids: dict[int, str]
    sysctls: dict[str, str]
    ports: dict[str, Port] = field(default_factory=dict)


def read_node(node: NodePlan) -> NodeState:
    ns = node.netns
    links = {x["ifname"]: x for x in run_json("ip", "-n", ns, "-j", "-d", "link", "show")}
    for link in links.values():
        # Carrier follows a moment after `up` (linkwatch): not the builder's doing.
        link.pop("operstate", None)
        link["flags"] = [f for f in link["flags"] if f not in CARRIER_FLAGS]
    addrs = {x["ifname"]: x["addr_info"] for x in run_json("ip", "-n", ns, "-j", "addr", "show")}
    nsids = {x["nsid"]: x.get("name") for x in run_json("ip", "-n", ns, "-j", "netns", "list-id")}
    with namespaces.inside(ns):
        sysctls = {key: read_sysctl(key) for key in node.sysctls}
    state = NodeState(links, addrs, run_json("ip", "-n", ns, "-j", "route", "show"), nsids,
                      sysctls)
    for iface in node.interfaces:
        dev = iface.ifname
        state.ports[dev] = Port(
            run_json("tc", "-n", ns, "-j", "-d", "qdisc", "show", "dev", dev),
            parse_htb_classes(run("tc", "-n", ns, "-d", "class", "show", "dev", dev)),
            run_json("tc", "-n", ns, "-j", "filter", "show", "dev", dev))
    return state


def read_sysctl(key: str) -> str:
    with open("/proc/sys/" + key.replace(".", "/")) as fh:
        return fh.read().strip()


def initial_sysctls(plan: Plan) -> dict[str, str]:
    """The plan's sysctls as the initial namespace has them (those it has at all)."""
    out = {}
    for key in {key for node in plan.nodes for key in node.sysctls}:
        try:
            out[key] = read_sysctl(key)
        except FileNotFoundError:
            pass
    return out


@dataclass
class Built:
    plan: Plan
    nodes: dict[str, NodeState]
    initial_before: dict
    initial_during: dict
    sysctls_before: dict[str, str]
    sysctls_during: dict[str, str]
    forks_during_up: int
    state_at_start: LabState | None
    existing_at_start: list[str]


@pytest.fixture(scope="module", params=list(PLANS))
def built(request):
    plan = plan_from_file(PLANS[request.param], "bstate")
    initial_before, sysctls_before = initial_namespace_snapshot(), initial_sysctls(plan)
    seen: dict = {}

    def progress(message: str) -> None:
        if message.startswith("creating") and "namespaces" in message:
            seen["state"] = LabState.load(plan.lab)
            seen["existing"] = [n.netns for n in plan.nodes if namespaces.exists(n.netns)]

    try:
        forks = _forks["n"]
        report = apply_plan(plan, progress)
        forks = _forks["n"] - forks
        assert not report.already_up
        nodes = {node.name: read_node(node) for node in plan.nodes}
        yield Built(plan, nodes, initial_before, initial_namespace_snapshot(),
                    sysctls_before, initial_sysctls(plan), forks, seen.get("state"),
                    seen.get("existing", []))
    finally:
        destroy_lab(plan.lab)
    assert not [ns for ns in namespaces.list_testbed_namespaces()
                if ns.startswith(plan.netns_prefix)]
    assert initial_namespace_snapshot() == initial_before


# ---------------------------------------------------------------- the built lab

def test_state_lists_every_namespace_before_any_is_made(built):
    state = built.state_at_start
    assert state is not None and state.status == "building"
    assert state.netns == [n.netns for n in built.plan.nodes]
    assert built.existing_at_start == []


def test_up_forks_nothing(built):
    assert built.forks_during_up == 0


def test_initial_namespace_links_addresses_routes_and_sysctls_are_unchanged(built):
    assert built.initial_during == built.initial_before
    assert built.sysctls_during == built.sysctls_before


def test_sysctls_are_set_inside_every_namespace(built):
    for node in built.plan.nodes:
        assert built.nodes[node.name].sysctls == node.sysctls, node.name


def test_every_interface_has_its_mac_mtu_peer_and_is_up(built):
    plan = built.plan
    for node in plan.nodes:
        state = built.nodes[node.name]
        assert set(state.links) == {"lo"} | {i.ifname for i in node.interfaces}, node.name
        assert "UP" in state.links["lo"]["flags"]
        for iface in node.interfaces:
            link = state.links[iface.ifname]
            where = f"{node.name}:{iface.ifname}"
            assert link["linkinfo"]["info_kind"] == "veth", where
            assert link["address"] == iface.mac, where
            assert link["mtu"] == iface.mtu_bytes, where
            assert "UP" in link["flags"], where
            peer_node = plan.node(iface.peer.node)
            assert state.nsids[link["link_netnsid"]] == peer_node.netns, where
            peer_link = built.nodes[peer_node.name].links[iface.peer.ifname]
            assert link["link_index"] == peer_link["ifindex"], where


def test_every_link_gets_carrier(built):
    deadline = time.monotonic() + 5
    while True:
        down = [f"{node.name}:{link['ifname']} {link['operstate']}"
                for node in built.plan.nodes
                for link in run_json("ip", "-n", node.netns, "-j", "link", "show")
                if link["ifname"] != "lo" and link["operstate"] != "UP"]
        if not down or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert down == []


def test_every_interface_has_exactly_its_plan_address(built):
    for node in built.plan.nodes:
        state = built.nodes[node.name]
        assert {(a["local"], a["prefixlen"]) for a in state.addrs["lo"]
                if a["family"] == "inet"} == {("127.0.0.1", 8)}
        for iface in node.interfaces:
            address, prefixlen = iface.address.split("/")
            got = [(a["family"], a["local"], a["prefixlen"]) for a in state.addrs[iface.ifname]]
            assert got == [("inet", address, int(prefixlen))], f"{node.name}:{iface.ifname}"


def _network(dst: str) -> str:
    return str(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32"))


def test_routes_are_the_plans_and_the_connected_31s_with_every_next_hop(built):
    for node in built.plan.nodes:
        expected = set()
        for iface in node.interfaces:
            net = ipaddress.ip_interface(iface.address)
            expected.add((str(net.network), "kernel", frozenset({(None, iface.ifname)})))
        for route in node.routes:
            expected.add((_network(route.dst), "static",
                          frozenset((h.gateway, h.ifname) for h in route.nexthops)))
        got = set()
        for r in built.nodes[node.name].routes:
            hops = r.get("nexthops") or [r]
            assert all(h.get("weight", 1) == 1 for h in hops), r
            got.add((_network(r["dst"]), r["protocol"],
                     frozenset((h.get("gateway"), h["dev"]) for h in hops)))
        assert got == expected, node.name
    # The plans do exercise ECMP: a spine-bound multipath on the leaf-spine, a
    # dual-homed host's default in the explicit plan.
    assert any(len(r.nexthops) > 1 for n in built.plan.nodes for r in n.routes)


def _classes_of(egress: EgressPlan):
    return {f"{c.classid}": c for c in egress.classes}


def test_every_port_has_the_plans_htb_classes(built):
    for node in built.plan.nodes:
        for iface in node.interfaces:
            egress, where = iface.egress, f"{node.name}:{iface.ifname}"
            classes = built.nodes[node.name].ports[iface.ifname].classes
            assert set(classes) == {"1:1"} | set(_classes_of(egress)), where
            port = classes["1:1"]
            assert port["parent"] == "root", where
            assert parse_rate_bps(port["rate"]) == egress.wall_rate_bps // 8 * 8, where
            assert parse_rate_bps(port["ceil"]) == egress.wall_rate_bps // 8 * 8, where
            assert int(port["overhead"]) == egress.overhead_bytes, where
            for classid, cls in _classes_of(egress).items():
                got = classes[classid]
                at = f"{where} class {classid}"
                assert got["parent"] == "1:1", at
                assert got["leaf"] == cls.leaf_handle, at
                assert int(got["prio"]) == cls.prio, at
                assert parse_rate_bps(got["rate"]) == cls.wall_rate_bps // 8 * 8, at
                assert parse_rate_bps(got["ceil"]) == cls.wall_ceil_bps // 8 * 8, at
                assert int(got["quantum"]) == egress.quantum_bytes, at
                assert int(got["overhead"]) == egress.overhead_bytes, at
                burst = int(got["burst"].split("b")[0])
                assert burst == pytest.approx(egress.burst_bytes, rel=0.005), at


def test_every_class_has_its_leaf_qdisc_kind_and_buffer_limit(built):
    kinds = set()
    for node in built.plan.nodes:
        for iface in node.interfaces:
            egress, where = iface.egress, f"{node.name}:{iface.ifname}"
            qdiscs = built.nodes[node.name].ports[iface.ifname].qdiscs
            (root,) = [q for q in qdiscs if q.get("root")]
            assert (root["kind"], root["handle"]) == ("htb", "1:"), where
            default_minor = int(egress.default_classid.split(":")[1], 16)
            assert int(root["options"]["default"], 16) == default_minor, where
            assert root["options"]["r2q"] == 10, where
            leaves = {q["parent"]: q for q in qdiscs if q.get("parent", "").startswith("1:")}
            assert set(leaves) == {c.classid for c in egress.classes}, where
            for cls in egress.classes:
                leaf, at = leaves[cls.classid], f"{where} class {cls.classid}"
                assert (leaf["kind"], leaf["handle"]) == (cls.leaf_kind, cls.leaf_handle), at
                kinds.add(leaf["kind"])
                if cls.leaf_kind == "bfifo":
                    assert leaf["options"]["limit"] == cls.limit_bytes, at
                else:
                    # tbf reports its limit as a latency: lat = (limit - burst) / rate.
                    rate = leaf["options"]["rate"]              # bytes/s
                    assert rate == egress.wall_rate_bps // 8, at  # an open gate
                    burst = int(leaf["options"]["burst"].split("b")[0])
                    limit = leaf["options"]["lat"] * rate / 1e6 + burst
                    assert abs(limit - cls.limit_bytes) <= rate / 1e6 + 2, at
    assert kinds == {"tbf", "bfifo"}        # both leaf kinds are exercised


def test_dscp_filters_send_each_dscp_to_its_class(built):
    for node in built.plan.nodes:
        for iface in node.interfaces:
            where = f"{node.name}:{iface.ifname}"
            expected = {(d, c.classid) for c in iface.egress.classes for d in c.dscp}
            got = set()
            for f in built.nodes[node.name].ports[iface.ifname].filters:
                options = f.get("options", {})
                if f.get("parent") != "1:" or "match" not in options:
                    continue
                assert (f["kind"], f["protocol"], f["pref"]) == ("u32", "ip", 10), where
                tos, mask = tos_match(options["match"])
                assert mask == 0xFC, where
                got.add((tos >> 2, options["flowid"]))
            assert got == expected, where


def test_up_again_changes_nothing(built):
    again = apply_plan(built.plan)
    assert again.already_up
    node = built.plan.nodes[-1]
    assert read_node(node) == built.nodes[node.name]


# ---------------------------------------------------------------- injected failures

def replace_node(plan: Plan, name: str, **update) -> Plan:
    nodes = [n.model_copy(update=update) if n.name == name else n for n in plan.nodes]
    return plan.model_copy(update={"nodes": nodes})


def unreachable_gateway(plan: Plan) -> tuple[Plan, str, list[str]]:
    node = plan.hosts()[-1]
    route = node.routes[0]
    hop = route.nexthops[0].model_copy(update={"gateway": "10.9.9.9"})
    bad = route.model_copy(update={"nexthops": [hop]})
    return (replace_node(plan, node.name, routes=[bad, *node.routes[1:]]), node.name,
            [f"route add {route.dst} via 10.9.9.9 dev {hop.ifname}",
             "Network is unreachable"])


def clashing_leaf_handle(plan: Plan) -> tuple[Plan, str, list[str]]:
    node = plan.switches()[-1]
    iface = node.interfaces[-1]
    first, *rest = iface.egress.classes
    victim = rest[-1]
    classes = [first, *rest[:-1], victim.model_copy(update={"leaf_handle": first.leaf_handle})]
    egress = iface.egress.model_copy(update={"classes": classes})
    interfaces = [*node.interfaces[:-1], iface.model_copy(update={"egress": egress})]
    return (replace_node(plan, node.name, interfaces=interfaces), node.name,
            [f"tc qdisc add {victim.leaf_kind} {first.leaf_handle} parent {victim.classid} "
             f"dev {iface.ifname}: "])


def missing_sysctl(plan: Plan) -> tuple[Plan, str, list[str]]:
    node = plan.nodes[-1]
    sysctls = {**node.sysctls, "net.ipv4.no_such_setting": "1"}
    return (replace_node(plan, node.name, sysctls=sysctls), node.name,
            [f"namespace {node.netns}", "writing sysctls", "no_such_setting"])


def machine_wide_sysctl(plan: Plan) -> tuple[Plan, str, list[str]]:
    node = plan.nodes[len(plan.nodes) // 2]
    sysctls = {**node.sysctls, "kernel.panic": "7"}
    return (replace_node(plan, node.name, sysctls=sysctls), node.name,
            ["kernel.panic", "not per network namespace"])


@pytest.mark.parametrize("inject", [unreachable_gateway, clashing_leaf_handle, missing_sysctl,
                                    machine_wide_sysctl])
def test_a_refused_request_names_node_and_request_and_leaves_nothing(inject):
    plan, node, phrases = inject(plan_from_file("configs/default.yaml", "bfail"))
    initial, sysctls = initial_namespace_snapshot(), initial_sysctls(plan)
    try:
        with pytest.raises(BuildError) as info:
            apply_plan(plan)
        left = [ns for ns in namespaces.list_testbed_namespaces()
                if ns.startswith(plan.netns_prefix)]
        state = LabState.load(plan.lab)
    finally:
        destroy_lab(plan.lab)      # only for a failing test: the builder must clean up
    message = str(info.value)
    assert plan.lab in message and f"node {node}:" in message, message
    for phrase in phrases:
        assert phrase in message, message
    assert left == [] and state is None
    assert initial_namespace_snapshot() == initial
    assert initial_sysctls(plan) == sysctls
