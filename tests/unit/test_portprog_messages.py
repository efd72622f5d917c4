"""The port programs' attach messages (clsact, cls_bpf) the builder queues in its netlink
batches, and how the loads are split over bpftool batches (no root needed).

The messages are packed by hand (testbed/net/portprog.py) for speed; they must be what
pyroute2's IPRoute.tc sent for the same call before, byte for byte but the sequence
number and port id (the batch sets the first, the kernel the second)."""

from __future__ import annotations

import struct

import pytest
from pyroute2 import IPBatch
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from testbed.net import portprog


def _pyroute2(command: str, kind: str, index: int, handle: int = 0, **kwargs) -> bytes:
    ipb = IPBatch()
    try:
        ipb.tc(command, kind, index, handle, **kwargs)
        return bytes(ipb.batch)
    finally:
        ipb.close()


def _without_seq_and_pid(message: bytes) -> bytes:
    return message[:8] + message[16:]


@pytest.mark.parametrize("ifindex", [1, 7, 0x7FFF_FFFF])
def test_clsact_message_is_what_pyroute2_sends(ifindex):
    ours = portprog.clsact_message(ifindex)
    assert _without_seq_and_pid(ours) == _without_seq_and_pid(
        _pyroute2("add", "clsact", ifindex))


@pytest.mark.parametrize(("parent", "fd", "name"), [
    (portprog.CLSACT_EGRESS, 33, "port_egress"),
    (portprog.CLSACT_INGRESS, 1023, "port_departure"),
    (portprog.CLSACT_INGRESS, 5, "abc"),               # a name whose NUL needs no padding
])
def test_bpf_filter_message_is_what_pyroute2_sends(parent, fd, name):
    ours = portprog.bpf_filter_message(12, parent, fd, name)
    theirs = _pyroute2("replace-filter", "bpf", 12, portprog.FILTER_HANDLE, fd=fd, name=name,
                       parent=parent, prio=portprog.FILTER_PRIO, protocol=portprog.ETH_P_ALL,
                       classid=1, direct_action=True)
    assert _without_seq_and_pid(ours) == _without_seq_and_pid(theirs)


def test_bpf_filter_message_decodes_to_the_filter_asked_for():
    msg = tcmsg(portprog.bpf_filter_message(9, portprog.CLSACT_EGRESS, 41, "port_egress"))
    msg.decode()
    assert (msg["index"], msg["handle"], msg["parent"]) == (9, 1, portprog.CLSACT_EGRESS)
    assert msg["info"] >> 16 == portprog.FILTER_PRIO
    assert msg.get_attr("TCA_KIND") == "bpf"
    options = msg.get_attr("TCA_OPTIONS")
    assert options.get_attr("TCA_BPF_FD") == 41
    assert options.get_attr("TCA_BPF_NAME") == "port_egress"
    assert options.get_attr("TCA_BPF_FLAGS") == 1          # direct action
    (length,) = struct.unpack_from("=I", portprog.bpf_filter_message(9, 0, 41, "x"))
    assert length == len(portprog.bpf_filter_message(9, 0, 41, "x"))


def _node(name: str, ports: int) -> list[list[str]]:
    return [[name, "first"]] + [[name, f"port{k}"] for k in range(1, ports)]


def test_split_batches_keeps_each_node_whole_and_in_order():
    nodes = [_node("a", 3), _node("b", 1), _node("c", 5), _node("d", 2)]
    shares = portprog.split_batches(nodes, workers=2)
    assert len(shares) == 2
    assert sorted(line for share in shares for line in share) == sorted(
        line for node in nodes for line in node)
    for node in nodes:
        holders = [share for share in shares if node[0] in share]
        assert len(holders) == 1                     # a node's lines in one batch
        share = holders[0]
        at = share.index(node[0])
        assert share[at:at + len(node)] == node      # its first port first, then the rest
    assert sorted(len(s) for s in shares) == [5, 6]  # balanced by loads


def test_split_batches_never_makes_more_batches_than_nodes():
    assert len(portprog.split_batches([_node("a", 2)], workers=4)) == 1
    assert len(portprog.split_batches([], workers=4)) == 1
