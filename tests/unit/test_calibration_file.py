"""The calibration file (testbed/run/calibration.py): format 2 with the capacity and a
derating per machine, format 1 files still read, runs teach the derating; and the fit of
`testbed calibrate`'s capacity trials (testbed/run/calibrate.py)."""

from __future__ import annotations

import json

import pytest

from testbed.plan.capacity import DEFAULT_CAPACITY
from testbed.run import calibration
from testbed.run.calibrate import ROUND, LoadTrial, fit_capacity
from testbed.run.calibration import (
    CalibrationError,
    capacity_from,
    load_budget_bps,
    load_capacity,
    record_run,
    save_budget,
)
from testbed.run.fidelity import PortWatchdog

V2 = {"format": 2, "max_wall_port_rate_bps": 500_000_000,
      "capacity": {"hop_pps_per_core": 300_000.0, "cores": 2,
                   "agents": {"udp": {"send_core_s": 5e-6, "recv_core_s": 6e-6},
                              "pfc": {"note": "event-driven"}}}}


@pytest.fixture
def cal(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("TESTBED_CALIBRATION", str(path))
    monkeypatch.setattr(calibration, "machine_name", lambda: "box1")
    return path


def test_a_format_1_file_still_gives_its_budget_and_the_default_capacity(cal):
    cal.write_text(json.dumps({"max_wall_port_rate_bps": 300_000_000, "hosts": 4}))
    assert load_budget_bps()[0] == 300_000_000
    cap = load_capacity()
    assert cap.hop_pps_per_core == DEFAULT_CAPACITY.hop_pps_per_core
    assert "default" in cap.source and "format 1" in cap.source


def test_a_format_2_file_gives_the_measured_capacity(cal):
    cal.write_text(json.dumps(V2))
    cap = load_capacity()
    assert cap.hop_pps_per_core == 300_000.0 and cap.cores == 2
    assert cap.agent("udp").recv_core_s == 6e-6
    assert cap.agent("roce") == DEFAULT_CAPACITY.agents["roce"]   # not measured: default
    assert str(cal) in cap.source
    assert load_budget_bps()[0] == 500_000_000


def test_no_file_is_the_default_said_so(cal):
    cap = load_capacity()
    assert cap.source.startswith("default (run `testbed calibrate`")
    assert cap.derating == 1.0


def test_a_newer_format_or_broken_file_is_refused_with_the_fix(cal):
    cal.write_text(json.dumps({"format": 3}))
    with pytest.raises(CalibrationError, match="format 3 is newer"):
        load_capacity()
    cal.write_text("{not json")
    with pytest.raises(CalibrationError, match="testbed calibrate"):
        load_capacity()
    cal.write_text(json.dumps({"format": 2, "capacity": {"cores": 2}}))
    with pytest.raises(CalibrationError, match="capacity"):
        load_capacity()


def test_a_slow_machine_without_calibration_scales_the_default_down():
    cap = capacity_from({}, None, "m", slowdown=20)   # type: ignore[arg-type]
    assert cap.hop_pps_per_core == DEFAULT_CAPACITY.hop_pps_per_core / 20
    assert "20x slower" in cap.source


def _dilation(factor=200, need=100, port=20, rate=20, streams=4, least=80.0) -> dict:
    return {"factor": factor, "capacity": {"need_factor": need, "port_factor": port,
                                           "rate_factor": rate, "streams": streams,
                                           "least_factor": least}}


BEHIND = ("port leaf2:swp4 delivered 60.0 % of its rate while backlogged (...): the "
          "machine did not keep up; raise D")


def test_a_run_that_fell_behind_derates_this_machine_and_the_next_plan_uses_it(cal):
    cal.write_text(json.dumps(V2))
    said = record_run({"fidelity": [BEHIND]}, _dilation())
    assert said is not None and "1 -> 0.5" in said
    data = json.loads(cal.read_text())
    assert data["derating"]["box1"]["scale"] == 0.5
    assert data["max_wall_port_rate_bps"] == 500_000_000     # the rest is kept
    cap = load_capacity()
    assert cap.derating == 0.5 and "derated to 0.5" in cap.derating_note


def test_another_machines_derating_does_not_apply_here(cal, monkeypatch):
    cal.write_text(json.dumps(V2))
    record_run({"fidelity": [BEHIND]}, _dilation())
    monkeypatch.setattr(calibration, "machine_name", lambda: "box2")
    assert load_capacity().derating == 1.0


def test_a_d_below_what_the_capacity_allows_teaches_nothing(cal):
    cal.write_text(json.dumps(V2))
    assert record_run({"fidelity": [BEHIND]}, _dilation(factor=50)) is None
    assert "derating" not in json.loads(cal.read_text())


def test_clean_runs_are_counted_and_other_notes_are_not_a_fall_behind(cal):
    cal.write_text(json.dumps(V2))
    record_run({"fidelity": ["link propagation and FEC delay are not emulated"]},
               _dilation())
    entry = json.loads(cal.read_text())["derating"]["box1"]
    assert entry["scale"] == 1.0 and entry["clean_runs"] == 1 and entry["runs"] == 1


def test_a_fall_behind_with_no_file_yet_starts_one(cal):
    record_run({"fidelity": [BEHIND]}, _dilation())
    assert load_capacity().derating == 0.5
    assert "default" in load_capacity().source


def test_a_new_capacity_measurement_supersedes_this_machines_derating_only(cal):
    cal.write_text(json.dumps({**V2, "derating": {"box1": {"scale": 0.25},
                                                  "box2": {"scale": 0.5}}}))
    save_budget({"capacity": V2["capacity"], "max_wall_port_rate_bps": 1})
    data = json.loads(cal.read_text())
    assert data["format"] == 2
    assert data["derating"] == {"box2": {"scale": 0.5}}


def test_the_watchdog_and_the_udp_senders_say_what_the_learning_looks_for():
    # The derating learns from notes carrying FELL_BEHIND_MARK: keep the wording in step.
    import inspect

    from testbed.workloads import udp

    assert calibration.FELL_BEHIND_MARK in inspect.getsource(PortWatchdog.notes)
    assert calibration.FELL_BEHIND_MARK in inspect.getsource(udp.UdpKind.fidelity_notes)


# --- the fit of the capacity trials ----------------------------------------------------

def _round(hop_s: float, udp_s: float, roce_s: float, base_cores: float = 0.2,
           packets: int = 20_000, window_s: float = 3.0) -> list[LoadTrial]:
    def t(name, hops, per_packet):
        busy = base_cores * window_s + packets * per_packet if per_packet else base_cores * 1
        return LoadTrial(name, hops, 100, packets if per_packet else 1,
                         window_s if per_packet else 1.0, busy)

    return [t(ROUND[0], 2, 0), t(ROUND[1], 2, udp_s + 2 * hop_s), t(ROUND[2], 8, 0),
            t(ROUND[3], 8, udp_s + 8 * hop_s),
            t(ROUND[4], 2, roce_s + 2 * hop_s * (1 + 1 / 16))]


def test_the_fit_separates_the_hop_from_the_agents():
    fit = fit_capacity(_round(3e-6, 40e-6, 60e-6), cores=2)
    assert fit.hop_core_s == pytest.approx(3e-6)
    assert fit.agent_core_s["udp"] == pytest.approx(40e-6)
    assert fit.agent_core_s["roce"] == pytest.approx(60e-6)
    assert not fit.notes


def test_the_fit_takes_the_median_round():
    trials = _round(3e-6, 40e-6, 60e-6) + _round(30e-6, 40e-6, 60e-6) + _round(
        3e-6, 40e-6, 60e-6)
    assert fit_capacity(trials, cores=2).hop_core_s == pytest.approx(3e-6)


def test_a_fit_that_cannot_tell_a_hop_takes_the_default_and_says_so():
    trials = _round(3e-6, 40e-6, 60e-6)
    trials[3] = trials[1].__class__(**{**vars(trials[1]), "name": ROUND[3], "hops": 8})
    fit = fit_capacity(trials, cores=2)
    assert fit.hop_core_s == pytest.approx(DEFAULT_CAPACITY.hop_core_s)
    assert any("too close to tell a hop" in n for n in fit.notes)
