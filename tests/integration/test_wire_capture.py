"""RoCEv2 packets from a user-space UDP socket, captured on the wire.

Two namespaces joined by a veth pair. Namespace A sends packets built by
agents.wire.roce (ICRC predicted for an IPv4 header with ID 0) from an
UNCONNECTED UDP socket with IP_MTU_DISCOVER = IP_PMTUDISC_DO; namespace B
captures them with an AF_PACKET socket and checks, with scapy, that Linux's
IPv4 header is the predicted one: ID 0, DF, and an ICRC that scapy recomputes
from the captured bytes to the same value. A CE-marked TOS must not change
the ICRC. A connected socket (per-socket IP ID counter) is the negative
control: its packets carry IDs that break the predicted ICRC.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from pyroute2 import IPRoute, netns
from scapy.contrib.roce import AETH as ScapyAETH
from scapy.contrib.roce import BTH as ScapyBTH
from scapy.layers.inet import IP, UDP
from scapy.packet import raw

from agents.wire.icrc import icrc_of_ip_packet, ipv4_header_for_icrc
from agents.wire.roce import (
    ROCE_UDP_PORT,
    Bth,
    NakCode,
    Opcode,
    Reth,
    aeth_ack,
    aeth_nak,
    build_cnp,
    build_packet,
    icrc_context,
    parse_datagram,
)
from tests.conftest import REPO

pytestmark = pytest.mark.root

A_IP, B_IP = "198.18.255.0", "198.18.255.1"
SPORT = 0xC0DE
MTU_BYTES = 9000
ETH_P_IP = 0x0800
PACKET_OUTGOING = 4
TOS_CE = (26 << 2) | 3          # DSCP 26 (RoCE data) + CE
TOS_ECT0 = (26 << 2) | 2
TOS_CNP = 48 << 2

# Runs inside namespace A: sends the given UDP payloads to B:4791 from an
# unconnected DF socket bound to A:SPORT (or from a connected one).
SENDER = r"""
import json, socket, sys
IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2
spec = json.load(sys.stdin)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
s.bind((spec["src"], spec["sport"]))
dst = (spec["dst"], spec["dport"])
if spec["connected"]:
    s.connect(dst)
for tos, payload in spec["packets"]:
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    data = bytes.fromhex(payload)
    sent = s.send(data) if spec["connected"] else s.sendto(data, dst)
    assert sent == len(data), (sent, len(data))
print(json.dumps({"sent": len(spec["packets"])}))
"""


@pytest.fixture
def wire_pair() -> Iterator[tuple[str, str]]:
    """Namespaces tb-wire<pid>-a / -b joined by veth v0 (A_IP) <-> v1 (B_IP); always removed."""
    stem = f"tb-wire{os.getpid()}-"
    a, b = stem + "a", stem + "b"
    made: list[str] = []
    try:
        for name in (a, b):
            netns.create(name)
            made.append(name)
        with IPRoute(netns=a) as ipr:
            ipr.link("add", ifname="v0", kind="veth", peer={"ifname": "v1", "net_ns_fd": b})
        for name, ifname, address in ((a, "v0", A_IP), (b, "v1", B_IP)):
            with IPRoute(netns=name) as ipr:
                idx = ipr.link_lookup(ifname=ifname)[0]
                ipr.link("set", index=idx, mtu=MTU_BYTES)
                ipr.addr("add", index=idx, address=address, prefixlen=31)
                ipr.link("set", index=idx, state="up")
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        yield a, b
    finally:
        for name in made:
            netns.remove(name)
        left = [n for n in netns.listnetns() if n.startswith(stem)]
        assert not left, f"namespaces left behind: {left}"


class Capture:
    """AF_PACKET capture on B's v1 plus a UDP socket on B:4791 (the transport's view)."""

    def __init__(self, ns_b: str) -> None:
        netns.pushns(ns_b)
        try:
            self.raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_IP))
            self.raw.bind(("v1", ETH_P_IP))
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind((B_IP, ROCE_UDP_PORT))
        finally:
            netns.popns()

    def close(self) -> None:
        self.raw.close()
        self.udp.close()

    def collect(self, count: int, timeout_s: float = 5.0) -> tuple[list[bytes], list[tuple]]:
        """`count` captured IPv4 packets (A -> B:4791) and `count` received datagrams."""
        frames: list[bytes] = []
        datagrams: list[tuple] = []
        deadline = time.monotonic() + timeout_s
        while (len(frames) < count or len(datagrams) < count) and time.monotonic() < deadline:
            ready, _, _ = select.select([self.raw, self.udp], [], [], 0.1)
            if self.raw in ready:
                frame, addr = self.raw.recvfrom(65535)
                ip = frame[14:]
                if addr[2] == PACKET_OUTGOING or frame[12:14] != b"\x08\x00" or ip[9] != 17:
                    continue
                ihl = (ip[0] & 0x0F) * 4
                dport = int.from_bytes(ip[ihl + 2:ihl + 4], "big")
                if socket.inet_ntoa(ip[12:16]) == A_IP and dport == ROCE_UDP_PORT:
                    frames.append(ip[:int.from_bytes(ip[2:4], "big")])
            if self.udp in ready:
                datagrams.append(self.udp.recvfrom(65535))
        assert len(frames) == count and len(datagrams) == count, (len(frames), len(datagrams))
        return frames, datagrams


def send_from(ns: str, packets: list[tuple[int, bytes]], *, connected: bool = False) -> None:
    spec = {"src": A_IP, "dst": B_IP, "sport": SPORT, "dport": ROCE_UDP_PORT,
            "connected": connected, "packets": [(tos, p.hex()) for tos, p in packets]}
    res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", SENDER],
                         input=json.dumps(spec), capture_output=True, text=True, cwd=REPO,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"sent": len(packets)}


def roce_packets() -> list[tuple[int, bytes, str]]:
    """(TOS, UDP payload built by agents.wire.roce, label): what A sends."""
    ctx = icrc_context(A_IP, B_IP, SPORT, ROCE_UDP_PORT)
    buf = bytearray(MTU_BYTES)
    data = bytes(range(256)) * 16

    def b(bth, **kw) -> bytes:
        return bytes(build_packet(buf, ctx, bth, **kw))

    send = b(Bth(Opcode.RC_SEND_ONLY, se=True, dest_qp=0x000011, psn=0xFFFFFF, ack_req=True),
             payload=data)
    return [
        (0, send, "send-only 4096 B"),
        (TOS_CE, send, "same, CE-marked"),
        (TOS_ECT0, b(Bth(Opcode.RC_RDMA_WRITE_FIRST, dest_qp=0x000011, psn=0),
                     reth=Reth(0x7F0000001000, 0xCAFE, 8192), payload=data[:1024]),
         "write-first + RETH"),
        (TOS_ECT0, b(Bth(Opcode.RC_SEND_LAST, dest_qp=0x000011, psn=1), payload=b"tail!"),
         "send-last, 3 B pad"),
        (0, b(Bth(Opcode.RC_ACKNOWLEDGE, dest_qp=0x000022, psn=1), aeth=aeth_ack(7)), "ack"),
        (0, b(Bth(Opcode.RC_ACKNOWLEDGE, dest_qp=0x000022, psn=2),
              aeth=aeth_nak(8, NakCode.PSN_SEQUENCE_ERROR)), "nak"),
        (TOS_CNP, bytes(build_cnp(buf, ctx, 0x000022)), "cnp"),
    ]


def scapy_recomputed_icrc(ip_packet: bytes) -> bytes:
    """The ICRC scapy computes from the captured IP/UDP/BTH bytes."""
    pkt = IP(ip_packet)
    pkt[ScapyBTH].icrc = None
    return raw(pkt)[-4:]


def test_unconnected_df_socket_sends_ip_id_0_and_the_predicted_icrc(wire_pair):
    ns_a, ns_b = wire_pair
    packets = roce_packets()
    cap = Capture(ns_b)
    try:
        send_from(ns_a, [(tos, p) for tos, p, _ in packets])
        frames, datagrams = cap.collect(len(packets))
    finally:
        cap.close()

    for (tos, sent, label), ip_packet in zip(packets, frames, strict=True):
        pkt = IP(ip_packet)
        assert pkt.id == 0, label
        assert pkt.flags == "DF" and pkt.frag == 0, label
        assert pkt.tos == tos, label
        assert pkt[UDP].sport == SPORT and pkt[UDP].dport == ROCE_UDP_PORT
        assert pkt[UDP].chksum != 0, label      # Linux's (veth leaves it partial): masked
        # The whole IPv4 header is the one predicted, checksum and TTL included.
        assert ip_packet[:20] == ipv4_header_for_icrc(A_IP, B_IP, len(ip_packet), tos=tos), label
        assert ip_packet[28:] == sent, label
        # scapy, from the captured bytes alone, gets the ICRC we predicted.
        assert pkt[ScapyBTH].icrc.to_bytes(4, "big") == sent[-4:]
        assert scapy_recomputed_icrc(ip_packet) == sent[-4:], label
        stored, computed = icrc_of_ip_packet(ip_packet)
        assert stored == computed, label
        if label in ("ack", "nak"):
            assert pkt[ScapyAETH].syndrome in (0x1F, 0x60)

    # TOS is masked: the CE-marked copy carries (and verifies with) the same ICRC.
    assert frames[0][1] == 0 and frames[1][1] == TOS_CE
    assert frames[0][-4:] == frames[1][-4:]
    assert scapy_recomputed_icrc(frames[1]) == scapy_recomputed_icrc(frames[0])

    # The receiving transport's view: a plain UDP socket, ICRC checked by prediction.
    for (_, sent, label), (data, (src, sport)) in zip(packets, datagrams, strict=True):
        assert (src, sport) == (A_IP, SPORT)
        parsed = parse_datagram(data, src, B_IP, sport, ROCE_UDP_PORT)
        assert data == sent, label
        assert parsed.icrc.to_bytes(4, "little") == sent[-4:]


def test_connected_socket_counts_ip_ids_and_breaks_the_predicted_icrc(wire_pair):
    ns_a, ns_b = wire_pair
    _, send, _ = roce_packets()[0]
    cap = Capture(ns_b)
    try:
        send_from(ns_a, [(0, send)] * 3, connected=True)
        frames, _ = cap.collect(3)
    finally:
        cap.close()
    ids = [IP(f).id for f in frames]
    assert any(ids), ids                                      # a per-socket counter, not 0
    assert all((ids[i + 1] - ids[i]) % 65536 == 1 for i in range(2)), ids
    for ip_packet, ip_id in zip(frames, ids, strict=True):
        if ip_id:
            # scapy recomputes from the real header: not the ICRC predicted for ID 0.
            assert scapy_recomputed_icrc(ip_packet) != send[-4:]
            stored, computed = icrc_of_ip_packet(ip_packet)
            assert stored != computed
