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

Messages are encoded once, here, at set-up (and again when a timeline event changes
the port's rate): a pause then costs one raw netlink write and its ack (~20 us of wall
time). The encoding is the one pyroute2's tbf plugin makes (`IPBatch().tc("change",
"tbf", ...)`: TCA_TBF_PARMS and the 256-entry rate table of tc's tc_calc_rtab), byte
for byte but for the sequence number and port id, which the Requester sets and the
kernel ignores (tests/unit/test_pfc_gate.py holds the two side by side). It is written
out instead of imported because pyroute2 costs a PFC agent ~20 MB of private memory
(asyncio, ssl, sqlite3 and its own modules) for two messages per class, and a fabric
runs one PFC agent per node (bench/agent_memory.py). `set_rate_mpu` writes the closed
gate's `mpu` into the encoded tc_ratespec, as it did into pyroute2's message.
"""

from __future__ import annotations

import struct

from agents.wire.netlink import NLM_F_ACK, RTA, Requester, attrs

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


RTM_NEWQDISC = 36
NLM_F_REQUEST, NLM_F_REPLACE = 0x1, 0x100
TCA_KIND = 1
TCA_TBF_RTAB = 2
TIME_UNITS_PER_SEC = 1_000_000
RTAB_MTU = 1600                     # tc's default when no mtu is given
_NLMSG = struct.Struct("=IHHII")    # len, type, flags, seq, pid
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
# tc_tbf_qopt: rate and peak tc_ratespec (cell_log, linklayer, overhead, cell_align, mpu,
# rate), then limit, buffer, mtu
_TBF_QOPT = struct.Struct("=BBHhHI" "BBHhHI" "III")
_tick_in_usec: float | None = None


def tick_in_usec() -> float:
    """Kernel packet-scheduler ticks per microsecond, from /proc/net/psched as tc reads it
    (1 when the file cannot be read, as pyroute2 does)."""
    global _tick_in_usec
    if _tick_in_usec is None:
        try:
            with open("/proc/net/psched") as f:
                t2us, us2t, clock_res, _wee = (int(x, 16) for x in f.read().split())
            _tick_in_usec = t2us / us2t * (clock_res / TIME_UNITS_PER_SEC)
        except (OSError, ValueError):
            _tick_in_usec = 1.0
    return _tick_in_usec


def xmittime(rate_bytes_s: float, size: int) -> int:
    """tc's tc_calc_xmittime: ticks to send `size` bytes at the rate."""
    return int(int(TIME_UNITS_PER_SEC * (float(size) / rate_bytes_s)) * tick_in_usec())


def _nla(kind: int, payload: bytes) -> bytes:
    data = RTA.pack(RTA.size + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def tbf_change(ifindex: int, handle: int, parent: int, rate_bps: int, burst_bytes: int,
               limit_bytes: int) -> bytes:
    """An RTM_NEWQDISC "change" of a TBF at `rate_bps` (bits/s) with a `burst_bytes`
    bucket and a `limit_bytes` queue: what pyroute2 encodes for
    `tc("change", "tbf", ifindex, handle, parent=..., rate="<R>bit", burst=B, limit=L)`,
    with sequence number and port id 0."""
    rate = rate_bps / 8                  # bytes/s, a float as tc computes with
    cell_log = 0
    while (RTAB_MTU >> cell_log) > 255:
        cell_log += 1
    rtab = struct.pack("=256I", *(xmittime(rate, (i + 1) << cell_log) for i in range(256)))
    qopt = _TBF_QOPT.pack(cell_log, 0, 0, -1, 0, int(rate),
                          0, 0, 0, 0, 0, 0,
                          int(limit_bytes), xmittime(rate, burst_bytes), 0)
    options = _nla(TCA_OPTIONS, _nla(TCA_TBF_PARMS, qopt) + _nla(TCA_TBF_RTAB, rtab))
    body = (_TCMSG.pack(0, ifindex, handle, parent, 0) + _nla(TCA_KIND, b"tbf\0")
            + options)
    return _NLMSG.pack(_NLMSG.size + len(body), RTM_NEWQDISC,
                       NLM_F_REQUEST | NLM_F_ACK | NLM_F_REPLACE, 0, 0) + body


def tbf_messages(ifindex: int, leaf_handle: int, parent: int, wall_rate_bps: int,
                 burst_bytes: int, frame_bytes: int, limit_bytes: int) -> tuple[bytes, bytes]:
    """(open, closed) RTM_NEWQDISC "change" messages of one class's gate."""
    opened = tbf_change(ifindex, leaf_handle, parent, wall_rate_bps, burst_bytes,
                        limit_bytes)
    closed = tbf_change(ifindex, leaf_handle, parent, PAUSED_RATE_BPS, frame_bytes,
                        limit_bytes)
    return opened, set_rate_mpu(closed, PAUSED_MPU_BYTES)
