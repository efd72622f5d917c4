"""Netlink batching: framing, chunking, ack parsing and message encoding (no root, no kernel).

A fake socket stands in for the kernel: it takes writes, answers every request
with an ack (refusing the ones a test names) and hands the acks back in reads.
"""

from __future__ import annotations

import errno
import struct
from collections import deque

import pytest
from pyroute2 import IPBatch
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from testbed.net import batch
from testbed.net.batch import (
    NLM_F_ACK_TLVS,
    NLM_F_CAPPED,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_HDR,
    BatchedTc,
    BatchError,
    NetlinkBatch,
    RequestError,
    TcTemplates,
    parse_acks,
)
from testbed.net.qdisc import install_port_queues
from testbed.plan.model import Plan
from tests.conftest import REPO

RTM_NEWLINK = 16
NLM_F_REQUEST = 1
NLM_F_ACK = 4


# ---------------------------------------------------------------- fakes

def message(payload_len: int, mtype: int = RTM_NEWLINK, flags: int = NLM_F_REQUEST) -> bytes:
    """A netlink request of 16 + payload_len bytes, without ACK, seq 0."""
    return NLMSG_HDR.pack(NLMSG_HDR.size + payload_len, mtype, flags, 0, 0) + \
        bytes(i % 251 for i in range(payload_len))


def split_messages(data: bytes) -> list[bytes]:
    out, off = [], 0
    while off < len(data):
        (length,) = struct.unpack_from("=I", data, off)
        out.append(data[off:off + length])
        off += (length + 3) & ~3
    return out


def error_ack(request: bytes, code: int, text: str = "", capped: bool = True) -> bytes:
    """What the kernel answers: NLMSG_ERROR, -errno, the request (or its header),
    and the extended-ack message if there is one."""
    _len, _type, _flags, seq, _port = NLMSG_HDR.unpack_from(request, 0)
    flags = NLM_F_CAPPED if capped else 0
    quoted = request[:NLMSG_HDR.size] if capped else request + bytes(-len(request) % 4)
    body = struct.pack("=i", -code) + quoted
    if text:
        raw = text.encode() + b"\0"
        body += struct.pack("=HH", 4 + len(raw), batch.NLMSGERR_ATTR_MSG) + raw
        body += bytes(-len(body) % 4)
        flags |= NLM_F_ACK_TLVS
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), NLMSG_ERROR, flags, seq, 0) + body


class FakeKernel:
    """A socket whose peer acks every request; `refuse` maps seq -> (errno, text)."""

    def __init__(self, refuse: dict[int, tuple[int, str]] | None = None,
                 acks_per_read: int | None = None, capped: bool = True) -> None:
        self.refuse = refuse or {}
        self.acks_per_read = acks_per_read
        self.capped = capped
        self.writes: list[bytes] = []
        self.reads: deque[bytes] = deque()

    def send(self, data) -> int:
        data = bytes(data)
        self.writes.append(data)
        acks = []
        for request in split_messages(data):
            seq = NLMSG_HDR.unpack_from(request, 0)[3]
            code, text = self.refuse.get(seq, (0, ""))
            acks.append(error_ack(request, code, text, self.capped))
        step = self.acks_per_read or len(acks)
        for i in range(0, len(acks), step):
            self.reads.append(b"".join(acks[i:i + step]))
        return len(data)

    def recv(self, _bufsize: int) -> bytes:
        if not self.reads:
            raise AssertionError("recv with nothing to read: the batch waited for an ack "
                                 "that was never due")
        return self.reads.popleft()

    def requests(self) -> list[bytes]:
        return [m for w in self.writes for m in split_messages(w)]


# ---------------------------------------------------------------- framing

def test_each_request_gets_its_own_sequence_number_and_asks_for_an_ack():
    kernel = FakeKernel()
    b = NetlinkBatch(kernel, "h1")
    for size in (4, 5, 16, 7):
        b.add(message(size), f"request of {size}")
    b.flush()
    assert len(kernel.writes) == 1
    sent = kernel.requests()
    assert [NLMSG_HDR.unpack_from(m, 0)[3] for m in sent] == [1, 2, 3, 4]
    assert all(NLMSG_HDR.unpack_from(m, 0)[2] & NLM_F_ACK for m in sent)
    # Each message starts on a 4-byte boundary, as the kernel walks them.
    assert len(kernel.writes[0]) == sum((16 + s + 3) & ~3 for s in (4, 5, 16, 7))
    assert b.requests_sent == 4 and b.chunks_sent == 1


def test_payload_is_sent_unchanged_apart_from_flags_and_sequence():
    kernel = FakeKernel()
    b = NetlinkBatch(kernel, "h1")
    original = message(40, flags=NLM_F_REQUEST | 0x400)
    b.add(original, "x")
    b.flush()
    (sent,) = kernel.requests()
    assert sent[16:] == original[16:]
    length, mtype, flags, seq, _ = NLMSG_HDR.unpack_from(sent, 0)
    assert (length, mtype, flags, seq) == (56, RTM_NEWLINK, NLM_F_REQUEST | 0x400 | NLM_F_ACK, 1)


def test_a_message_whose_header_lies_about_its_length_is_refused_before_sending():
    kernel = FakeKernel()
    b = NetlinkBatch(kernel, "h1")
    bad = bytearray(message(8))
    struct.pack_into("=I", bad, 0, 100)
    with pytest.raises(ValueError, match="says 100 bytes"):
        b.add(bad, "bad")
    assert kernel.writes == []


def test_flush_with_nothing_queued_sends_nothing():
    kernel = FakeKernel()
    NetlinkBatch(kernel, "h1").flush()
    assert kernel.writes == []


# ---------------------------------------------------------------- chunking

def test_chunks_stay_under_the_byte_and_request_limits_and_keep_the_order():
    kernel = FakeKernel()
    b = NetlinkBatch(kernel, "leaf1", max_bytes=1000, max_requests=8)
    sizes = [100, 300, 20, 500, 4, 4, 4, 4, 4, 4, 4, 4, 4, 900, 60, 200]
    for i, size in enumerate(sizes):
        b.add(message(size), f"r{i}")
    b.flush()
    assert all(len(w) <= 1000 for w in kernel.writes)
    assert all(len(split_messages(w)) <= 8 for w in kernel.writes)
    sent = kernel.requests()
    assert [len(m) - 16 for m in sent] == sizes
    assert [NLMSG_HDR.unpack_from(m, 0)[3] for m in sent] == list(range(1, len(sizes) + 1))
    assert b.requests_sent == len(sizes)
    assert len(kernel.reads) == 0          # every ack was read


def test_a_message_bigger_than_a_chunk_goes_out_alone():
    kernel = FakeKernel()
    b = NetlinkBatch(kernel, "h1", max_bytes=256)
    b.add(message(16), "small")
    b.add(message(1000), "big")
    b.add(message(16), "small again")
    b.flush()
    assert [len(split_messages(w)) for w in kernel.writes] == [1, 1, 1]
    assert len(kernel.writes[1]) == 1016


def test_a_full_chunk_is_sent_by_add_without_waiting_for_flush():
    kernel = FakeKernel()
    b = NetlinkBatch(kernel, "h1", max_requests=3)
    for i in range(3):
        b.add(message(4), f"r{i}")
    assert len(kernel.writes) == 1
    b.add(message(4), "r3")
    assert len(kernel.writes) == 1
    b.flush()
    assert len(kernel.writes) == 2


def test_default_limits_are_the_documented_ones():
    assert batch.MAX_CHUNK_BYTES == 32 * 1024
    assert batch.MAX_CHUNK_REQUESTS == 64


# ---------------------------------------------------------------- acks

def test_a_refusal_names_the_node_the_request_and_the_kernels_message():
    kernel = FakeKernel(refuse={3: (errno.EEXIST, "Exclusivity flag on, cannot modify")})
    b = NetlinkBatch(kernel, "leaf1")
    for what in ("link set lo up", "address add 198.18.0.0/31 dev swp1",
                 "tc qdisc add htb 1: dev swp1", "link set swp1 up"):
        b.add(message(8), what)
    with pytest.raises(RequestError) as info:
        b.flush()
    err = info.value
    assert str(err) == ("node leaf1: tc qdisc add htb 1: dev swp1: File exists "
                        "(Exclusivity flag on, cannot modify)")
    assert (err.node, err.request, err.code) == ("leaf1", "tc qdisc add htb 1: dev swp1",
                                                 errno.EEXIST)
    assert kernel.reads == deque()          # the acks after the refusal were read too


def test_the_socket_is_usable_after_a_refusal():
    kernel = FakeKernel(refuse={1: (errno.ENETUNREACH, "Nexthop has invalid gateway")})
    b = NetlinkBatch(kernel, "h1")
    b.add(message(8), "route add 10.0.0.0/8 nexthop via 10.9.9.9 dev eth0")
    b.add(message(8), "link set eth0 up")
    with pytest.raises(RequestError, match="Network is unreachable"):
        b.flush()
    b.add(message(8), "link set lo up")
    b.flush()                               # seq 3: acked, no stale ack in the way
    assert b.requests_sent == 3


def test_the_first_refusal_of_a_chunk_is_the_one_reported():
    kernel = FakeKernel(refuse={2: (errno.EINVAL, "first"), 4: (errno.ENOENT, "second")})
    b = NetlinkBatch(kernel, "h1")
    for i in range(5):
        b.add(message(8), f"r{i + 1}")
    with pytest.raises(RequestError, match=r"^node h1: r2: Invalid argument \(first\)$"):
        b.flush()


def test_acks_arriving_over_several_reads_are_all_collected():
    kernel = FakeKernel(acks_per_read=1)
    b = NetlinkBatch(kernel, "h1")
    for i in range(10):
        b.add(message(8), f"r{i}")
    b.flush()
    assert kernel.reads == deque()


def test_a_refusal_without_extended_ack_gives_the_errno_text_alone():
    kernel = FakeKernel(refuse={1: (errno.EPERM, "")})
    b = NetlinkBatch(kernel, "h1")
    b.add(message(8), "link set lo up")
    with pytest.raises(RequestError, match=r"^node h1: link set lo up: Operation not "
                                           r"permitted$"):
        b.flush()


def test_extended_ack_after_an_uncapped_echo_is_found():
    request = NLMSG_HDR.pack(16 + 10, RTM_NEWLINK, NLM_F_REQUEST, 7, 0) + bytes(10)
    data = error_ack(request, errno.EINVAL, "bad attribute", capped=False)
    (ack,) = parse_acks(data)
    assert (ack.seq, ack.code, ack.kernel_message) == (7, errno.EINVAL, "bad attribute")


def test_parse_acks_skips_other_messages_and_reads_success():
    done = NLMSG_HDR.pack(20, NLMSG_DONE, 0, 9, 0) + bytes(4)
    ok = error_ack(NLMSG_HDR.pack(16, RTM_NEWLINK, 0, 5, 0), 0)
    acks = list(parse_acks(done + ok))
    assert [(a.seq, a.code, a.kernel_message) for a in acks] == [(5, 0, "")]


def test_a_truncated_reply_is_an_error_not_a_silent_skip():
    ok = error_ack(NLMSG_HDR.pack(16, RTM_NEWLINK, 0, 5, 0), 0)
    with pytest.raises(BatchError, match="malformed"):
        list(parse_acks(ok[:-4]))


def test_lost_acks_are_an_error_that_names_the_node():
    class Overrun(FakeKernel):
        def recv(self, _bufsize):
            raise OSError(errno.ENOBUFS, "No buffer space available")

    b = NetlinkBatch(Overrun(), "spine2")
    b.add(message(8), "route add 198.18.0.0/29")
    with pytest.raises(BatchError, match=r"node spine2: waiting for the acks of 1 requests "
                                         r"\(first: route add 198.18.0.0/29\)"):
        b.flush()


# ---------------------------------------------------------------- link dump

def link_message(seq: int, index: int, name: str, flags: int = 2) -> bytes:
    raw = name.encode() + b"\0"
    attr = struct.pack("=HH", 4 + len(raw), batch.IFLA_IFNAME) + raw + bytes(-len(raw) % 4)
    body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + attr
    return NLMSG_HDR.pack(16 + len(body), RTM_NEWLINK, flags, seq, 0) + body


class FakeDump:
    def __init__(self, replies):
        self.replies = deque(replies)
        self.sent = []

    def send(self, data):
        self.sent.append(bytes(data))
        return len(data)

    def recv(self, _bufsize):
        return self.replies.popleft()


def test_one_dump_maps_every_interface_name_to_its_index():
    seq = 0x7FFF0001
    sock = FakeDump([link_message(seq, 1, "lo") + link_message(seq, 2, "swp1"),
                     link_message(999, 50, "stale") + link_message(seq, 7, "eth0"),
                     NLMSG_HDR.pack(20, NLMSG_DONE, 2, seq, 0) + bytes(4)])
    assert batch.dump_link_indexes(sock, "leaf1") == {"lo": 1, "swp1": 2, "eth0": 7}
    (request,) = sock.sent
    _len, mtype, flags, sent_seq, _ = NLMSG_HDR.unpack_from(request, 0)
    assert (mtype, sent_seq) == (18, seq)                 # RTM_GETLINK
    assert flags & 0x300 == 0x300                         # NLM_F_DUMP


def test_a_refused_dump_names_the_node():
    seq = 0x7FFF0001
    ack = error_ack(NLMSG_HDR.pack(16, 18, 0, seq, 0), errno.EPERM)
    with pytest.raises(RequestError, match="node h3: link dump: Operation not permitted"):
        batch.dump_link_indexes(FakeDump([ack]), "h3")


# ---------------------------------------------------------------- message encoding

def pyroute2_bytes(call) -> bytes:
    """What pyroute2's IPRoute would send for one call, seq and port id zeroed."""
    ipb = IPBatch()
    try:
        call(ipb)
        return normalised(bytes(ipb.batch))
    finally:
        ipb.close()


def normalised(data: bytes | bytearray) -> bytes:
    out = bytearray(data)
    struct.pack_into("=II", out, 8, 0, 0)
    return bytes(out)


def test_address_message_is_what_iproute_sends():
    assert normalised(batch.address_message(3, "198.18.0.1/31")) == pyroute2_bytes(
        lambda ipr: ipr.addr("add", index=3, address="198.18.0.1", prefixlen=31))


def test_link_up_message_is_what_iproute_sends():
    assert normalised(batch.link_up_message(4)) == pyroute2_bytes(
        lambda ipr: ipr.link("set", index=4, state="up"))


@pytest.mark.parametrize(("ifindex", "dst", "mac"), [
    (5, "198.18.0.1", "02:54:00:00:00:01"), (70000, "10.255.0.254", "AA:bb:cc:dd:ee:ff")])
def test_neighbour_message_is_what_iproute_sends(ifindex, dst, mac):
    assert normalised(batch.neighbour_message(ifindex, dst, mac)) == pyroute2_bytes(
        lambda ipr: ipr.neigh("add", ifindex=ifindex, dst=dst, lladdr=mac.lower(), state=128))


def test_single_next_hop_route_is_what_iproute_sends():
    assert normalised(batch.route_message("198.18.0.0/15", [("198.18.0.0", 2)])) == \
        pyroute2_bytes(lambda ipr: ipr.route("add", dst="198.18.0.0/15",
                                             gateway="198.18.0.0", oif=2))


def test_multipath_route_is_what_iproute_sends():
    hops = [("198.18.0.17", 6), ("198.18.0.19", 7), ("198.18.0.21", 8)]
    assert normalised(batch.route_message("198.18.0.8/29", hops)) == pyroute2_bytes(
        lambda ipr: ipr.route("add", dst="198.18.0.8/29", multipath=[
            {"gateway": g, "oif": o} for g, o in hops]))


def test_veth_message_carries_both_ends_mac_and_mtu_and_the_peer_namespace():
    ours = batch.veth_message("swp1", "02:54:00:00:00:01", 9000, "eth0", "02:54:00:00:00:02",
                              1500, 12)
    assert normalised(ours) == pyroute2_bytes(lambda ipr: ipr.link(
        "add", ifname="swp1", kind="veth", address="02:54:00:00:00:01", mtu=9000,
        peer={"ifname": "eth0", "address": "02:54:00:00:00:02", "mtu": 1500,
              "net_ns_fd": 12}))



def test_veth_message_can_give_both_ends_their_ifindex():
    ours = batch.veth_message("swp1", "02:54:00:00:00:01", 9000, "eth0", "02:54:00:00:00:02",
                              1500, 12, index=77, peer_index=78)
    msg = ifinfmsg(ours)
    msg.decode()
    assert msg["index"] == 77
    peer = msg.get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_DATA").get_attr("VETH_INFO_PEER")
    assert peer["index"] == 78 and peer.get_attr("IFLA_IFNAME") == "eth0"
    # by default the kernel picks both (0)
    plain = ifinfmsg(batch.veth_message("swp1", "02:54:00:00:00:01", 9000, "eth0",
                                        "02:54:00:00:00:02", 1500, 12))
    plain.decode()
    assert plain["index"] == 0 and plain.get_attr("IFLA_LINKINFO").get_attr(
        "IFLA_INFO_DATA").get_attr("VETH_INFO_PEER")["index"] == 0


# ---------------------------------------------------------------- tc templates

def egress_plans():
    """Every distinct egress plan of the golden plans: PFC classes with a tbf gate,
    plain classes with a bfifo leaf, host and fabric port rates, a custom class plan."""
    out = {}
    for name in ("default", "explicit"):
        plan = Plan.model_validate_json((REPO / f"tests/golden/{name}.plan.json").read_text())
        for node in plan.nodes:
            for iface in node.interfaces:
                out.setdefault(iface.egress.model_dump_json(), iface.egress)
    return list(out.values())


class Queued:
    """A NetlinkBatch stand-in that keeps what is added."""

    def __init__(self):
        self.added: list[tuple[bytes, str]] = []

    def add(self, message, request):
        self.added.append((bytes(message), request))


def test_golden_plans_have_both_leaf_kinds():
    kinds = {c.leaf_kind for e in egress_plans() for c in e.classes}
    assert kinds == {"tbf", "bfifo"}


class IPBatchRecorder:
    """An `ipr` for install_port_queues that keeps pyroute2's own encoding of each call."""

    def __init__(self):
        self.ipb = IPBatch()
        self.messages: list[bytes] = []

    def tc(self, *args, **kwargs):
        self.ipb.reset()
        self.ipb.tc(*args, **kwargs)
        self.messages.append(normalised(self.ipb.batch))


def iproute_port_queues(ifindex: int, egress) -> list[bytes]:
    recorder = IPBatchRecorder()
    try:
        install_port_queues(recorder, ifindex, egress)
    finally:
        recorder.ipb.close()
    return recorder.messages


def test_port_queues_through_templates_are_what_iproute_would_send():
    with TcTemplates() as templates:
        for egress in egress_plans():
            for ifindex in (2, 9, 1234567):
                before = templates.distinct
                queued = Queued()
                count = install_port_queues(BatchedTc(queued, templates, "swp3"), ifindex,
                                            egress)
                assert count == len(queued.added)
                assert [normalised(m) for m, _ in queued.added] == \
                    iproute_port_queues(ifindex, egress)
                if ifindex != 2:
                    # Another port with the same plan: nothing new to encode.
                    assert templates.distinct == before


def test_tc_requests_are_described_like_tc_commands():
    egress = next(e for e in egress_plans()
                  if {c.leaf_kind for c in e.classes} == {"tbf", "bfifo"})
    queued = Queued()
    with TcTemplates() as templates:
        install_port_queues(BatchedTc(queued, templates, "eth0"), 5, egress)
    described = [what for _, what in queued.added]
    assert described[0] == "tc qdisc add htb 1: dev eth0"
    assert described[1] == "tc class add htb 1:1 parent 1: dev eth0"
    assert "tc class add htb 1:13 parent 1:1 dev eth0" in described
    assert "tc qdisc add tbf 103: parent 1:13 dev eth0" in described
    assert "tc qdisc add bfifo 100: parent 1:10 dev eth0" in described
    assert ("tc filter add u32 parent 1: match 0x00680000/0x00fc0000+0 flowid 1:13 dev eth0"
            in described)


def test_a_template_is_refused_if_the_ifindex_is_not_only_in_tcmsg():
    # A request with the template ifindex's value in an attribute too (here a bfifo
    # limit) could not be patched safely: refuse it loudly rather than guess.
    with TcTemplates() as templates:
        with pytest.raises(RuntimeError, match="ifindex is not"):
            templates.request("add", "bfifo", 3, 0x1000000,
                              {"parent": 0x10010, "limit": batch._TEMPLATE_IFINDEX})
        what, message = templates.request("add", "bfifo", 3, 0x1000000,
                                          {"parent": 0x10010, "limit": 1000})
        assert what == "tc qdisc add bfifo 100: parent 1:10"
        assert struct.unpack_from("=i", message, batch.TCMSG_IFINDEX_OFFSET) == (3,)
