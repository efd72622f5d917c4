"""Netlink requests encoded once, sent in batches, every ack read: the fast path of `up`.

Why this exists. At 128 hosts (4x8x16 leaf-spine: 140 namespaces, 160 veth pairs,
320 ports) `up` through pyroute2's IPRoute took 4.35 s on a 2-CPU VM (median of 3,
bench/bringup.py):
- 1.36 s in two forks per namespace (`pyroute2.netns.create` and
  `IPRoute(netns=...)` each start a child process, ~9.7 ms a namespace);
- ~2.9 s in pyroute2's Python per request: ~0.5-0.8 ms to encode, send and wait
  for each request that the kernel handles in ~5 us. The build sent 3200 tc
  requests (HTB rate tables recomputed for each), 780 link lookups and 320
  separate MAC/MTU sets.
The builder now creates namespaces without forking (`namespaces.create_many`)
and talks to each one over a raw NETLINK_ROUTE socket opened inside it, using
this module:
- `NetlinkBatch` queues one namespace's requests and writes them in chunks of at
  most 32 KB (and 64 requests, so the acks fit the socket's receive buffer); every
  request carries NLM_F_ACK and every ack is read before the next chunk. A refusal
  raises `RequestError` naming the node, the request and the kernel's own message
  (extended ack), not just an errno.
- `qdisc.install_port_queues` (still the only definition of a port's tc tree) runs
  for every port as before, but its `ipr` is a `BatchedTc`: each tc() call is
  encoded by pyroute2's IPBatch compiler the first time it is seen (HTB rate tables
  included) and, for every other port with the same egress plan, copied with only
  the ifindex patched (`TcTemplates`), then queued.
- veth pairs are created with both ends' MAC and MTU in the creating message, and
  one link dump per namespace replaces the per-interface lookups.
- Addresses, links up and routes are encoded with pyroute2's message classes
  directly (byte for byte what IPRoute sends; tests/unit/test_batch.py checks that
  against IPBatch), which costs half of going through IPBatch.
With this, `up` at 128 hosts takes 0.36 s (median of 3, same VM, Mininet's own
times unchanged between the two runs). What is left is roughly half pyroute2
encoding the ~1300 messages that are not cached (veth pairs, addresses, links up,
routes) and half the kernel (in the profile: 0.10 s of netlink writes, 0.08 s of
unshare + mount). The kernel state is what the IPRoute builder made (ip -d link,
addresses, routes, tc qdiscs/classes/filters and sysctls compared at 8 and 128
hosts and on tests/golden/explicit.yaml), and tests/integration/test_builder_state.py
checks it against the plan. Nothing here forks.
"""

from __future__ import annotations

import errno as _errno
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from socket import AF_INET

from pyroute2 import IPBatch
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST
from pyroute2.netlink.rtnl import (
    RTM_GETLINK,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWNEIGH,
    RTM_NEWROUTE,
)
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import IFF_UP, ifinfmsg
from pyroute2.netlink.rtnl.ndmsg import NUD_PERMANENT
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from agents.wire.netlink import attrs

# <linux/netlink.h>
NLMSG_HDR = struct.Struct("=IHHII")     # length, type, flags, seq, port id
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_CAPPED = 0x100        # the error message quotes only the request's header
NLM_F_ACK_TLVS = 0x200      # extended ack attributes follow
NLMSGERR_ATTR_MSG = 1
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
# <linux/rtnetlink.h>
IFLA_IFNAME = 3
RT_TABLE_MAIN = 254
RTPROT_STATIC = 4
RT_SCOPE_UNIVERSE = 0
RTN_UNICAST = 1
LOOPBACK_IFINDEX = 1

CREATE = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL

# netlink_sendmsg refuses a write larger than the socket's send buffer (~208 KB by
# default). Every ack is a separate skb charged to the receive buffer (~208 KB), and
# acks that do not fit are dropped (recv then fails with ENOBUFS): measured, 256
# acks of one write fit, 512 do not. 64 leave room for error acks with their text.
MAX_CHUNK_BYTES = 32 * 1024
MAX_CHUNK_REQUESTS = 64
# A request the kernel never answers is a bug; do not hang the build on it.
ACK_TIMEOUT_S = 30.0


class RequestError(RuntimeError):
    """The kernel refused a request; says which node, which request, and why."""

    def __init__(self, node: str, request: str, code: int, kernel_message: str = "") -> None:
        self.node, self.request, self.code = node, request, code
        self.kernel_message = kernel_message
        reason = os.strerror(code) + (f" ({kernel_message})" if kernel_message else "")
        super().__init__(f"node {node}: {request}: {reason}")


class BatchError(RuntimeError):
    """The conversation with the kernel broke down (lost or missing acks, socket error)."""


def open_route_socket() -> socket.socket:
    """A NETLINK_ROUTE socket in the calling thread's network namespace, asking for
    short acks (header only) with the kernel's error text."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        for option in (NETLINK_CAP_ACK, NETLINK_EXT_ACK):
            try:
                sock.setsockopt(SOL_NETLINK, option, 1)
            except OSError as exc:       # older kernels: full acks, errno only
                if exc.errno != _errno.ENOPROTOOPT:
                    raise
        sock.bind((0, 0))
        sock.settimeout(ACK_TIMEOUT_S)
    except BaseException:
        sock.close()
        raise
    return sock


# ---------------------------------------------------------------- acks

@dataclass(frozen=True)
class Ack:
    seq: int
    code: int              # 0, or a positive errno
    kernel_message: str


def parse_acks(data: bytes | bytearray | memoryview) -> Iterator[Ack]:
    """The NLMSG_ERROR messages (acks) in one read from a netlink socket."""
    off = 0
    while off + NLMSG_HDR.size <= len(data):
        length, mtype, flags, seq, _port = NLMSG_HDR.unpack_from(data, off)
        if length < NLMSG_HDR.size or off + length > len(data):
            raise BatchError(f"malformed netlink message at byte {off}: length {length}")
        if mtype == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", data, off + NLMSG_HDR.size)
            yield Ack(seq, -error, _extack_message(data, off, length, flags))
        off += (length + 3) & ~3


def _extack_message(data: bytes | bytearray | memoryview, off: int, length: int,
                    flags: int) -> str:
    """The kernel's error text (NLMSGERR_ATTR_MSG) in the ack at `off`, or ""."""
    if not flags & NLM_F_ACK_TLVS:
        return ""
    quoted = off + NLMSG_HDR.size + 4       # the request's header, echoed after the error
    if flags & NLM_F_CAPPED:
        tlvs = quoted + NLMSG_HDR.size
    else:
        (quoted_len,) = struct.unpack_from("=I", data, quoted)
        tlvs = quoted + ((quoted_len + 3) & ~3)
    for kind, start, stop in attrs(data, tlvs, off + length):
        if kind == NLMSGERR_ATTR_MSG:
            return bytes(data[start:stop]).rstrip(b"\0").decode(errors="replace")
    return ""


# ---------------------------------------------------------------- batches

class NetlinkBatch:
    """Requests to one namespace: queued, written in chunks, every ack checked.

    `sock` needs only send() and recv() (a NETLINK_ROUTE socket, or a fake in tests).
    add() may send (when a chunk is full); flush() sends the rest. Either raises
    RequestError for the first request of a chunk the kernel refused, after
    reading the acks of all the others, so the socket stays usable.
    """

    def __init__(self, sock, node: str, *, max_bytes: int = MAX_CHUNK_BYTES,
                 max_requests: int = MAX_CHUNK_REQUESTS) -> None:
        self.sock, self.node = sock, node
        self.max_bytes, self.max_requests = max_bytes, max_requests
        self._buf = bytearray()
        self._pending: dict[int, str] = {}      # seq -> what the request does
        self._seq = 0
        self.requests_sent = 0
        self.chunks_sent = 0

    def add(self, message: bytes | bytearray, request: str) -> None:
        """Queue one encoded netlink message; `request` says what it does, for errors."""
        (length,) = struct.unpack_from("=I", message, 0)
        if length != len(message):
            raise ValueError(f"{request}: netlink header says {length} bytes, "
                             f"message has {len(message)}")
        if self._buf and len(self._buf) + len(message) > self.max_bytes:
            self.flush()
        self._seq += 1
        start = len(self._buf)
        self._buf += message
        if len(message) % 4:
            self._buf += bytes(4 - len(message) % 4)
        (flags,) = struct.unpack_from("=H", self._buf, start + 6)
        struct.pack_into("=HI", self._buf, start + 6, flags | NLM_F_ACK, self._seq)
        self._pending[self._seq] = request
        if len(self._pending) >= self.max_requests:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        data, pending = bytes(self._buf), self._pending
        self._buf, self._pending = bytearray(), {}
        try:
            sent = self.sock.send(data)
        except OSError as exc:
            raise BatchError(f"node {self.node}: sending {len(pending)} requests "
                             f"(first: {next(iter(pending.values()))}): {exc}") from exc
        if sent != len(data):
            raise BatchError(f"node {self.node}: the kernel took {sent} of {len(data)} bytes")
        self.chunks_sent += 1
        self.requests_sent += len(pending)
        failure: RequestError | None = None
        while pending:
            try:
                reply = self.sock.recv(1 << 16)
            except OSError as exc:     # ENOBUFS (acks lost), timeout
                raise BatchError(f"node {self.node}: waiting for the acks of "
                                 f"{len(pending)} requests (first: "
                                 f"{next(iter(pending.values()))}): {exc}") from exc
            if not reply:
                raise BatchError(f"node {self.node}: netlink socket closed with "
                                 f"{len(pending)} requests unanswered")
            for ack in parse_acks(reply):
                request = pending.pop(ack.seq, None)
                if request is not None and ack.code and failure is None:
                    failure = RequestError(self.node, request, ack.code, ack.kernel_message)
        if failure is not None:
            raise failure


def dump_link_indexes(sock, node: str) -> dict[str, int]:
    """ifname -> ifindex of every link in the socket's namespace (one RTM_GETLINK dump)."""
    msg = ifinfmsg()
    msg["header"]["sequence_number"] = seq = 0x7FFF0001
    out: dict[str, int] = {}
    try:
        sock.send(_encode(msg, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP))
        return _read_link_dump(sock, node, seq, out)
    except OSError as exc:
        raise BatchError(f"node {node}: link dump: {exc}") from exc


def _read_link_dump(sock, node: str, seq: int, out: dict[str, int]) -> dict[str, int]:
    while True:
        data = sock.recv(1 << 16)
        off = 0
        while off + NLMSG_HDR.size <= len(data):
            length, mtype, _flags, mseq, _port = NLMSG_HDR.unpack_from(data, off)
            if length < NLMSG_HDR.size:
                raise BatchError(f"node {node}: malformed link dump")
            if mseq == seq:
                if mtype == NLMSG_DONE:
                    return out
                if mtype == NLMSG_ERROR:
                    ack = next(parse_acks(data[off:off + length]))
                    raise RequestError(node, "link dump", ack.code, ack.kernel_message)
                if mtype == RTM_NEWLINK:
                    index, name = _link_name(data, off, length)
                    if name is not None:
                        out[name] = index
            off += (length + 3) & ~3


def _link_name(data: bytes | bytearray | memoryview, off: int,
               length: int) -> tuple[int, str | None]:
    """ifindex and IFLA_IFNAME of the RTM_NEWLINK message at `off`."""
    body = off + NLMSG_HDR.size
    (index,) = struct.unpack_from("=i", data, body + 4)     # ifinfomsg: family, pad, type
    for kind, start, stop in attrs(data, body + 16, off + length):
        if kind == IFLA_IFNAME:
            return index, bytes(data[start:stop]).rstrip(b"\0").decode()
    return index, None


# ---------------------------------------------------------------- messages

def _encode(msg, mtype: int, flags: int) -> bytes:
    msg["header"]["type"] = mtype
    msg["header"]["flags"] = flags
    msg.encode()
    return bytes(msg.data)


def veth_message(ifname: str, mac: str, mtu: int, peer_ifname: str, peer_mac: str,
                 peer_mtu: int, peer_netns_fd: int, index: int = 0,
                 peer_index: int = 0) -> bytes:
    """Create a veth pair in the socket's namespace, the peer in `peer_netns_fd`'s,
    each end with its MAC and MTU (`ip link add NAME address .. mtu .. index .. type veth
    peer name .. address .. mtu .. netns .. index ..`). `index` / `peer_index`: the
    ends' ifindexes (0: the kernel picks); the lab's port program instance keys ports
    by them (portprog.lab_ifindexes)."""
    peer = {"index": peer_index,
            "attrs": [("IFLA_IFNAME", peer_ifname), ("IFLA_ADDRESS", peer_mac),
                      ("IFLA_MTU", peer_mtu), ("IFLA_NET_NS_FD", peer_netns_fd)]}
    msg = ifinfmsg()
    msg["index"] = index
    msg["attrs"] = [
        ("IFLA_IFNAME", ifname), ("IFLA_ADDRESS", mac), ("IFLA_MTU", mtu),
        ("IFLA_LINKINFO", {"attrs": [
            ("IFLA_INFO_KIND", "veth"),
            ("IFLA_INFO_DATA", {"attrs": [("VETH_INFO_PEER", peer)]})]})]
    return _encode(msg, RTM_NEWLINK, CREATE)


def vxlan_message(ifname: str, vni: int, local: str, remote: str, udp_port: int, mtu: int,
                  netns_fd: int) -> bytes:
    """Create a VXLAN device put straight into `netns_fd`'s namespace, its UDP socket in
    the namespace the request is sent from (`ip link add NAME type vxlan id VNI local L
    remote R dstport P nolearning; ip link set NAME netns ..`, in one step). The kernel
    opens a VXLAN device's socket in the namespace that creates it and keeps it there
    when the device is in another, so the underlay end and the fabric end of a tunnel
    can live in two namespaces. `remote` is unicast: it becomes the all-zeros FDB
    entry, so every frame (broadcast and link-local multicast such as PFC's
    01:80:c2:00:00:01 included) goes to the other VM. No learning: there is one peer."""
    msg = ifinfmsg()
    msg["attrs"] = [
        ("IFLA_IFNAME", ifname), ("IFLA_MTU", mtu), ("IFLA_NET_NS_FD", netns_fd),
        ("IFLA_LINKINFO", {"attrs": [
            ("IFLA_INFO_KIND", "vxlan"),
            ("IFLA_INFO_DATA", {"attrs": [
                ("IFLA_VXLAN_ID", vni), ("IFLA_VXLAN_LOCAL", local),
                ("IFLA_VXLAN_GROUP", remote), ("IFLA_VXLAN_PORT", udp_port),
                ("IFLA_VXLAN_LEARNING", 0)]})]})]
    return _encode(msg, RTM_NEWLINK, CREATE)


def address_message(ifindex: int, cidr: str) -> bytes:
    """Add an IPv4 address, "198.18.0.1/31", to a link."""
    address, prefixlen = cidr.split("/")
    msg = ifaddrmsg()
    msg["family"], msg["prefixlen"], msg["index"] = AF_INET, int(prefixlen), ifindex
    msg["attrs"] = [("IFA_ADDRESS", address), ("IFA_LOCAL", address)]
    return _encode(msg, RTM_NEWADDR, CREATE)


def link_up_message(ifindex: int) -> bytes:
    msg = ifinfmsg()
    msg["index"], msg["flags"], msg["change"] = ifindex, IFF_UP, IFF_UP
    return _encode(msg, RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK)


_NDMSG = struct.Struct("=BxxxiHBB")      # family, ifindex, state, flags, type
_RTATTR = struct.Struct("=HH")
NDA_DST = 1
NDA_LLADDR = 2


def neighbour_message(ifindex: int, address: str, mac: str) -> bytes:
    """A permanent IPv4 neighbour entry (`ip neigh add ADDRESS lladdr MAC dev .. nud
    permanent`). Packed here rather than by pyroute2's ndmsg (130 us a message, 40 ms
    for the 320 ports of 128 hosts); tests/unit/test_batch.py checks it is the same."""
    dst = socket.inet_aton(address)
    lladdr = bytes.fromhex(mac.replace(":", ""))
    body = (_NDMSG.pack(AF_INET, ifindex, NUD_PERMANENT, 0, 0)
            + _RTATTR.pack(4 + len(dst), NDA_DST) + dst
            + _RTATTR.pack(4 + len(lladdr), NDA_LLADDR) + lladdr)
    body += bytes(-len(body) % 4)
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), RTM_NEWNEIGH, CREATE, 0, 0) + body


def route_message(dst: str, nexthops: Sequence[tuple[str, int]]) -> bytes:
    """A static IPv4 route in the main table: one (gateway, oif) or an ECMP list."""
    address, prefixlen = dst.split("/")
    msg = rtmsg()
    msg["family"], msg["dst_len"], msg["table"] = AF_INET, int(prefixlen), RT_TABLE_MAIN
    msg["proto"], msg["scope"], msg["type"] = RTPROT_STATIC, RT_SCOPE_UNIVERSE, RTN_UNICAST
    attrs: list = [("RTA_DST", address)]
    if len(nexthops) == 1:
        gateway, oif = nexthops[0]
        attrs += [("RTA_GATEWAY", gateway), ("RTA_OIF", oif)]
    else:
        attrs.append(("RTA_MULTIPATH", [
            {"attrs": [("RTA_GATEWAY", gateway)], "oif": oif, "hops": 0, "flags": 0}
            for gateway, oif in nexthops]))
    msg["attrs"] = attrs
    return _encode(msg, RTM_NEWROUTE, CREATE)


# ---------------------------------------------------------------- tc templates

# struct tcmsg follows the netlink header: family (1), padding (3), then the ifindex.
TCMSG_IFINDEX_OFFSET = NLMSG_HDR.size + 4
# The ifindex templates are encoded with; it must appear at the ifindex offset and
# nowhere else, or patching it would not be enough.
_TEMPLATE_IFINDEX = 0x7EB0_0B1E


def _handle(value: int) -> str:
    """0x10013 -> '1:13', 0x10000 -> '1:' (as tc prints them)."""
    major, minor = value >> 16, value & 0xFFFF
    return f"{major:x}:{minor:x}" if minor else f"{major:x}:"


def describe_tc(command: str, kind: str, handle: int | None, kwargs: dict) -> str:
    """'tc class add htb 1:13 parent 1:1', for error messages."""
    verb, _, noun = command.partition("-")          # "add", "add-class", "add-filter"
    words = ["tc", noun or "qdisc", verb, kind]
    if handle:
        words.append(_handle(handle))
    if "parent" in kwargs:
        words += ["parent", _handle(kwargs["parent"])]
    if "keys" in kwargs:
        words += ["match", ",".join(str(k) for k in kwargs["keys"])]
    if "target" in kwargs:
        words += ["flowid", _handle(kwargs["target"])]
    return " ".join(words)


class TcTemplates:
    """tc requests encoded by pyroute2 once per distinct call, then reused for any port.

    A port's queues are the same handful of calls on every port with the same egress
    plan; only the ifindex differs. Encoding one (HTB rate tables included) costs
    pyroute2 ~0.3 ms; patching a copy costs ~1 us.
    """

    def __init__(self) -> None:
        self._cache: dict[str, tuple[str, bytes]] = {}
        self._ipb: IPBatch | None = None

    def __enter__(self) -> TcTemplates:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        if self._ipb is not None:
            self._ipb.close()
            self._ipb = None

    @property
    def distinct(self) -> int:
        return len(self._cache)

    def request(self, command: str, kind: str, index: int, handle: int,
                kwargs: dict) -> tuple[str, bytearray]:
        """(description, message) for `IPRoute.tc(command, kind, index, handle, **kwargs)`."""
        key = repr((command, kind, handle, sorted(kwargs.items())))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._encode(command, kind, handle, kwargs)
        what, template = hit
        message = bytearray(template)
        struct.pack_into("=i", message, TCMSG_IFINDEX_OFFSET, index)
        return what, message

    def _encode(self, command: str, kind: str, handle: int, kwargs: dict) -> tuple[str, bytes]:
        what = describe_tc(command, kind, handle, kwargs)
        if self._ipb is None:
            self._ipb = IPBatch()           # a compiler: it sends nothing
        self._ipb.reset()
        self._ipb.tc(command, kind, _TEMPLATE_IFINDEX, handle, **kwargs)
        data = bytes(self._ipb.batch)
        (length,) = struct.unpack_from("=I", data, 0)
        marker = struct.pack("=i", _TEMPLATE_IFINDEX)
        if length != len(data):
            raise RuntimeError(f"{what}: pyroute2 encoded it as more than one message")
        if (data[TCMSG_IFINDEX_OFFSET:TCMSG_IFINDEX_OFFSET + 4] != marker
                or data.count(marker) != 1):
            raise RuntimeError(f"{what}: the ifindex is not (only) in tcmsg; "
                               "the message cannot be reused for another port")
        return what, data


class BatchedTc:
    """Takes the place of an IPRoute for the qdisc functions (`install_port_queues(
    BatchedTc(...), ifindex, egress)`): each tc() call is queued on a NetlinkBatch
    instead of sent and waited for. Errors surface when the batch is flushed."""

    def __init__(self, batch: NetlinkBatch, templates: TcTemplates, ifname: str) -> None:
        self.batch, self.templates, self.ifname = batch, templates, ifname

    def tc(self, command, kind=None, index=0, handle=0, **kwargs) -> None:
        what, message = self.templates.request(command, kind, index, handle, kwargs)
        self.batch.add(message, f"{what} dev {self.ifname}")
