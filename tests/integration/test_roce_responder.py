"""One RoCE responder process per receiving host, in a real run: a 3:1 RoCE incast on the
default fabric (h1, h2, h5 -> h8, DCQCN, PFC on) served by ONE agents.roce process on
h8 (testbed/workloads/roce.py `combine`, agents/roce/responder.py).

The run must keep one row per stream with its own client's and server's numbers, every
stream verified byte for byte, every invariant held (conservation and reordering judged
per stream from the responder's per-stream counters), and each stream's live receive
counters stored under the stream's own name, as one server per stream stored them.
"""

from __future__ import annotations

import json

import pytest

from testbed.config import load_config_text
from testbed.net.state import LabState
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import REPO, unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

WORKLOAD = """\
workload:
  drain: 100us
  traffic:
    - {name: inc, kind: roce_incast, senders: [h1, h2, h5], receiver: h8, duration: 400us}
"""
STREAMS = ["inc-h1-h8", "inc-h2-h8", "inc-h5-h8"]


@pytest.fixture(scope="module")
def incast(tmp_path_factory):
    text = (REPO / "configs" / "default.yaml").read_text().split("workload:")[0]
    lab = unique_lab("rresp")
    text = text.replace("name: default", f"name: {lab}").replace(
        "dilation: auto", "dilation: 2000") + "qos:\n  default:\n    pfc: {enabled: true}\n"
    loaded = load_config_text(text + WORKLOAD, "responder.yaml")
    seen: dict[str, list[str]] = {}

    def on_sample(phase: str, _totals, _t: float) -> None:
        if phase == "workload" and not seen:
            state = LabState.load(lab)
            if state is not None:
                for p in state.processes:
                    seen.setdefault(p.netns, []).append(p.name)

    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path_factory.mktemp("rresp"),
                                   say=lambda _m: None, on_sample=on_sample))
    summary = json.loads((result.run_dir / "summary.json").read_text())
    return result.run_dir, summary, seen


def _rows(summary) -> list[dict]:
    return [r for w in summary["workloads"] for r in w["results"]]


def test_one_responder_process_serves_every_stream_into_the_host(incast):
    run_dir, _summary, seen = incast
    h8 = [names for ns, names in seen.items() if ns.endswith("h8")]
    assert h8, seen
    roce_on_h8 = [n for n in h8[0] if not n.startswith("pfc-")]
    assert roce_on_h8 == ["roce-responder-h8"], seen
    res = json.loads((run_dir / "agents" / "roce-responder-h8.json").read_text())
    assert res["stream_count"] == 3 and len(res["endpoints"]) == 1
    assert set(res["streams"]) == {f"{s}-srv" for s in STREAMS}
    assert not list((run_dir / "agents").glob("*-srv.json"))


def test_rows_stay_one_per_stream_each_verified_with_its_own_numbers(incast):
    run_dir, summary, _seen = incast
    rows = _rows(summary)
    assert [(r["src"], r["dst"]) for r in rows] == [("h1", "h8"), ("h2", "h8"), ("h5", "h8")]
    res = json.loads((run_dir / "agents" / "roce-responder-h8.json").read_text())["streams"]
    for row, name in zip(rows, STREAMS, strict=True):
        assert row["verified"] is True and row["error"] is None, row
        assert row["bytes"] > 0 and row["tx_packets"] >= row["rx_packets"] > 0
        srv = res[f"{name}-srv"]
        # the row's receive side is this stream's own part of the responder's counters
        assert row["rx_packets"] == sum(q["responder"]["packets_received"]
                                        for q in srv["qps"].values())
        assert row["packet_path"] in ("fast", "python")


def test_every_invariant_held_per_stream(incast):
    _run_dir, summary, _seen = incast
    inv = summary["invariants"]
    assert inv["violations"] == [], inv["violations"]
    streams = {s["name"]: s for s in inv["streams"]}
    assert set(streams) >= set(STREAMS)
    assert all(streams[n]["received"] > 0 and streams[n]["complete"] for n in STREAMS)
    assert not [n for n in summary["fidelity"] if "RoCE server" in n]


def test_each_streams_receive_series_is_stored_under_its_own_name(incast):
    run_dir, _summary, _seen = incast
    store = Store(run_dir / "counters.sqlite")
    try:
        received = {k[1] for k in store.series("recv.bytes")}
    finally:
        store.close()
    assert received == {f"{s}-srv" for s in STREAMS}
