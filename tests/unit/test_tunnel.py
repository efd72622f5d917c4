"""The messages and names of a VM's tunnel ends (testbed/net/tunnel.py), without root."""

from __future__ import annotations

from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from testbed.config import load_config_text
from testbed.config.vms import load_vms_text
from testbed.net import tunnel
from testbed.net.batch import vxlan_message
from testbed.plan import compile_plan
from testbed.plan.part import local_plan, part_plan
from testbed.plan.partition import partition
from tests.conftest import REPO

VMS = """\
vms:
  - {name: vm1, underlay: 192.0.2.11, cores: 2, wall_rate_budget: 2Gbps, mtu: 9100}
  - {name: vm2, underlay: 192.0.2.12, cores: 2, wall_rate_budget: 2Gbps, mtu: 9100}
"""


def _parts():
    text = (REPO / "configs" / "default.yaml").read_text().replace("dilation: auto",
                                                                    "dilation: 2000")
    plan = compile_plan(load_config_text(text, "default.yaml"))
    placement = partition(plan, load_vms_text(VMS, "vms.yaml").vms_file)
    return plan, {vm: part_plan(plan, placement, vm) for vm in ("vm1", "vm2")}


def test_the_vxlan_message_says_vni_ends_port_and_no_learning() -> None:
    msg = ifinfmsg(vxlan_message("vxlan9", 10009, "192.0.2.11", "192.0.2.12", 4789, 9000, 7))
    msg.decode()
    assert msg.get_attr("IFLA_IFNAME") == "vxlan9" and msg.get_attr("IFLA_MTU") == 9000
    assert msg.get_attr("IFLA_NET_NS_FD") == 7
    info = msg.get_attr("IFLA_LINKINFO")
    assert info.get_attr("IFLA_INFO_KIND") == "vxlan"
    data = info.get_attr("IFLA_INFO_DATA")
    assert (data.get_attr("IFLA_VXLAN_ID"), data.get_attr("IFLA_VXLAN_LOCAL"),
            data.get_attr("IFLA_VXLAN_GROUP"), data.get_attr("IFLA_VXLAN_PORT"),
            data.get_attr("IFLA_VXLAN_LEARNING")) == (10009, "192.0.2.11", "192.0.2.12",
                                                      4789, 0)


def test_each_tunnel_port_counts_its_departures_at_its_own_veth_peer() -> None:
    plan, parts = _parts()
    for vm, part in parts.items():
        ns = tunnel.tunnel_netns(plan, vm)
        assert ns == f"{plan.netns_prefix}vx-{vm}"
        hooks = tunnel.departure_hooks(part, ns)
        assert hooks == {(t.local.node, t.local.ifname): (ns, f"vxp{t.link}")
                         for t in part.tunnels}
        # within IFNAMSIZ, distinct, and a MAC per link
        names = [f(t) for t in part.tunnels for f in (tunnel.port_peer_ifname,
                                                      tunnel.vxlan_ifname)]
        assert len(set(names)) == len(names) and all(len(n) <= 15 for n in names)
        assert len({tunnel.peer_mac(t) for t in part.tunnels}) == len(part.tunnels)


def test_a_parts_local_plan_holds_its_nodes_and_the_whole_fabric_s_links() -> None:
    plan, parts = _parts()
    for part in parts.values():
        local = local_plan(plan, part)
        assert [n.name for n in local.nodes] == part.nodes
        assert local.links == plan.links
    assert sorted(n for p in parts.values() for n in p.nodes) == sorted(
        n.name for n in plan.nodes)
