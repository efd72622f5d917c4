"""Netlink for agents: attributes (struct rtattr / nlattr), the TLVs of rtnetlink
messages, read in place (the kernel sampler's qdisc dumps, the PFC agent's gate patching
a compiled TBF message); and `Requester`, which sends compiled rtnetlink requests and
waits for their acks (the PFC gate's TBF changes, the rxe_cc agent's HTB class changes)."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

NLMSG_ERROR, NLM_F_ACK = 2, 0x4
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


class Requester:
    """Sends compiled rtnetlink requests on one socket (of the namespace it was opened
    in) and waits for each ack; raises OSError with the kernel's reason."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.sock.settimeout(2.0)
        self.seq = 0

    def request(self, message: bytes) -> None:
        self.seq = (self.seq + 1) & 0x7FFFFFFF
        data = bytearray(message)
        struct.pack_into("=HI", data, 6, struct.unpack_from("=H", data, 6)[0] | NLM_F_ACK,
                         self.seq)
        self.sock.send(data)
        while True:
            reply = self.sock.recv(65536)
            offset = 0
            while offset + 16 <= len(reply):
                length, kind, _flags, seq = struct.unpack_from("=IHHI", reply, offset)
                if kind == NLMSG_ERROR and seq == self.seq:
                    code = struct.unpack_from("=i", reply, offset + 16)[0]
                    if code:
                        raise OSError(-code, f"netlink request refused: {os.strerror(-code)}")
                    return
                offset += max(16, (length + 3) & ~3)

    def close(self) -> None:
        self.sock.close()
