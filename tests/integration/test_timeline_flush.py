"""A link-down's queued packets: the kernel frees them, and the port program is told.

sw1's port to h2 has its lossless class's TBF gate closed (as a PFC pause would), h1
sends 20 frames of that class to h2, and they queue there, held in the port program's
FIFO ring and in sw1's per-ingress accounting of h1's port. Taking the link down
frees them in the kernel; `set_links` counts them and retires them through the
program's departure path, so nothing is left held.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from testbed.net import events, portprog
from tests.integration.conftest import built_lab

pytestmark = pytest.mark.root

CONFIG = """\
name: {name}
dilation: 1000
topology:
  kind: single_switch
  hosts: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
"""
ROCE_TC, FRAMES, PAYLOAD = 3, 20, 1000
SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 26 << 2)
for _ in range(int(sys.argv[2])):
    s.sendto(bytes(int(sys.argv[3])), (sys.argv[1], 5000))
"""


def _tc(netns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "tc", *args], check=True,
                   capture_output=True, text=True)


def test_link_down_counts_and_retires_the_queued_lossless_frames():
    with built_lab(CONFIG, "tlflush") as plan:
        sw1, h1, h2 = plan.node("sw1"), plan.node("h1"), plan.node("h2")
        port = h2.interfaces[0].peer.ifname
        iface = next(i for i in sw1.interfaces if i.ifname == port)
        cls = next(c for c in iface.egress.classes if c.tc == ROCE_TC)
        assert cls.leaf_kind == "tbf"
        # the gate closed: TBF at 8 kbit/s, a bucket of one of these frames
        _tc(sw1.netns, "qdisc", "change", "dev", port, "parent", cls.classid, "handle",
            cls.leaf_handle, "tbf", "rate", "8kbit", "burst", "1100", "limit",
            str(cls.limit_bytes))
        dst = h2.interfaces[0].address.split("/")[0]
        subprocess.run(["ip", "netns", "exec", h1.netns, sys.executable, "-c", SEND, dst,
                        str(FRAMES), str(PAYLOAD)], check=True)
        pin = portprog.pin_dir_of(plan.lab, "sw1", port)
        maps = portprog.open_port(pin)
        node = portprog.open_node(plan.lab, "sw1")
        try:
            deadline = time.monotonic() + 5
            while maps.read()[ROCE_TC].vq_packets < FRAMES - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            before = maps.read()[ROCE_TC]
            queued = before.vq_packets
            assert queued >= FRAMES - 1          # one may have left on the bucket's refill
            tracked = sw1.buffer.tracked.index(ROCE_TC)
            slot_h1 = 1 + [i.peer.node for i in sw1.interfaces].index("h1")
            assert node.acct(tracked, slot_h1).bytes == before.vq_bytes

            link = plan.links[iface.link]
            lost = events.set_links(plan, [(link.a.node, link.a.ifname),
                                           (link.b.node, link.b.ifname)], up=False)

            mine = [x for x in lost if (x.node, x.port, x.tclass) == ("sw1", port, ROCE_TC)]
            assert len(mine) == 1
            assert mine[0].packets == queued and mine[0].bytes == before.vq_bytes
            after = maps.read()[ROCE_TC]
            assert after.vq_bytes == 0 and after.vq_packets == 0
            assert after.enq_packets == before.enq_packets
            assert after.dep_packets == before.dep_packets + queued
            assert after.dep_mismatch == before.dep_mismatch
            assert after.dep_unmatched == before.dep_unmatched
            assert node.acct(tracked, slot_h1).bytes == 0       # the ingress let go

            events.set_links(plan, [(link.a.node, link.a.ifname),
                                    (link.b.node, link.b.ifname)], up=True)
            res = subprocess.run(["ip", "netns", "exec", sw1.netns, "ip", "neigh", "show",
                                  "dev", port], capture_output=True, text=True, check=True)
            assert "PERMANENT" in res.stdout
        finally:
            maps.close()
            node.close()
