"""The PFC gate's TBF messages are the ones pyroute2 compiles, without pyroute2 in the agent.

agents/pfc/gate.py encodes its RTM_NEWQDISC "change" messages itself (pyroute2 costs a
PFC agent ~20 MB, bench/agent_memory.py). Here the control plane's pyroute2 (a test may
import it; an agent may not) compiles the same requests, and the two must agree byte for
byte but for the sequence number and port id (bytes 8..15 of the header), which
`Requester.request` sets and the kernel ignores.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from agents.pfc import gate

pyroute2 = pytest.importorskip("pyroute2")


def pyroute2_tbf(ifindex: int, handle: int, parent: int, rate_bps: int, burst: int,
                 limit: int) -> bytes:
    ipb = pyroute2.IPBatch()
    try:
        ipb.tc("change", "tbf", ifindex, handle, parent=parent, rate=f"{rate_bps}bit",
               burst=burst, limit=limit)
        return bytes(ipb.batch)
    finally:
        ipb.close()


def masked(message: bytes) -> bytes:
    return message[:8] + b"\0" * 8 + message[16:]


@pytest.mark.parametrize(("rate_bps", "burst", "limit"), [
    (200_000_000, 30_000, 1 << 20),          # a dilated 100G port
    (50_000_000, 9_038, 262_144),
    (1_000_000_000, 65_536, 4 << 20),
    (12_345_678, 1_500, 100_000),
    (gate.PAUSED_RATE_BPS, 9_038, 1 << 20),  # the closed gate's rate
])
def test_tbf_change_is_pyroute2s_message(rate_bps, burst, limit):
    ours = gate.tbf_change(7, 0x110000, 0x10011, rate_bps, burst, limit)
    assert masked(ours) == masked(pyroute2_tbf(7, 0x110000, 0x10011, rate_bps, burst, limit))


def test_gate_messages_match_what_pyroute2_made():
    opened, closed = gate.tbf_messages(5, 0x10010, 0x10002, 200_000_000, 30_000, 9_038,
                                       1 << 20)
    assert masked(opened) == masked(pyroute2_tbf(5, 0x10010, 0x10002, 200_000_000, 30_000,
                                                 1 << 20))
    want = gate.set_rate_mpu(pyroute2_tbf(5, 0x10010, 0x10002, gate.PAUSED_RATE_BPS, 9_038,
                                          1 << 20), gate.PAUSED_MPU_BYTES)
    assert masked(closed) == masked(want)


def test_the_pfc_agent_does_not_import_pyroute2():
    code = ("import sys, agents.pfc.__main__ as m; from agents.pfc import gate; "
            "gate.tbf_messages(1, 1 << 16, 0x10002, 10**8, 9000, 9000, 1 << 20); "
            "print(sorted(x for x in ('pyroute2', 'numpy') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
