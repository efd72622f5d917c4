"""Netlink attributes (struct rtattr / nlattr): the TLVs of rtnetlink messages, read in
place. Used by the kernel sampler (qdisc dumps) and the PFC agent's gate (patching a
compiled TBF message)."""

from __future__ import annotations

import struct
from collections.abc import Iterator

RTA = struct.Struct("=HH")          # rta_len, rta_type
NLA_TYPE_MASK = 0x3FFF              # without NLA_F_NESTED / NLA_F_NET_BYTEORDER


def attrs(buf: bytes | bytearray | memoryview, start: int, end: int
          ) -> Iterator[tuple[int, int, int]]:
    """(type, payload start, payload end) of each attribute in buf[start:end]."""
    offset = start
    while offset + RTA.size <= end:
        length, kind = RTA.unpack_from(buf, offset)
        if length < RTA.size:
            return
        yield kind & NLA_TYPE_MASK, offset + RTA.size, offset + length
        offset += (length + 3) & ~3
