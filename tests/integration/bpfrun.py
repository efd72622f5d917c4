"""Drive the port program without a network: bpf(BPF_PROG_TEST_RUN) on synthetic frames.

The kernel runs the loaded program on a frame we build, with the `__sk_buff`
context we choose (its ingress_ifindex, as a switch port would see it), and
returns the program's verdict. Maps are the instance's real maps, so a test can
feed an exact sequence of arrivals and departures and read the queue, the
buffer accounting and the events it produced. Needs root (CAP_BPF/SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

from agents.portmaps import _Bpf, obj_get

BPF_PROG_TEST_RUN = 10
TC_ACT_UNSPEC, TC_ACT_OK, TC_ACT_SHOT = 0xFFFFFFFF, 0, 2  # retval as the kernel's u32
SKB_SIZE = 192                  # sizeof(struct __sk_buff) on 6.x kernels (covers every field)
OFF_PRIORITY = 32               # __u32 priority
OFF_INGRESS_IFINDEX = 36        # __u32 ingress_ifindex
ETH = struct.Struct("!6s6sH")
IPV4 = struct.Struct("!BBHHHBBH4s4s")
UDP = struct.Struct("!HHHH")


def frame(length: int, *, dscp: int = 26, ecn: int = 2, src: str = "10.0.0.1",
          dst: str = "10.0.0.2", sport: int = 5000, dport: int = 6000) -> bytes:
    """An Ethernet + IPv4 + UDP frame of exactly `length` bytes (skb->len)."""
    payload = length - ETH.size - IPV4.size - UDP.size
    assert payload >= 0, length
    ip = IPV4.pack(0x45, dscp << 2 | ecn, length - ETH.size, 0, 0x4000, 64, 17, 0,
                   bytes(map(int, src.split("."))), bytes(map(int, dst.split("."))))
    return (ETH.pack(b"\x02" * 6, b"\x02\x00\x00\x00\x00\x01", 0x0800) + ip
            + UDP.pack(sport, dport, payload + UDP.size, 0) + bytes(payload))


class Program:
    """One pinned program of a loaded instance, run on frames."""

    def __init__(self, pin: Path) -> None:
        self.fd = obj_get(pin)
        self.bpf = _Bpf()

    def run(self, data: bytes, ingress_ifindex: int = 0) -> tuple[int, bytes]:
        """(verdict, the frame as the program left it)."""
        data_in = ctypes.create_string_buffer(data, len(data))
        data_out = ctypes.create_string_buffer(len(data) + 256)
        ctx = ctypes.create_string_buffer(SKB_SIZE)
        struct.pack_into("=I", ctx, OFF_INGRESS_IFINDEX, ingress_ifindex)
        b = self.bpf
        b.clear()
        # prog_fd, retval, data_size_in, data_size_out, data_in, data_out, repeat,
        # duration, ctx_size_in, ctx_size_out, ctx_in, ctx_out
        struct.pack_into("=IIIIQQIIIIQQ", b.attr, 0, self.fd, 0, len(data), len(data_out),
                         ctypes.addressof(data_in), ctypes.addressof(data_out), 1, 0,
                         SKB_SIZE, 0, ctypes.addressof(ctx), 0)
        b.call(BPF_PROG_TEST_RUN, "PROG_TEST_RUN")
        retval, _size_in, size_out = struct.unpack_from("=III", b.attr, 4)
        return retval, data_out.raw[:size_out]

    def close(self) -> None:
        os.close(self.fd)
