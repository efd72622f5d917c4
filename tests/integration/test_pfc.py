"""Lossless Ethernet end to end: PFC on the default fabric under a 7:1 incast.

One run with PFC on (captured) and one with PFC off, both from the examples
in configs/examples/, with a unique lab name and a shorter duration.
"""

from __future__ import annotations

import json

import pytest
from scapy.contrib.mac_control import MACControlClassBasedFlowControl
from scapy.utils import rdpcap

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import REPO, unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

LOSSLESS = 3


def _run(example: str, stem: str, tmp_path_factory, capture: bool = False):
    text = (REPO / "configs" / "examples" / example).read_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("name:"):
            line = f"name: {unique_lab(stem)}"
        line = line.replace("duration: 1ms", "duration: 600us")
        if line.strip() == "tclass: roce":
            line += "\n      ecn: ect0"
        lines.append(line)
    loaded = load_config_text("\n".join(lines) + "\n", example)
    plan = compile_plan(loaded)
    runs = tmp_path_factory.mktemp(stem)
    result = run_config(loaded, plan, RunOptions(runs_root=runs, capture=capture,
                                                 say=lambda _m: None))
    return plan, result.run_dir, json.loads((result.run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def pfc_on(tmp_path_factory):
    return _run("incast-pfc.yaml", "pfcon", tmp_path_factory, capture=True)


@pytest.fixture(scope="module")
def pfc_off(tmp_path_factory):
    return _run("incast-nopfc.yaml", "pfcoff", tmp_path_factory)


def _port(summary, node, port, tc=LOSSLESS):
    return next(p for p in summary["ports"]
                if (p["node"], p["port"], p["tclass"]) == (node, port, tc))


def test_lossless_class_never_drops_under_7_to_1_incast(pfc_on):
    plan, run_dir, summary = pfc_on
    lossless = [p for p in summary["ports"] if p["tclass"] == LOSSLESS]
    assert sum(p["drops"] for p in lossless) == 0
    rows = summary["workloads"][0]["results"]
    assert len(rows) == 7
    # The fabric loses nothing. On a loaded machine the receiving agent itself can fall
    # behind and overflow its own socket buffer: that is the emulator's host, counted
    # there and named in the fidelity notes, never a fabric drop.
    lost = sum(r["lost"] for r in rows)
    socket_drops = sum((summary["invariants"].get("host_socket_drops") or {}).values())
    assert lost <= socket_drops, (lost, socket_drops, summary["fidelity"])
    if lost:
        assert any("its own socket buffer" in n for n in summary["fidelity"])
    assert summary["invariants"]["checks"]["conservation"]["held"]
    assert sum(r["tx_packets"] for r in rows) > 0
    # h8 got its line rate, shared by the seven senders.
    assert sum(r["rx_fabric_bps"] for r in rows) == pytest.approx(100e9, rel=0.1)
    # The receiver's leaf sent pauses; every sender's NIC received some.
    assert sum(_port(summary, "leaf2", p)["pause_tx"] for p in ("swp1", "swp2", "swp3")) > 0
    for host in ("h1", "h2", "h3", "h4", "h5", "h6", "h7"):
        nic = _port(summary, host, "eth0")
        assert nic["pause_rx"] > 0 and nic["paused_ns"] > 0, host
    # ECN marked on the congested port as the queue passed Kmin (100 KB).
    assert _port(summary, "leaf2", "swp4")["ecn_marks"] > 0
    assert _port(summary, "leaf2", "swp4")["max_queue_bytes"] > 100_000


def test_without_pfc_the_same_incast_drops(pfc_off):
    _plan, _run_dir, summary = pfc_off
    assert _port(summary, "leaf2", "swp4")["drops"] > 0
    assert summary["totals"]["pause_frames"] == 0
    assert sum(r["lost"] for r in summary["workloads"][0]["results"]) > 0


def test_lossy_class_on_the_same_ports_is_never_paused(pfc_on):
    _plan, run_dir, summary = pfc_on
    # h4 -> h6 runs on TC0 through leaf1, the spines and leaf2, all pausing TC3.
    lossy = next(w for w in summary["workloads"] if w["name"] == "lossy")["results"][0]
    assert lossy["lost"] == 0 and lossy["rx_packets"] > 0
    assert all(p["pause_tx"] == 0 and p["paused_ns"] == 0
               for p in summary["ports"] if p["tclass"] != LOSSLESS)
    store = Store(run_dir / "counters.sqlite")
    assert {e["tclass"] for e in store.events("pfc_xoff")} == {LOSSLESS}
    store.close()


def test_pauses_spread_two_hops_in_order(pfc_on):
    _plan, run_dir, _summary = pfc_on
    store = Store(run_dir / "counters.sqlite")
    first: dict[str, float] = {}
    for event in store.events("pfc_xoff"):
        first.setdefault(event["node"], event["ts_fabric_ns"])
    store.close()
    # leaf2 (the receiver's leaf) pauses the spines, the spines pause leaf1,
    # leaf1 pauses its hosts: congestion spreads upstream hop by hop. (ECMP may
    # hash all four of leaf1's flows onto one spine: one in eight runs; then
    # only that spine pauses.)
    spines = [first[s] for s in ("spine1", "spine2") if s in first]
    assert {"leaf2", "leaf1"} <= set(first) and spines
    assert first["leaf2"] < min(spines) < first["leaf1"]


def test_pfc_frames_on_the_wire_decode_as_802_1qbb(pfc_on):
    plan, run_dir, _summary = pfc_on
    frames = [p for p in rdpcap(str(run_dir / "pcap" / "h5-eth0.pcap"))
              if p.haslayer(MACControlClassBasedFlowControl)]
    assert frames, "no PFC frame captured on h5's NIC"
    xoff = [f[MACControlClassBasedFlowControl] for f in frames
            if f[MACControlClassBasedFlowControl].c3_pause_time > 0]
    assert xoff
    for ctl in xoff:
        assert ctl.c3_enabled == 1
        assert not any(getattr(ctl, f"c{p}_enabled") for p in range(8) if p != LOSSLESS)
        # 65535 quanta of 512 bit times at the link's 100 Gb/s: 335.5 us of pause.
        assert ctl.c3_pause_time == 0xFFFF
    link_rate = plan.node("h5").interfaces[0].egress.rate_bps
    assert 0xFFFF * 512 / link_rate * 1e6 == pytest.approx(335.5, abs=0.1)
    assert frames[0].src == plan.node("leaf2").interfaces[
        [i.peer.node for i in plan.node("leaf2").interfaces].index("h5")].mac
