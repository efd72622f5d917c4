"""The pause gate of one egress class: a TBF leaf opened and closed by netlink.

A PFC-paused class must send nothing after the pause takes effect. The gate is
the TBF leaf under the class's HTB class (testbed/net/qdisc.py builds it open).

- Open: TBF at the port's wall rate with the port's burst.
- Closed: TBF at PAUSED_RATE_BPS, a bucket of one frame, and `mpu` = 65535.
  A TBF change refills the bucket, so a closed gate without more would still
  let one frame out (measured: one 9 KB frame per close). `mpu` (minimum
  packet unit) makes TBF charge every packet as at least 65535 bytes, which a
  one-frame bucket can never pay: nothing leaves. TBF refuses at enqueue only
  packets larger than what the bucket holds in bytes (max_size, computed
  without mpu), so arrivals still queue behind the closed gate.
- The kernel caps TBF's bucket at 2^32 ns (4.29 s): PAUSED_RATE_BPS must carry
  one full frame in that time, or TBF would drop every frame as too large;
  20 kbit/s carries 9038 B in 3.6 s.
- HTB keeps token debt across a class change (so an HTB class cannot be the
  gate); TBF's change resets its tokens, so an opened gate resumes at once.

Messages are compiled once by pyroute2's batch compiler (it sends nothing):
a pause then costs one raw netlink write and its ack (~20 us of wall time).
pyroute2's tbf plugin has no `mpu` argument, so `set_rate_mpu` writes it into
the compiled message's tc_ratespec.
"""

from __future__ import annotations

import struct

from agents.wire.netlink import Requester, attrs

__all__ = ["Requester", "set_rate_mpu", "tbf_messages"]   # Requester: agents.wire.netlink's

PAUSED_RATE_BPS = 20_000
PAUSED_MPU_BYTES = 0xFFFF           # tc_ratespec.mpu is 16 bits
NLMSG_HDR = 16
TCMSG = 20
TCA_OPTIONS = 2
TCA_TBF_PARMS = 1
RATESPEC_MPU_OFFSET = 6             # cell_log u8, linklayer u8, overhead u16, cell_align s16


def set_rate_mpu(message: bytes, mpu: int) -> bytes:
    """The TBF qdisc message with its rate's mpu set (raises if it is not one)."""
    data = bytearray(message)
    for kind, start, end in attrs(data, NLMSG_HDR + TCMSG, len(data)):
        if kind != TCA_OPTIONS:
            continue
        for sub, s0, _s1 in attrs(data, start, end):
            if sub == TCA_TBF_PARMS:
                struct.pack_into("=H", data, s0 + RATESPEC_MPU_OFFSET, mpu)
                return bytes(data)
    raise ValueError("not a TBF message with TCA_TBF_PARMS")


def tbf_messages(ifindex: int, leaf_handle: int, parent: int, wall_rate_bps: int,
                 burst_bytes: int, frame_bytes: int, limit_bytes: int) -> tuple[bytes, bytes]:
    """(open, closed) RTM_NEWQDISC "change" messages of one class's gate."""
    from pyroute2 import IPBatch  # a message compiler: it sends nothing

    ipb = IPBatch()
    try:
        out = []
        for paused in (False, True):
            ipb.reset()
            ipb.tc("change", "tbf", ifindex, leaf_handle, parent=parent,
                   rate=f"{PAUSED_RATE_BPS if paused else wall_rate_bps}bit",
                   burst=frame_bytes if paused else burst_bytes, limit=limit_bytes)
            msg = bytes(ipb.batch)
            out.append(set_rate_mpu(msg, PAUSED_MPU_BYTES) if paused else msg)
        return out[0], out[1]
    finally:
        ipb.close()
