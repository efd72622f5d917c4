"""The signature evaluator against a hand-made counter database: every stat, every
`across`, windows, globs, class names, `of: control`, `of: <metric>`, missing data and the
verdict's shape. The numbers below are worked out by hand from the samples in `_write`."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.incident.evaluate import (
    RunData,
    build_verdict,
    evaluate_predicate,
    evaluate_signature,
    open_run,
)
from testbed.incident.load import load_incident
from testbed.incident.model import Predicate
from testbed.results.files import write_json
from testbed.results.store import Sample, Store
from tests.conftest import REPO

MS = 1_000_000
# ts (fabric ns) -> {(node, port, tclass, counter): value}. t0 is 0; one sample before it.
SAMPLES: dict[int, dict[tuple[str, str, int, str], float]] = {
    -MS // 10: {("leaf1", "swp1", 3, "pause_rx"): 0, ("leaf1", "swp1", 3, "paused"): 0,
                ("leaf1", "swp1", 3, "backlog_bytes"): 0, ("leaf2", "swp2", 3, "pause_rx"): 0,
                ("spine1", "swp1", 3, "pause_rx"): 0, ("h4", "eth0", -1, "rx_bytes"): 0},
    0: {},
    1 * MS: {("leaf1", "swp1", 3, "pause_rx"): 10, ("leaf1", "swp1", 3, "paused"): 1,
             ("leaf1", "swp1", 3, "backlog_bytes"): 1000, ("h4", "eth0", -1, "rx_bytes"): 125_000},
    2 * MS: {("leaf1", "swp1", 3, "pause_rx"): 30, ("leaf1", "swp1", 3, "backlog_bytes"): 5000,
             ("h4", "eth0", -1, "rx_bytes"): 250_000},
    3 * MS: {("leaf1", "swp1", 3, "paused"): 0, ("leaf1", "swp1", 3, "backlog_bytes"): 2000,
             ("leaf2", "swp2", 3, "pause_rx"): 5, ("h4", "eth0", -1, "rx_bytes"): 375_000},
    4 * MS: {("leaf1", "swp1", 3, "pause_rx"): 50, ("leaf1", "swp1", 3, "backlog_bytes"): 0,
             ("h4", "eth0", -1, "rx_bytes"): 500_000},
}
CLASSES = {"roce": 3, "cnp": 6, "default": 0}


def _write(path: Path, victim_bps: float, incast_bps: tuple[float, float]) -> Store:
    store = Store(path, create=True)
    state: dict[tuple[str, str, int, str], float] = {}
    for i, (ts, changes) in enumerate(sorted(SAMPLES.items())):
        state.update(changes)
        store.add_samples(ts, 10**12 + ts * 1000, [Sample(*k, v) for k, v in state.items()],
                          final=i == len(SAMPLES) - 1)
    store.add_event(-MS // 20, 0, "phase", phase="workload", agents=4)
    for ts in (1.5 * MS, 1.6 * MS, 1.7 * MS):
        store.add_event(int(ts), 0, "pfc_xoff", node="leaf1", port="swp1", tclass=3, quanta=65535)
    store.add_event(int(3.5 * MS), 0, "pfc_xoff", node="leaf2", port="swp2", tclass=3)
    store.add_event(2 * MS, 0, "fault", node="leaf1", port="swp3", event_kind="link_down",
                    target="leaf1-spine1")
    store.add_result("incast", "udp_incast", {"src": "h1", "dst": "h4",
                                              "rx_fabric_bps": incast_bps[0]})
    store.add_result("incast", "udp_incast", {"src": "h2", "dst": "h4",
                                              "rx_fabric_bps": incast_bps[1]})
    store.add_result("victim", "udp_pairs", {"src": "h3", "dst": "h5",
                                             "rx_fabric_bps": victim_bps, "lost": 0})
    return store


SUMMARY = {"totals": {"drops": 7, "pause_frames": 55},
           "workloads": [{"name": "incast", "results": [{"src": "h1", "rx_fabric_bps": 4e10}]}],
           "invariants": {"lossless": {"held": True}}, "verdict": None}


@pytest.fixture
def run(tmp_path: Path):
    store = _write(tmp_path / "run.sqlite", 10e9, (40e9, 20e9))
    yield RunData(store, SUMMARY, CLASSES, "runs/x-incident")
    store.close()


@pytest.fixture
def control(tmp_path: Path):
    store = _write(tmp_path / "control.sqlite", 50e9, (30e9, 30e9))
    yield RunData(store, {**SUMMARY, "totals": {"drops": 0}}, CLASSES, "runs/x-control")
    store.close()


def _eval(spec: dict, run: RunData, control: RunData | None = None) -> dict:
    return evaluate_predicate(Predicate.model_validate({"name": "p", **spec}), run, control)


def _counter(run: RunData, op: str = ">", value: object = 0, **counter: object) -> dict:
    return _eval({"counter": counter, "op": op, "value": value}, run)


# ---- stats ------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "stat", "value", "unit"), [
    ("pause_rx", "delta", 50, ""),                 # 0 at t0 -> 50 at 4 ms
    ("pause_rx", "rate", 12_500, "/s"),            # 50 frames / 4 ms of fabric time
    ("rx_bytes", "rate_bps", 1.0, "Gb/s"),         # 500,000 B x 8 / 4 ms
    ("rx_bytes", "delta", 500_000, "B"),
    ("backlog_bytes", "max", 5000, "B"),
    ("backlog_bytes", "min", 0, "B"),
    ("backlog_bytes", "last", 0, "B"),
    ("backlog_bytes", "mean", 2000, "B"),          # (0 + 1000 + 5000 + 2000) / 4 per ms
    ("paused", "fraction_nonzero", 0.5, ""),       # paused from 1 ms to 3 ms of 0..4 ms
])
def test_every_stat_over_one_series(run: RunData, name: str, stat: str, value: float,
                                    unit: str) -> None:
    node = "h4" if name == "rx_bytes" else "leaf1"
    row = _counter(run, name=name, node=node, stat=stat, op=">=", value=0)
    assert (row["value"], row["unit"], row["held"]) == (value, unit, True), row


def test_a_window_is_fabric_time_after_t0(run: RunData) -> None:
    row = _counter(run, name="pause_rx", node="leaf1", window={"from": "1ms", "to": "3ms"})
    assert row["value"] == 20                      # 10 at 1 ms, 30 from 2 ms to 3 ms
    row = _counter(run, name="backlog_bytes", node="leaf1", stat="max",
                   window={"from": "2500us", "to": "end"})
    assert row["value"] == 5000                    # the value holding at 2.5 ms counts
    row = _counter(run, name="paused", node="leaf1", stat="fraction_nonzero",
                   window={"from": "start"})
    assert row["value"] == pytest.approx(2 / 4.1, rel=1e-3)


def test_a_series_that_appears_later_counts_from_zero(tmp_path: Path) -> None:
    store = Store(tmp_path / "late.sqlite", create=True)
    store.add_samples(-MS, 0, [Sample("h1", "eth0", -1, "rx_bytes", 0)])
    store.add_samples(0, 1, [Sample("h1", "eth0", -1, "rx_bytes", 0)])
    # the sender agent is first read 1 ms after t0, having already sent 1000 bytes
    store.add_samples(MS, 2, [Sample("h1", "eth0", -1, "rx_bytes", 0),
                              Sample("h1", "snd", -1, "send.bytes", 1000)])
    store.add_samples(2 * MS, 3, [Sample("h1", "eth0", -1, "rx_bytes", 0),
                                  Sample("h1", "snd", -1, "send.bytes", 3000)], final=True)
    data = RunData(store, {}, CLASSES)
    assert _counter(data, name="send.bytes")["value"] == 3000
    assert _counter(data, name="send.bytes", stat="rate_bps", op=">", value=0)["value"] == (
        3000 * 8 / 2e-3 / 1e9)
    assert _counter(data, name="send.bytes", window={"from": "1500us"})["value"] == 2000
    assert _counter(data, name="send.bytes", stat="last",
                    window={"from": "2ms", "to": "2ms"})["value"] == 3000
    store.close()


def test_rate_bps_refuses_a_counter_not_in_bytes(run: RunData) -> None:
    row = _counter(run, name="pause_rx", stat="rate_bps")
    assert row["held"] is None and "not in bytes" in row["detail"]


# ---- across and globs -------------------------------------------------------------------

@pytest.mark.parametrize(("across", "op", "value", "held", "shown"), [
    ("sum", ">", 55, 55, False),                   # 50 + 5 + 0; 55 > 55 does not hold
    ("max", ">=", 50, 50, True),
    ("min", "==", 0, 0, True),                     # spine1 never paused
    ("count", ">=", 2, 2, True),                   # series with a delta > 0
])
def test_across_combines_the_matching_series(run: RunData, across: str, op: str, value: float,
                                              held: float, shown: bool) -> None:
    row = _counter(run, name="pause_rx", node="*", across=across, op=op, value=value)
    assert row["value"] == held and row["held"] is shown, row


def test_across_all_holds_only_if_every_series_does_and_shows_the_one_that_fails(
        run: RunData) -> None:
    row = _counter(run, name="pause_rx", across="all", op=">", value=0)
    assert row["held"] is False and row["value"] == 0 and "spine1:swp1" in row["detail"]
    assert "2 of 3 series hold" in row["detail"]
    row = _counter(run, name="pause_rx", node="leaf*", across="all", op=">", value=0)
    assert row["held"] is True and row["value"] == 5     # the closest to failing: leaf2


def test_across_any_holds_if_one_series_does(run: RunData) -> None:
    row = _counter(run, name="pause_rx", across="any", op=">", value=40)
    assert row["held"] is True and row["value"] == 50 and "leaf1:swp1" in row["detail"]
    row = _counter(run, name="pause_rx", across="any", op=">", value=60)
    assert row["held"] is False


def test_count_takes_its_own_condition(run: RunData) -> None:
    row = _counter(run, name="pause_rx", across="count", each={"op": ">=", "value": 10},
                   op="==", value=1)
    assert row["value"] == 1 and row["held"] is True and row["unit"] == "series"


def test_node_and_port_globs_and_class_names_pick_series(run: RunData) -> None:
    assert _counter(run, name="pause_rx", node="leaf*")["value"] == 55
    assert _counter(run, name="pause_rx", node="*", port="swp2")["value"] == 5
    assert _counter(run, name="pause_rx", node="leaf?", tclass="roce")["value"] == 55
    assert _counter(run, name="pause_rx", tclass=3)["value"] == 55
    row = _counter(run, name="pause_rx", tclass="default")
    assert row["held"] is None and "no series of pause_rx" in row["detail"]


# ---- thresholds: quantities, of: control, of: metric ---------------------------------------

def test_a_threshold_may_be_a_quantity_in_the_metrics_unit(run: RunData) -> None:
    row = _counter(run, name="rx_bytes", node="h4", stat="rate_bps", op=">", value="500Mbps")
    assert (row["value"], row["threshold"], row["unit"], row["held"]) == (1.0, 0.5, "Gb/s", True)
    row = _counter(run, name="backlog_bytes", stat="max", op="<", value="4KB")
    assert row["threshold"] == 4000 and row["held"] is False


def test_of_control_scales_the_same_metric_of_the_control_run(run: RunData,
                                                              control: RunData) -> None:
    spec = {"result": {"workload": "victim", "field": "rx_fabric_bps"}, "op": "<",
            "value": 0.5, "of": "control"}
    row = _eval(spec, run, control)
    assert (row["value"], row["threshold"], row["unit"], row["held"]) == (10.0, 25.0, "Gb/s",
                                                                         True)
    assert "control" in row["detail"] and "50 Gb/s" in row["detail"]
    # the control run measured against itself (testbed incident run --control)
    assert _eval(spec, control, control)["held"] is False


def test_of_control_across_all_compares_each_series_with_itself_in_the_control(
        run: RunData, control: RunData) -> None:
    spec = {"counter": {"name": "pause_rx", "node": "leaf*", "across": "all"}, "op": "<=",
            "value": 1, "of": "control"}
    assert _eval(spec, run, control)["held"] is True       # same samples: equal per series


def test_of_metric_scales_another_metric_of_the_same_run(run: RunData) -> None:
    spec = {"result": {"workload": "victim", "field": "rx_fabric_bps"}, "op": "<",
            "value": 0.5, "of": {"result": {"workload": "incast", "field": "rx_fabric_bps"}}}
    row = _eval(spec, run)
    assert (row["value"], row["threshold"], row["held"]) == (10.0, 30.0, True)


def test_of_needs_a_plain_factor() -> None:
    with pytest.raises(ValueError, match="plain factor"):
        Predicate.model_validate({"name": "p", "summary": "totals.drops", "op": "<",
                                  "value": "1Gbps", "of": "control"})


# ---- results, summary, events ---------------------------------------------------------------

def test_result_rows_aggregate_with_where(run: RunData) -> None:
    def res(**r: object) -> float:
        return _eval({"result": {"field": "rx_fabric_bps", **r}, "op": ">", "value": 0},
                     run)["value"]
    assert res(workload="incast") == 60.0
    assert res(workload="incast", agg="max") == 40.0
    assert res(workload="incast", agg="mean") == 30.0
    assert res(workload="*", agg="min") == 10.0
    assert res(workload="incast", where={"src": "h2"}) == 20.0
    assert _eval({"result": {"workload": "incast", "field": "rx_fabric_bps", "agg": "count"},
                  "op": "==", "value": 2}, run)["held"] is True


def test_summary_paths_take_keys_indices_and_names(run: RunData) -> None:
    assert _eval({"summary": "totals.drops", "op": ">", "value": 0}, run)["value"] == 7
    row = _eval({"summary": "workloads.incast.results.0.rx_fabric_bps", "op": ">",
                 "value": "30Gbps"}, run)
    assert (row["value"], row["unit"], row["held"]) == (40.0, "Gb/s", True)
    assert _eval({"summary": "invariants.lossless.held", "op": "==", "value": 1},
                 run)["held"] is True


def test_events_are_counted_by_kind_place_window_and_detail(run: RunData) -> None:
    def count(**e: object) -> float:
        return _eval({"events": e, "op": ">=", "value": 0}, run)["value"]
    assert count(kind="pfc_xoff") == 4
    assert count(kind="pfc_xoff", node="leaf1") == 3
    assert count(kind="pfc_xoff", window={"from": "2ms"}) == 1
    assert count(kind="fault", detail_match={"event_kind": "link_down"}) == 1
    assert count(kind="fault", detail_match={"target": "leaf2-*"}) == 0


# ---- missing data ---------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "reason"), [
    ({"counter": {"name": "no_such_counter"}}, "no series of no_such_counter"),
    ({"result": {"workload": "absent", "field": "rx_fabric_bps"}}, "no result rows"),
    ({"result": {"workload": "victim", "field": "gbps"}}, "has a number in 'gbps'"),
    ({"summary": "totals.no_such"}, "summary.totals has no 'no_such'"),
    ({"summary": "verdict"}, "not a number"),
    ({"counter": {"name": "pause_rx", "window": {"from": "9ms"}}}, "holds no sample"),
])
def test_missing_data_is_held_null_with_a_reason(run: RunData, spec: dict, reason: str) -> None:
    row = _eval({**spec, "op": ">", "value": 0}, run)
    assert row["held"] is None and reason in row["detail"], row


def test_of_control_without_a_control_run_is_undecided(run: RunData) -> None:
    row = _eval({"summary": "totals.drops", "op": ">", "value": 1, "of": "control"}, run)
    assert row["held"] is None and "no control run" in row["detail"]
    assert row["value"] == 7


# ---- the verdict ----------------------------------------------------------------------------

def _sample_incident():
    return load_incident(REPO / "tests/incidents/sample.yaml")


def test_verdict_has_the_contracts_shape(run: RunData, control: RunData) -> None:
    loaded = _sample_incident()
    preds = [Predicate.model_validate({"name": "victim starved", "op": "<", "value": 0.5,
                                       "of": "control", "result": {
                                           "workload": "victim", "field": "rx_fabric_bps"}})]
    verdict = build_verdict(name="sample", incident=loaded.incident, variant="incident",
                            predicates=evaluate_signature(preds, run, control),
                            baseline_run="runs/x-control", allowed=["ecn-above-xoff"],
                            classes=CLASSES)
    assert {"incident", "variant", "title", "source", "description", "reproduced", "expected",
            "as_expected", "allowed", "baseline_run", "predicates", "evidence"} <= set(verdict)
    assert verdict["reproduced"] is verdict["expected"] is verdict["as_expected"] is True
    assert verdict["predicates"][0] == {
        "name": "victim starved", "text": "sum of rx_fabric_bps of victim < 0.5 x control",
        "value": 10.0, "threshold": 25.0, "op": "<", "unit": "Gb/s", "held": True,
        "detail": verdict["predicates"][0]["detail"]}
    assert verdict["evidence"] == {"counter": "tail_drops", "node": "leaf2", "port": "*",
                                   "tclass": 3, "caption": "the leaf's port to h4 drops"}


def test_a_control_where_the_signature_does_not_hold_is_as_expected(
        run: RunData, control: RunData) -> None:
    loaded = _sample_incident()
    preds = [Predicate.model_validate({"name": "drops", "summary": "totals.drops", "op": ">",
                                       "value": 0})]
    verdict = build_verdict(name="sample", incident=loaded.incident, variant="control",
                            predicates=evaluate_signature(preds, control, control),
                            baseline_run=None, allowed=[])
    assert (verdict["reproduced"], verdict["expected"], verdict["as_expected"]) == (
        False, False, True)
    assert "did not hold: drops" in verdict["reason"]


def test_missing_data_means_not_reproduced_and_not_as_expected_either_way(
        run: RunData) -> None:
    loaded = _sample_incident()
    preds = [Predicate.model_validate({"name": "gone", "counter": {"name": "nope"}, "op": ">",
                                       "value": 0})]
    for variant in ("incident", "control"):
        verdict = build_verdict(name="sample", incident=loaded.incident, variant=variant,
                                predicates=evaluate_signature(preds, run, None),
                                baseline_run=None, allowed=[])
        assert verdict["reproduced"] is False and verdict["as_expected"] is False
        assert verdict["reason"].startswith("not decided: no data for gone")


def test_open_run_reads_a_run_directory_with_its_class_names(tmp_path: Path) -> None:
    _write(tmp_path / "counters.sqlite", 1e9, (1e9, 1e9)).close()
    write_json(tmp_path / "summary.json", SUMMARY)
    write_json(tmp_path / "plan.json", {"traffic_classes": [{"name": "roce", "tc": 3}]})
    with open_run(tmp_path) as data:
        assert data.classes == {"roce": 3}
        assert _counter(data, name="pause_rx", tclass="roce")["value"] == 55
