"""PFC agents grouped into one process behave as one process per node (docs/pfc.md "One
process, several nodes"): the 7:1 incast example with PFC on, once with a process per
node and once with all twelve nodes in one process.

Both runs must be lossless (no lossless drop, no lost packet, every invariant held), pause
every sender's NIC, have the receiver's leaf send pauses toward its uplinks, resume every
class it paused (nothing left paused), and count pause frames per port: every XOFF and XON a
port sent is a frame its peer port received (pause_tx + xon_tx of a port == pause_rx of
its peer, on the lossless class). Each node's samples say how many nodes its process served.
"""

from __future__ import annotations

import json

import pytest

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import REPO, unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

LOSSLESS = 3


def _run(per_process: int, tmp_path_factory):
    text = (REPO / "configs" / "examples" / "incast-pfc.yaml").read_text()
    text = text.replace("name: incaston", f"name: {unique_lab(f'pfcg{per_process}')}")
    text = text.replace("duration: 1ms", "duration: 600us")
    loaded = load_config_text(text, "incast-pfc.yaml")
    plan = compile_plan(loaded)
    runs = tmp_path_factory.mktemp(f"pfcg{per_process}")
    result = run_config(loaded, plan, RunOptions(runs_root=runs, say=lambda _m: None,
                                                 pfc_nodes_per_process=per_process))
    summary = json.loads((result.run_dir / "summary.json").read_text())
    store = Store(result.run_dir / "counters.sqlite")
    try:
        nodes = {key[0]: v for key, pts in store.aligned("pfc.process_nodes").items()
                 for _t, v in pts[-1:]}
        frames = {c: {(k[0], k[1], k[2]): v for k, pts in store.aligned(c).items()
                      for _t, v in pts[-1:]} for c in ("pause_tx", "xon_tx", "pause_rx", "paused")}
    finally:
        store.close()
    return plan, summary, nodes, frames


@pytest.fixture(scope="module", params=[1, 12], ids=["one-per-node", "all-in-one"])
def run(request, tmp_path_factory):
    return request.param, *_run(request.param, tmp_path_factory)


def _port(summary, node, port, tc=LOSSLESS):
    return next(p for p in summary["ports"]
                if (p["node"], p["port"], p["tclass"]) == (node, port, tc))


def test_grouped_agents_keep_the_incast_lossless(run):
    per_process, plan, summary, nodes, _frames = run
    assert summary["invariants"]["violations"] == []
    assert all(c["held"] for c in summary["invariants"]["checks"].values())
    lossless = [p for p in summary["ports"] if p["tclass"] == LOSSLESS]
    assert sum(p["drops"] for p in lossless) == 0
    # nothing lost in the fabric (the invariants' per-stream accounting); a receiver's own
    # socket overflowing on a loaded machine is not PFC's and is counted apart
    streams = [x for x in summary["invariants"]["streams"] if x["name"].startswith("incast-")]
    assert len(streams) == 7 and sum(x["sent"] for x in streams) > 0
    assert all(x["fabric_drops"] == 0 for x in streams)
    assert summary["invariants"]["checks"]["lossless_drop"]["held"] is True
    # every node was served, by a process of the asked size
    assert set(nodes) == {n.name for n in plan.nodes}
    assert set(nodes.values()) == {float(per_process)}


def test_grouped_agents_pause_and_resume_per_port(run):
    _per_process, plan, summary, _nodes, frames = run
    assert sum(_port(summary, "leaf2", p)["pause_tx"] for p in ("swp1", "swp2", "swp3")) > 0
    for host in ("h1", "h2", "h3", "h4", "h5", "h6", "h7"):
        nic = _port(summary, host, "eth0")
        assert nic["pause_rx"] > 0 and nic["paused_ns"] > 0, host
    # every PFC frame a port sent (XOFF and XON), its peer counted on the same class, in
    # the last sample (taken with the agents still up); each pause was resumed
    sent = 0
    for node in plan.nodes:
        for iface in node.interfaces:
            if not any(c.tc == LOSSLESS and c.pfc for c in iface.egress.classes):
                continue
            me = (node.name, iface.ifname, LOSSLESS)
            peer = (iface.peer.node, iface.peer.ifname, LOSSLESS)
            tx = frames["pause_tx"].get(me, 0) + frames["xon_tx"].get(me, 0)
            assert tx == frames["pause_rx"].get(peer, 0), me
            assert frames["xon_tx"].get(me, 0) <= frames["pause_tx"].get(me, 0), me
            sent += tx
    assert sent > 0
    assert frames["paused"] and not any(frames["paused"].values())
