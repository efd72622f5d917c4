"""PFC storm and the watchdog: a host that keeps sending XOFF (a broken NIC) stalls its
switch port for good, unless the watchdog declares a storm and forwards regardless."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from testbed.config import load_config_text
from testbed.net import apply_plan, destroy_lab
from testbed.plan import compile_plan
from testbed.run.fabric_agents import start_pfc_agents
from testbed.run.procs import start_agent
from tests.conftest import unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

CONFIG = """\
name: {lab}
dilation: 1000
topology:
  kind: single_switch
  hosts: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
qos:
  default:
    pfc: {{watchdog: {watchdog}}}
"""

# A NIC stuck sending XOFF for TC3: every 20 ms of wall time (20 us fabric at
# D = 1000), well inside the 335 us each pause lasts.
STORM = """
import socket, struct, sys, time
from agents.wire import pfc
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
frame = pfc.encode(bytes.fromhex(sys.argv[1].replace(":", "")), {3: 0xFFFF})
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    s.send(frame)
    time.sleep(0.02)
"""


def _stream(plan, seconds: float) -> dict:
    """h1 -> h2 on the lossless class at 10 Gb/s fabric; what h2 received."""
    d = plan.dilation.factor
    dst = plan.node("h2").interfaces[0].address.split("/")[0]
    recv = start_agent(plan.lab, plan.node("h2").netns, "agents.udp",
                       ["recv", "--port", "5000", "--dilation", str(d),
                        "--duration-ns", str(int((seconds + 1.5) * 1e9 / d))], "recv")
    time.sleep(0.5)
    send = start_agent(plan.lab, plan.node("h1").netns, "agents.udp",
                       ["send", "--dst", dst, "--dport", "5000", "--rate-bps", "10000000000",
                        "--size", "1000", "--duration-ns", str(int(seconds * 1e9 / d)),
                        "--dscp", "26", "--dilation", str(d)], "send")
    send.result(timeout_s=seconds + 20)
    return recv.result(timeout_s=seconds + 20)


@pytest.mark.parametrize("watchdog", ["0us", "100us"], ids=["no-watchdog", "watchdog"])
def test_a_pfc_storm_stalls_the_port_unless_the_watchdog_breaks_it(watchdog, tmp_path):
    cfg = CONFIG.format(lab=unique_lab("storm"), watchdog=watchdog)
    if watchdog == "0us":     # the default: no watchdog at all
        cfg = cfg[:cfg.index("qos:")]
    plan = compile_plan(load_config_text(cfg, "storm.yaml"))
    apply_plan(plan)
    agents = []
    try:
        (tmp_path / "plan.json").write_text(plan.to_json())
        agents = start_pfc_agents(plan, tmp_path / "plan.json", tmp_path / "agents")
        storm = subprocess.Popen(["ip", "netns", "exec", plan.node("h2").netns, sys.executable,
                                  "-c", STORM, plan.node("h2").interfaces[0].mac, "4"])
        time.sleep(0.3)
        received = _stream(plan, seconds=2.0)
        storm.wait(timeout=20)
    finally:
        for proc, _endpoint in agents:
            proc.stop()
        destroy_lab(plan.lab)
    events = [json.loads(line) for line in
              (tmp_path / "agents" / "sw1-pfc.events.jsonl").read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    print(f"{watchdog}: h2 received {received['packets']} packets; events {sorted(kinds)}")
    assert "pfc_paused" in kinds                # the storm did pause sw1's port to h2
    if watchdog == "0us":
        assert "pfc_storm" not in kinds
        assert received["packets"] < 50         # stalled: a frame or two leak per pause
    else:
        storms = [e for e in events if e["kind"] == "pfc_storm"]
        assert storms and storms[0]["port"] == "swp2" and storms[0]["tclass"] == 3
        assert received["packets"] > 1000       # forwarded regardless of the storm
