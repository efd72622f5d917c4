"""RoCEv2 invariant CRC (ICRC) for a user-space sender and receiver on UDP sockets.

The ICRC is the last 4 bytes of a RoCEv2 UDP payload. IBTA Annex A17 computes
it as InfiniBand does: 8 bytes of ones stand for IB's masked LRH, and the IP
and UDP headers, their variant fields masked, take the GRH's place::

    crc = zlib.crc32(b"\\xff" * 8              # the masked LRH of InfiniBand
                     + ip_header_masked        # IPv4: TOS, TTL, checksum -> all ones
                                               # IPv6: traffic class, flow label, hop limit
                     + udp_header_masked       # checksum -> all ones
                     + bth_masked              # byte 4 (FECN, BECN, resv6) -> 0xFF
                     + ext_headers + payload + pad)
    wire = crc.to_bytes(4, "little")

`zlib.crc32` is the standard CRC-32, which already ends with the inversion the
spec asks for ("result inverted"): the kernel (rxe) runs a raw CRC and stores
`~crc`; the two are the same number. Inverting zlib's result once more would
be wrong; the unit tests check this against scapy.contrib.roce.

A UDP-socket sender does not write the IP header, so it has to predict it:
Linux sends IPv4 ID 0 for a DF datagram from an UNCONNECTED socket (checked on
a capture by tests/integration/test_wire_capture.py); a connected socket uses
a per-socket counter and its ICRCs would not verify. The masked fields are
exactly those a switch may rewrite (TOS for CE marks, TTL, checksum), so the
ICRC survives ECN marking.

Hot path: `IcrcContext` holds the pseudo-header for one direction of one flow
(src, dst, sport, dport) and caches the CRC state after the 36 bytes of
pseudo-header per datagram length, so a packet costs one `zlib.crc32` call
over its UDP payload: the builder writes 0xFF into BTH byte 4 while it runs,
the parser corrects for byte 4 with a cached constant (CRC-32 is linear).
No scapy here; scapy is only used by tests to cross-check.
"""

from __future__ import annotations

import functools
import socket
import struct
import zlib
from typing import SupportsBytes

from agents.wire import BytesLike

__all__ = [
    "ICRC_BYTES",
    "IPPROTO_UDP",
    "IPV4_HEADER_BYTES",
    "IPV6_HEADER_BYTES",
    "IP_DF",
    "IP_MTU_DISCOVER",
    "IP_PMTUDISC_DO",
    "LRH_MASK",
    "ROCE_UDP_PORT",
    "UDP_HEADER_BYTES",
    "IcrcContext",
    "icrc_bytes",
    "icrc_context",
    "icrc_for_udp_payload",
    "icrc_of_ip_packet",
    "ipv4_header_for_icrc",
    "ipv6_header_for_icrc",
    "masked_pseudo_header",
]

ROCE_UDP_PORT = 4791
ICRC_BYTES = 4
IPV4_HEADER_BYTES = 20
IPV6_HEADER_BYTES = 40
UDP_HEADER_BYTES = 8
IPPROTO_UDP = 17
IP_DF = 0x4000
# Python's socket module lacks these; Linux's values (include/uapi/linux/in.h).
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2

LRH_MASK = b"\xff" * 8
_LRH_SEED = zlib.crc32(LRH_MASK)
_FF = b"\xff"
_BTH_MASKED_BYTE = 4            # FECN | BECN | resv6, not covered by the ICRC
_SEED_CACHE_MAX = 256           # distinct datagram lengths cached per context
_FIX_CACHE_MAX = 1024           # (length, BTH byte 4) pairs cached per context

_IPV4 = struct.Struct("!BBHHHBBH4s4s")
_IPV6 = struct.Struct("!IHBB16s16s")
_UDP = struct.Struct("!HHHH")
_ICRC = struct.Struct("<I")


def _family_and_bytes(src_ip: str, dst_ip: str) -> tuple[int, bytes, bytes]:
    src, dst = str(src_ip), str(dst_ip)
    family = socket.AF_INET6 if ":" in src else socket.AF_INET
    if (":" in dst) != (family == socket.AF_INET6):
        raise ValueError(f"address families differ: {src} -> {dst}")
    return family, socket.inet_pton(family, src), socket.inet_pton(family, dst)


def _ipv4_checksum(header: bytes) -> int:
    total = sum(struct.unpack("!10H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def ipv4_header_for_icrc(src: str, dst: str, total_len: int, *, ip_id: int = 0,
                         df: bool = True, tos: int = 0, ttl: int = 64,
                         protocol: int = IPPROTO_UDP) -> bytes:
    """The 20-byte IPv4 header Linux emits for a datagram from an unconnected DF socket.

    `total_len` is the IP total length (20 + 8 + UDP payload). The fields the
    ICRC covers are the real ones (version/IHL 0x45, length, ID 0, DF, protocol
    17, addresses); TOS, TTL and the checksum are masked by the ICRC, and are
    filled in as Linux would (TOS as set on the socket, TTL 64, a valid
    checksum) so the result can also be compared with a capture byte for byte.
    """
    _, s, d = _family_and_bytes(src, dst)
    if len(s) != 4:
        raise ValueError(f"not an IPv4 address: {src}")
    if not 20 <= total_len <= 0xFFFF:
        raise ValueError(f"IPv4 total length {total_len} out of range")
    header = _IPV4.pack(0x45, tos, total_len, ip_id, IP_DF if df else 0, ttl, protocol, 0, s, d)
    return header[:10] + struct.pack("!H", _ipv4_checksum(header)) + header[12:]


def ipv6_header_for_icrc(src: str, dst: str, payload_len: int, *, traffic_class: int = 0,
                         flow_label: int = 0, hop_limit: int = 64,
                         next_header: int = IPPROTO_UDP) -> bytes:
    """The 40-byte IPv6 header (no extension headers); `payload_len` = 8 + UDP payload."""
    _, s, d = _family_and_bytes(src, dst)
    if len(s) != 16:
        raise ValueError(f"not an IPv6 address: {src}")
    first = (6 << 28) | ((traffic_class & 0xFF) << 20) | (flow_label & 0xFFFFF)
    return _IPV6.pack(first, payload_len, next_header, hop_limit, s, d)


def masked_pseudo_header(ip_header: BytesLike, udp_header: BytesLike) -> bytes:
    """8 x 0xFF + IP header + UDP header, with the fields the ICRC ignores set to all ones.

    Raises ValueError on an IP header that is not IPv4 (20 to 60 bytes, as its IHL
    says) or IPv6 (40 bytes), or a UDP header that is not 8 bytes."""
    ip = bytearray(ip_header)
    if not ip:
        raise ValueError("empty IP header")
    version = ip[0] >> 4
    if len(udp_header) != UDP_HEADER_BYTES:
        raise ValueError(f"UDP header of {len(udp_header)} bytes (must be {UDP_HEADER_BYTES})")
    if version == 4:
        ihl = (ip[0] & 0x0F) * 4
        if ihl < 20 or len(ip) != ihl:
            raise ValueError(f"IPv4 header of {len(ip)} bytes with IHL {ihl // 4} "
                             "(IHL 5..15, header IHL x 4 bytes)")
        ip[1] = 0xFF                    # TOS (DSCP + ECN)
        ip[8] = 0xFF                    # TTL
        ip[10:12] = b"\xff\xff"         # header checksum
    elif version == 6:
        if len(ip) != IPV6_HEADER_BYTES:
            raise ValueError(f"IPv6 header of {len(ip)} bytes (must be {IPV6_HEADER_BYTES})")
        ip[0:4] = b"\x6f\xff\xff\xff"   # traffic class + flow label
        ip[7] = 0xFF                    # hop limit
    else:
        raise ValueError(f"IP version {version} is neither 4 nor 6")
    udp = bytearray(udp_header)
    udp[6:8] = b"\xff\xff"              # UDP checksum
    return LRH_MASK + bytes(ip) + bytes(udp)


class IcrcContext:
    """ICRC state for datagrams src_ip:sport -> dst_ip:dport (one direction of one flow).

    `icrc(udp_payload_without_icrc)` returns the ICRC as an int (send it with
    `icrc_bytes`, little-endian). Build one per peer and direction, or take
    the shared one from `icrc_context`. Sharing between threads is safe: the
    only mutable state is a cache that two threads may both fill with the
    same value.
    """

    __slots__ = ("src_ip", "dst_ip", "sport", "dport", "ip_id", "df", "family",
                 "_src", "_dst", "_seeds", "_fixes")

    def __init__(self, src_ip: str, dst_ip: str, sport: int, dport: int = ROCE_UDP_PORT,
                 *, ip_id: int = 0, df: bool = True) -> None:
        self.family, self._src, self._dst = _family_and_bytes(src_ip, dst_ip)
        if not (0 <= sport <= 0xFFFF and 0 <= dport <= 0xFFFF):
            raise ValueError(f"UDP ports out of range: {sport} -> {dport}")
        self.src_ip, self.dst_ip = str(src_ip), str(dst_ip)
        self.sport, self.dport = sport, dport
        self.ip_id, self.df = ip_id, df
        self._seeds: dict[int, int] = {}
        self._fixes: dict[int, tuple[int, int]] = {}

    def __repr__(self) -> str:
        return (f"IcrcContext({self.src_ip}:{self.sport} -> {self.dst_ip}:{self.dport}, "
                f"ip_id={self.ip_id}, df={self.df})")

    def pseudo_header(self, udp_payload_len: int) -> bytes:
        """The masked 8 + IP + UDP bytes that precede the BTH in the CRC.

        `udp_payload_len` counts everything after the UDP header, ICRC included.
        """
        udp_len = UDP_HEADER_BYTES + udp_payload_len
        if self.family == socket.AF_INET:
            ip = _IPV4.pack(0x45, 0xFF, IPV4_HEADER_BYTES + udp_len, self.ip_id,
                            IP_DF if self.df else 0, 0xFF, IPPROTO_UDP, 0xFFFF,
                            self._src, self._dst)
        else:
            ip = _IPV6.pack(0x6FFFFFFF, udp_len, IPPROTO_UDP, 0xFF, self._src, self._dst)
        return LRH_MASK + ip + _UDP.pack(self.sport, self.dport, udp_len, 0xFFFF)

    def seed(self, udp_payload_len: int) -> int:
        """CRC state after the pseudo-header (cached per length); chain the BTH onto it."""
        crc = self._seeds.get(udp_payload_len)
        if crc is None:
            ip_bytes = IPV4_HEADER_BYTES if self.family == socket.AF_INET else 0
            if not ICRC_BYTES <= udp_payload_len <= 0xFFFF - UDP_HEADER_BYTES - ip_bytes:
                raise ValueError(f"UDP payload of {udp_payload_len} bytes does not fit "
                                 f"an IPv{4 if ip_bytes else 6} datagram")
            crc = zlib.crc32(self.pseudo_header(udp_payload_len)[8:], _LRH_SEED)
            if len(self._seeds) < _SEED_CACHE_MAX:
                self._seeds[udp_payload_len] = crc
        return crc

    def icrc(self, udp_payload_without_icrc: BytesLike) -> int:
        """ICRC of BTH + extension headers + payload (+ pad); masks BTH byte 4 itself.

        One crc32 call over the data as it is, then a cached correction: the
        CRC is linear, so replacing byte 4 (value X) by 0xFF changes the result
        by a constant that depends only on X and the length.
        """
        n = len(udp_payload_without_icrc)
        if n <= _BTH_MASKED_BYTE:
            raise ValueError(f"{n} bytes cannot hold a BTH")
        key = n << 8 | udp_payload_without_icrc[_BTH_MASKED_BYTE]
        entry = self._fixes.get(key)
        if entry is None:
            entry = self._fix(n, key & 0xFF)
        return zlib.crc32(udp_payload_without_icrc, entry[0]) ^ entry[1]

    def _fix(self, n: int, byte4: int) -> tuple[int, int]:
        tail = bytes(n - _BTH_MASKED_BYTE - 1)
        delta = zlib.crc32(bytes((byte4 ^ 0xFF,)) + tail) ^ zlib.crc32(bytes(1) + tail)
        entry = (self.seed(n + ICRC_BYTES), delta)
        if len(self._fixes) < _FIX_CACHE_MAX:
            self._fixes[n << 8 | byte4] = entry
        return entry

    def icrc_premasked(self, udp_payload_without_icrc: BytesLike) -> int:
        """As `icrc`, for a buffer whose BTH byte 4 already holds 0xFF (one crc32 call)."""
        return zlib.crc32(udp_payload_without_icrc,
                          self.seed(len(udp_payload_without_icrc) + ICRC_BYTES))


@functools.lru_cache(maxsize=4096)
def icrc_context(src_ip: str, dst_ip: str, sport: int, dport: int = ROCE_UDP_PORT,
                 ip_id: int = 0, df: bool = True) -> IcrcContext:
    """A shared `IcrcContext` per (src, dst, sport, dport): cheap to call per packet."""
    return IcrcContext(src_ip, dst_ip, sport, dport, ip_id=ip_id, df=df)


def icrc_for_udp_payload(src_ip: str, dst_ip: str, sport: int, dport: int,
                         udp_payload_without_icrc: BytesLike, *, ip_id: int = 0,
                         df: bool = True) -> int:
    """ICRC (int; `icrc_bytes` gives the 4 wire bytes) of a RoCEv2 datagram sent by a UDP socket.

    `udp_payload_without_icrc` is BTH + extension headers + payload + pad; the
    IP header is the one `ipv4_header_for_icrc` predicts (or IPv6 with hop
    limit, class and flow label masked).
    """
    return icrc_context(src_ip, dst_ip, sport, dport, ip_id, df).icrc(udp_payload_without_icrc)


def icrc_bytes(icrc: int) -> bytes:
    """The ICRC as sent: 4 bytes, little-endian."""
    return _ICRC.pack(icrc)


def icrc_of_ip_packet(packet: SupportsBytes | BytesLike) -> tuple[int, int]:
    """(stored, computed) ICRC of a whole captured IPv4/IPv6 + UDP + RoCE packet.

    Uses the header actually on the wire (ID, flags, lengths as captured), so
    it tells whether a sender predicted the header right. Raises ValueError on
    a packet that is not IP/UDP or is too short to hold a BTH and an ICRC.
    """
    data = memoryview(bytes(packet))
    if not data:
        raise ValueError("empty packet")
    version = data[0] >> 4
    if version == 4:
        ihl = (data[0] & 0x0F) * 4
        if ihl < 20:
            raise ValueError(f"bad IPv4 IHL {ihl // 4} (must be 5..15)")
        if len(data) < ihl:
            raise ValueError(f"truncated IPv4 header: {len(data)} of {ihl} bytes")
        if data[9] != IPPROTO_UDP:
            raise ValueError("not UDP")
        end = struct.unpack_from("!H", data, 2)[0]
    elif version == 6:
        ihl = IPV6_HEADER_BYTES
        if len(data) < ihl or data[6] != IPPROTO_UDP:
            raise ValueError("not UDP (or IPv6 extension headers, unsupported)")
        end = ihl + struct.unpack_from("!H", data, 4)[0]
    else:
        raise ValueError(f"IP version {version}")
    udp_end = ihl + UDP_HEADER_BYTES
    if end > len(data) or end < udp_end + 12 + ICRC_BYTES:
        raise ValueError("truncated or too short for BTH + ICRC")
    pseudo = masked_pseudo_header(data[:ihl], data[ihl:udp_end])
    crc = zlib.crc32(pseudo)
    crc = zlib.crc32(data[udp_end:udp_end + _BTH_MASKED_BYTE], crc)
    crc = zlib.crc32(_FF, crc)
    crc = zlib.crc32(data[udp_end + _BTH_MASKED_BYTE + 1:end - ICRC_BYTES], crc)
    return _ICRC.unpack_from(data, end - ICRC_BYTES)[0], crc
