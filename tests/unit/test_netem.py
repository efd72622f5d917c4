"""The netem delay stage's pure parts: delays and losses per link direction from the
plan, netem's packet limit, IFB names, and the netlink messages (testbed/net/netem.py)."""

from __future__ import annotations

import pytest
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from testbed.config import load_config_text
from testbed.net import netem
from testbed.net.batch import TcTemplates
from testbed.net.portprog import CLSACT_INGRESS, ETH_P_ALL, FILTER_PRIO
from testbed.plan import compile_plan
from tests.conftest import REPO

# The default fabric with D pinned at 2000 (auto would take D from the machine's capacity).
PLAN = compile_plan(load_config_text(
    (REPO / "configs" / "default.yaml").read_text().replace("dilation: auto", "dilation: 2000"),
    "default.yaml"))


def _stage(node: str, port: str) -> netem.WireStage:
    [s] = [s for s in netem.wire_stages(PLAN) if (s.node, s.port) == (node, port)]
    return s


def test_every_link_direction_gets_one_stage_at_the_receiving_end():
    stages = netem.wire_stages(PLAN)
    assert len(stages) == 2 * len(PLAN.links)
    h1 = _stage("h1", "eth0")
    # what h1 sends is delayed where it arrives: leaf1's port to h1, in leaf1's namespace
    assert (h1.rx_node, h1.rx_ifname, h1.ifb) == ("leaf1", "swp1", "ifbswp1")
    assert h1.rx_netns == PLAN.node("leaf1").netns
    back = _stage("leaf1", "swp1")
    assert (back.rx_node, back.rx_ifname, back.ifb) == ("h1", "eth0", "ifbeth0")


def test_the_delay_is_the_links_phy_delay_dilated_by_the_plans_timebase():
    d = PLAN.dilation.factor
    assert d == 2000
    # 2 m DAC: 120 ns one way; 100 m DR4: 600 ns (docs/roce.md: base RTT 2.88 us)
    assert _stage("h1", "eth0").wall_delay_ns == 120 * d
    assert _stage("leaf1", "swp1").wall_delay_ns == 120 * d
    uplink = next(i for i in PLAN.node("leaf1").interfaces if i.peer.node.startswith("spine"))
    assert _stage("leaf1", uplink.ifname).wall_delay_ns == 600 * d
    for s in netem.wire_stages(PLAN):
        link = PLAN.links[next(i.link for i in PLAN.node(s.node).interfaces
                               if i.ifname == s.port)]
        assert s.wall_delay_ns == PLAN.timebase.to_wall_ns(link.delay_ns) == link.wall_delay_ns
        assert s.loss_ratio == link.frame_loss_ratio


def test_the_limit_holds_what_a_port_can_have_in_flight_with_a_margin():
    # 50 Mb/s wall for 2.4 ms: 15 KB in flight; + an 18 KB burst; in 64 B frames x 4
    assert netem.limit_packets(50_000_000, 2_400_000, 18_000) == 2063
    assert netem.limit_packets(1_000_000, 1_000, 0) == netem.MIN_LIMIT_PACKETS
    assert (netem.limit_packets(200_000_000, 10_000_000)
            > netem.limit_packets(100_000_000, 10_000_000)
            > netem.limit_packets(100_000_000, 5_000_000))
    for s in netem.wire_stages(PLAN):
        egress = next(i.egress for i in PLAN.node(s.node).interfaces if i.ifname == s.port)
        in_flight = egress.wall_rate_bps * s.wall_delay_ns / 8e9 + egress.burst_bytes
        assert s.limit_packets >= 4 * in_flight / 64


@pytest.mark.parametrize("ifname", ["eth0", "swp1", "swp12", "abcdefghijkl"])
def test_a_short_name_gets_ifb_in_front(ifname):
    assert netem.ifb_name(ifname) == "ifb" + ifname


def test_long_names_are_hashed_within_ifnamsiz_and_stay_distinct():
    long = ["abcdefghijklm", "abcdefghijklmn", "abcdefghijklmno", "uplink-to-spine1",
            "uplink-to-spine2"]
    names = [netem.ifb_name(n) for n in long]
    assert all(len(n) <= netem.IFNAMSIZ - 1 for n in names)
    assert all(n.startswith("ifh") for n in names)
    assert len(set(names)) == len(names)
    # a hashed name never equals a short one: different prefixes
    short = {netem.ifb_name(n) for n in ("a", "abc123", "deadbeef0123")}
    assert not short & set(names)


def test_every_ifb_name_of_the_default_fabric_is_unique_in_its_namespace():
    stages = netem.wire_stages(PLAN)
    keys = [(s.rx_node, s.ifb) for s in stages]
    assert len(set(keys)) == len(keys)
    ports = {(n.name, i.ifname) for n in PLAN.nodes for i in n.interfaces}
    assert not set(keys) & ports
    assert all(len(s.ifb) < netem.IFNAMSIZ for s in stages)


def test_a_clash_is_refused_before_anything_is_built():
    s = _stage("h1", "eth0")
    twin = netem.WireStage(**{**s.__dict__, "rx_ifname": "other"})
    with pytest.raises(ValueError, match="serves both"):
        netem.check_names(PLAN, [s, twin])
    clash = netem.WireStage(**{**s.__dict__, "ifb": "swp2"})
    with pytest.raises(ValueError, match="also a port's name"):
        netem.check_names(PLAN, [clash])


def _decode(message: bytes) -> tcmsg:
    msg = tcmsg(bytes(message))
    msg.decode()
    return msg


def test_the_netem_message_carries_the_delay_in_ns_the_loss_and_the_limit():
    s = netem.WireStage(node="a", port="p", rx_node="b", rx_netns="ns", rx_ifname="q",
                        ifb="ifbq", wall_delay_ns=1_234_567, loss_ratio=0.01,
                        limit_packets=5000)
    with TcTemplates() as templates:
        _what, message = templates.request("add", "netem", 7, netem.NETEM_HANDLE,
                                           s.netem_kwargs())
    msg = _decode(message)
    assert (msg["index"], msg["handle"], msg["parent"]) == (7, 0x10000, 0xFFFFFFFF)
    assert msg.get_attr("TCA_KIND") == "netem"
    opts = msg.get_attr("TCA_OPTIONS")
    assert opts.get_attr("TCA_NETEM_LATENCY64") == 1_234_567
    assert opts["limit"] == 5000
    assert opts["loss"] == pytest.approx(0.01 * (2**32 - 1), rel=1e-6)
    assert opts["jitter"] == 0
    assert opts["delay"] > 0            # whole us in ticks, for kernels before 4.15


def test_the_redirect_runs_after_the_departure_program_and_sends_to_the_ifb():
    with TcTemplates() as templates:
        _what, message = templates.request("add-filter", "u32", 7, 0,
                                           netem.redirect_filter_kwargs(42))
    msg = _decode(message)
    assert msg["parent"] == CLSACT_INGRESS
    prio, protocol = msg["info"] >> 16, msg["info"] & 0xFFFF
    assert prio == FILTER_PRIO + 1 == netem.NETEM_FILTER_PRIO
    assert protocol == int.from_bytes(ETH_P_ALL.to_bytes(2, "big"), "little")   # htons
    opts = msg.get_attr("TCA_OPTIONS")
    sel = opts.get_attr("TCA_U32_SEL")
    assert [(k["key_val"], k["key_mask"]) for k in sel["keys"]] == [(0, 0)]   # every packet
    act = opts.get_attr("TCA_U32_ACT").get_attr("TCA_ACT_PRIO_1")
    assert act.get_attr("TCA_ACT_KIND") == "mirred"
    parms = act.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
    assert (parms["eaction"], parms["ifindex"]) == (1, 42)     # egress redirect to ifindex 42


def test_the_ifb_is_created_up_with_its_name():
    msg = ifinfmsg(netem.ifb_message("ifbswp1"))
    msg.decode()
    assert msg.get_attr("IFLA_IFNAME") == "ifbswp1"
    assert msg.get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_KIND") == "ifb"
    assert msg["flags"] & 1 and msg["change"] & 1


def test_install_stage_sends_netem_then_the_redirect_and_clsact_only_when_asked():
    calls = []

    class Recorder:
        def tc(self, command, kind=None, index=0, handle=0, **kwargs):
            calls.append((command, kind, index))

    s = _stage("h1", "eth0")
    assert netem.install_stage(Recorder(), s, rx_index=3, ifb_index=9) == 2
    assert calls == [("add", "netem", 9), ("add-filter", "u32", 3)]
    calls.clear()
    assert netem.install_stage(Recorder(), s, rx_index=3, ifb_index=9, clsact=True) == 3
    assert calls == [("add", "netem", 9), ("add", "clsact", 3), ("add-filter", "u32", 3)]
