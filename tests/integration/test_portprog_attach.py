"""The builder attaches every port's own programs, in its netlink batches.

Read back with tc(8) and bpftool: on every port of the default fabric the egress hook
runs that port's pinned `port_egress` (the instance whose maps are pinned beside it),
the peer's ingress hook runs the port's pinned `port_departure`, each once, at the
port program's priority and handle, in direct-action mode; and each port's parameter
map holds its own slot. What the batched attach replaced (one pyroute2 request per
filter) attached exactly this.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from testbed.net import portprog
from testbed.plan.model import Plan

pytestmark = pytest.mark.root


def _filters(netns: str, dev: str, hook: str) -> list[dict]:
    out = subprocess.run(["tc", "-n", netns, "-j", "filter", "show", "dev", dev, hook],
                         capture_output=True, text=True, check=True).stdout
    return [f for f in json.loads(out or "[]") if f.get("kind") == "bpf" and "options" in f]


def _pinned_prog_id(pin) -> int:
    out = subprocess.run(["bpftool", "-j", "prog", "show", "pinned", str(pin)],
                         capture_output=True, text=True, check=True).stdout
    return int(json.loads(out)["id"])


def _port_slot(pin_dir) -> int:
    out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", str(pin_dir / "maps" / "cfg")],
                         capture_output=True, text=True, check=True).stdout
    entry = json.loads(out)[0]
    value = bytes(int(b, 16) for b in entry["value"]) if isinstance(entry["value"], list) \
        else None
    assert value is not None, entry
    return int.from_bytes(value[4:8], "little")       # PORT_CFG: default_tc, port_slot


def test_every_port_runs_its_own_programs(default_fabric: Plan):
    plan = default_fabric
    seen = 0
    for node in plan.nodes:
        for slot, iface in enumerate(node.interfaces, start=1):
            pin_dir = portprog.pin_dir_of(plan.lab, node.name, iface.ifname)
            egress = _filters(node.netns, iface.ifname, "egress")
            assert len(egress) == 1, f"{node.name}:{iface.ifname} egress: {egress}"
            peer = plan.node(iface.peer.node)
            departure = [f for f in _filters(peer.netns, iface.peer.ifname, "ingress")
                         if f["options"].get("prog", {}).get("name") == "port_departure"]
            assert len(departure) == 1, f"{peer.name}:{iface.peer.ifname} ingress"
            for got, prog in ((egress[0], "port_egress"), (departure[0], "port_departure")):
                opts = got["options"]
                assert got["pref"] == portprog.FILTER_PRIO
                assert got["protocol"] == "all"
                assert opts.get("handle") in ("0x1", 1)
                assert opts.get("direct-action") is True or "direct-action" in json.dumps(got)
                assert opts["prog"]["id"] == _pinned_prog_id(pin_dir / "progs" / prog), (
                    f"{node.name}:{iface.ifname}: {prog} is not the port's own instance")
            assert _port_slot(pin_dir) == slot, f"{node.name}:{iface.ifname}"
            seen += 1
    assert seen == sum(len(n.interfaces) for n in plan.nodes) > 0
