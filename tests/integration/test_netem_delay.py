"""The netem delay stage on a stock kernel: a ping across the spines takes the plan's
base RTT (dilated), and a run no longer notes the missing delay.

Skipped on kernels without sch_netem or IFB devices (this machine's): runs in the VM
lane (`/work/vmrun`, `testbed run --vm`).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess

import pytest

from testbed.config import load_config_text
from testbed.net import netem
from testbed.net.probe import kernel_config_has
from testbed.plan import compile_plan
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab
from tests.integration.conftest import built_lab

pytestmark = [pytest.mark.root, pytest.mark.stock_kernel]

# The default fabric's links (2 m DAC to the hosts, 100 m of DR4 between leaves and
# spines: base RTT 2 x (120 + 600 + 600 + 120) ns = 2.88 us), one host per leaf.
# What else an echo's round trip pays: the hosts' stacks and the switches' forwarding
# (wall time, not dilated) and its serialisation (dilated, but HTB's burst lets a
# lone echo through at once). Measured in the TCG guest on a loaded 2-core host
# (docs/datapath.md, Link delay): the wall time on top of the delay grows with the
# timer wake-ups a round trip waits for (eight netem stages), +6 ms at the least of
# six echoes at D = 20000 (1.11 x base), +32 ms at D = 200000 (1.056 x); it is
# lateness, never earliness. So the ping runs at D = 1000000 (2.88 s base RTT) and
# the test judges the fastest echo, which waited least.
PING_DILATION = 1_000_000
FABRIC = """\
name: {name}
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 1
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
"""

# PFC off: a PFC agent per switch takes longer than its start-up timeout to start under
# TCG, and this run is about the delay's note and the wire's accounting.
RUN = FABRIC + """\
qos:
  default:
    pfc: {{enabled: false}}
workload:
  traffic:
    - name: across
      kind: udp_pairs
      pairs: [[h1, h2]]
      tclass: roce
      rate: 1Gbps
      duration: {duration}
"""

PINGS = 8


def _has_netem() -> bool:
    # the kernel's build, read without a namespace (the full probe forks pyroute2's
    # netns helper, which can outlast its timeout under TCG on a loaded host)
    return bool(kernel_config_has("netem") and kernel_config_has("ifb"))


needs_netem = pytest.mark.skipif("not _has_netem()",
                                 reason="needs netem: runs in the VM lane")


def _path_delay_ns(plan, src: str, dst: str) -> int:
    """One way, fabric ns, along a shortest path (every path here is as long)."""
    from testbed.run.fidelity import base_rtt_shortfall_ns

    assert {h.name for h in plan.hosts()} == {src, dst}
    return base_rtt_shortfall_ns(plan) // 2


def _ping_ms(plan, src: str, dst: str, count: int) -> list[float]:
    address = plan.node(dst).interfaces[0].address.split("/")[0]
    res = subprocess.run(["ip", "netns", "exec", plan.node(src).netns, "ping", "-n",
                          "-c", str(count), "-i", "0.5", "-W", "10", address],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return [float(m) for m in re.findall(r"time=([0-9.]+) ms", res.stdout)]


@needs_netem
def test_ping_across_the_spines_takes_the_dilated_base_rtt():
    with built_lab(FABRIC, "nem", dilation=PING_DILATION) as plan:
        assert len(netem.wire_stages(plan)) == 2 * len(plan.links)
        rtts = _ping_ms(plan, "h1", "h2", PINGS)
        base_ms = plan.timebase.to_wall_ns(2 * _path_delay_ns(plan, "h1", "h2")) / 1e6
        best = min(rtts)
        print(f"base RTT {base_ms:.1f} ms wall (D={plan.dilation.factor}); ping RTTs "
              f"{rtts} ms; fastest {best:.1f} ms = {best / base_ms:.4f} x base, median "
              f"{statistics.median(rtts) / base_ms:.4f} x")
        assert len(rtts) == PINGS
        assert best >= base_ms, "faster than the links' delay: no netem on the path?"
        assert best == pytest.approx(base_ms, rel=0.05)


@needs_netem
def test_a_run_with_netem_does_not_note_missing_delay(tmp_path):
    lab = unique_lab("nemr")
    loaded = load_config_text(RUN.format(name=lab, dilation=20000, duration="200us"),
                              "netem-run.yaml")
    plan = compile_plan(loaded)
    result = run_config(loaded, plan, RunOptions(runs_root=tmp_path, say=lambda _m: None))
    summary = json.loads((result.run_dir / "summary.json").read_text())
    notes = summary["fidelity"]
    print("fidelity notes:", notes)
    assert not [n for n in notes if "not emulated" in n or "base RTT is short" in n]
    conservation = summary["invariants"]["checks"]["conservation"]
    print("conservation:", conservation)
    assert conservation["held"], summary["invariants"]["violations"]
