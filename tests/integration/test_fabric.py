"""The default fabric, built for real: reachability, line rate, ECMP, classes, clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from testbed.net import apply_plan, destroy_lab, list_states
from testbed.net.counters import read_counters
from testbed.net.namespaces import exists, list_testbed_namespaces
from testbed.run import smoke
from tests.conftest import REPO
from tests.integration.conftest import initial_namespace_snapshot, plan_from_file

pytestmark = pytest.mark.root


def test_every_host_reaches_every_other_host(default_fabric, tmp_path):
    results = smoke.reachability(default_fabric, str(tmp_path), count=2)
    hosts = [h.name for h in default_fabric.hosts()]
    assert len(hosts) == 8
    assert set(results) == set(smoke.all_pairs(hosts))   # all 56 ordered pairs
    silent = {pair: r for pair, r in results.items() if r["replies"] != 2}
    assert not silent, f"pairs without echo replies: {sorted(silent)}"


def test_line_rate_stream_arrives_at_the_dilated_phy_rate(default_fabric, tmp_path):
    # h1 sends 10 % above its NIC's line rate for 3 s of wall time; the NIC's
    # HTB shapes it to the PHY's MAC rate divided by D.
    res = smoke.stream(default_fabric, "h1", "h8", str(tmp_path), wall_seconds=3.0)
    nic = default_fabric.node("h1").interfaces[0]
    assert nic.egress.rate_bps == 100_000_000_000        # 100GBASE-CR1 MAC rate
    assert res.expected_wall_bps == nic.egress.rate_bps // default_fabric.dilation.factor
    active_s = (res.receiver["end_wall_ns"] - res.receiver["start_wall_ns"]) / 1e9
    assert active_s >= 2.0
    assert res.ratio == pytest.approx(1.0, abs=0.05), (
        f"received {res.receiver['wall_bps'] / 1e6:.2f} Mb/s wall, expected "
        f"{res.expected_wall_bps / 1e6:.2f}")
    assert res.receiver["fabric_bps"] == pytest.approx(100e9, rel=0.05)


def test_flows_with_different_source_ports_use_both_spines(default_fabric, tmp_path):
    before = smoke.link_tx_bytes(default_fabric)
    smoke.stream(default_fabric, "h2", "h7", str(tmp_path), wall_seconds=1.0, flows=16,
                 overdrive=0.5, payload_bytes=1000)
    after = smoke.link_tx_bytes(default_fabric)
    spread = smoke.uplink_spread(default_fabric, before, after, "leaf1")
    assert len(spread) == 2
    total = sum(spread.values())
    assert total > 0
    for port, sent in spread.items():
        assert sent > 0.15 * total, f"uplink {port} carried {sent} of {total} bytes: {spread}"


def test_dscp_selects_the_traffic_class(default_fabric, tmp_path):
    def class_bytes():
        _, classes = read_counters(default_fabric)
        return {(c.node, c.ifname, c.tc): c.bytes for c in classes}

    before = class_bytes()
    smoke.stream(default_fabric, "h3", "h4", str(tmp_path), wall_seconds=0.5, overdrive=0.5,
                 payload_bytes=1000, dscp=26)
    after = class_bytes()
    delta = {k: after[k] - before[k] for k in after}
    # h3 -> leaf1 -> h4: the RoCE class (TC3) carried it at both egress ports.
    assert delta[("h3", "eth0", 3)] > 100_000
    assert delta[("leaf1", "swp4", 3)] > 100_000
    assert delta[("h3", "eth0", 0)] < 0.01 * delta[("h3", "eth0", 3)]


def test_up_is_idempotent_and_down_removes_everything(build):
    snapshot = initial_namespace_snapshot()
    plan = plan_from_file("configs/default.yaml", "idem")
    build(plan)
    again = apply_plan(plan)
    assert again.already_up
    assert all(exists(n.netns) for n in plan.nodes)
    removed = destroy_lab(plan.lab)
    assert sorted(removed) == sorted(n.netns for n in plan.nodes)
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(plan.netns_prefix)]
    assert plan.lab not in [s.lab for s in list_states()]
    assert initial_namespace_snapshot() == snapshot


def test_failed_up_removes_what_it_made(monkeypatch):
    import testbed.net.builder as builder

    plan = plan_from_file("configs/default.yaml", "fail")
    calls = {"n": 0}
    real = builder.install_port_queues

    def failing(ipr, idx, egress):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected failure")
        return real(ipr, idx, egress)

    monkeypatch.setattr(builder, "install_port_queues", failing)
    with pytest.raises(RuntimeError, match="injected"):
        apply_plan(plan)
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(plan.netns_prefix)]
    assert plan.lab not in [s.lab for s in list_states()]


@pytest.mark.slow
def test_sigkilled_up_is_cleaned_by_down_all(tmp_path):
    # `down --all` removes every lab and tb- namespace on the machine: never under another
    # run's feet (a developer's lab, or tests run beside this one)
    others = list_testbed_namespaces() or [s.lab for s in list_states()]
    if others:
        pytest.skip(f"other labs are up ({', '.join(others[:3])}...): down --all would "
                    "remove them")
    snapshot = initial_namespace_snapshot()
    # A big enough fabric that `up` is still working when it is killed.
    config = tmp_path / "big.yaml"
    config.write_text(
        "name: killme\n"
        "topology: {kind: leaf_spine, spines: 4, leaves: 8, hosts_per_leaf: 16,\n"
        "  host_link: {port: 100GBASE-CR1, length: 2m},\n"
        "  fabric_link: {port: 400GBASE-DR4, length: 100m}}\n")
    testbed = [sys.executable, "-m", "testbed"]
    proc = subprocess.Popen([*testbed, "up", str(config)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            made = [ns for ns in list_testbed_namespaces() if ns.startswith("tb-killme-")]
            if len(made) >= 20:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "up finished before it could be killed; use a bigger fabric"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert [ns for ns in list_testbed_namespaces() if ns.startswith("tb-killme-")]
    finally:
        if proc.poll() is None:
            proc.kill()
        res = subprocess.run([*testbed, "down", "--all"], cwd=REPO, capture_output=True,
                             text=True)
    assert res.returncode == 0, res.stderr
    assert list_testbed_namespaces() == []
    assert "killme" not in [s.lab for s in list_states()]
    assert initial_namespace_snapshot() == snapshot
