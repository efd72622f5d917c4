"""rxe endpoints and the perftest kind, without a kernel: placement facts, the mode choice,
perftest argv, the perftest report parser and rxe's hw_counters on recorded files (recorded
in the Debian 6.1 guest: tests/unit/data/perftest/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.perftest.__main__ import perftest_argv
from agents.perftest.parse import PerftestOutputError, parse_report
from agents.timebase import Dilation
from testbed.config import ConfigError, load_config_text
from testbed.net.rxe import (
    INITIAL_NS,
    NETNS_AWARE,
    RxeRefused,
    choose_mode,
    kernel_release_netns_aware,
    placement_of,
    read_hw_counters,
    rxe_hosts,
    slave_name,
)
from testbed.plan import compile_plan
from testbed.run.requirements import missing_features, needed_features
from testbed.run.workload import expand_workload
from testbed.workloads.perftest import KIND, dilated_qp_timeout_exp, perftest_rows

DATA = Path(__file__).parent / "data"
FABRIC = """\
name: rxet
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
hosts: [{{name: h1, endpoint: rxe}}, {{name: h3, endpoint: rxe}}]
workload:
  traffic:
{traffic}
"""
BW = "    - {name: bw, kind: perftest, pairs: [[h1, h3]], size: 64KB, duration: 2ms}"


def _load(traffic: str = BW):
    loaded = load_config_text(FABRIC.format(traffic=traffic), "rxe.yaml")
    return loaded, compile_plan(loaded)


def _report(name: str) -> str:
    return (DATA / "perftest" / name).read_text()


# ---- placement ------------------------------------------------------------------------

def test_only_rxe_hosts_get_a_device_and_the_plan_says_which():
    _, plan = _load()
    assert [h.name for h in rxe_hosts(plan)] == ["h1", "h3"]
    assert '"endpoint": "rxe"' in plan.to_json()
    assert plan.node("h2").endpoint == "transport"


def test_initial_namespace_placement_names_a_slave_in_the_initial_namespace():
    _, plan = _load()
    p = placement_of(plan, "h1", INITIAL_NS, slot=3)
    assert p.device == "rxe_rxet_h1" and p.nic == "eth0" and p.host_netns == "tb-rxet-h1"
    assert p.netdev == slave_name("rxet", "h1") and len(p.netdev) <= 15
    assert p.netdev_netns is None and p.table == 4791003 and p.rule_pref == 1003
    assert p.address == plan.node("h1").interfaces[0].address.split("/")[0]
    q = placement_of(plan, "h1", NETNS_AWARE)
    assert q.netdev == "eth0" and q.netdev_netns == "tb-rxet-h1" and q.table == 0


def test_an_old_kernel_outside_the_vm_is_refused_naming_kernel_and_remedy():
    assert choose_mode(True, "7.1.0", {}) == NETNS_AWARE
    assert choose_mode(False, "6.1.0-57-amd64", {"TESTBED_VM": "1"}) == INITIAL_NS
    with pytest.raises(RxeRefused) as exc:
        choose_mode(False, "6.1.0-57-amd64", {})
    text = str(exc.value)
    assert "6.1.0-57-amd64" in text and "initial namespace" in text and "--vm" in text
    assert kernel_release_netns_aware("7.1.0") and not kernel_release_netns_aware("6.1.0")


def test_a_plan_with_rxe_hosts_needs_rdma_rxe_and_perftest():
    _, plan = _load()
    assert set(needed_features(plan)) == {"rdma_rxe", "perftest"}
    assert set(missing_features(plan, {"rdma_rxe": False, "perftest": True})) == {"rdma_rxe"}
    plain = compile_plan(load_config_text(FABRIC.format(traffic="    []").replace(
        "hosts: [{name: h1, endpoint: rxe}, {name: h3, endpoint: rxe}]\n", ""), "x.yaml"))
    assert needed_features(plain) == {}


# ---- the kind -------------------------------------------------------------------------

def test_perftest_between_a_host_without_rxe_is_a_config_error_naming_the_pair():
    with pytest.raises(ConfigError) as exc:
        _load("    - {name: bw, kind: perftest, pairs: [[h1, h2]], duration: 2ms}")
    assert "workload.traffic[0].pairs[0]: 'h2' has no rxe device" in "\n".join(
        exc.value.lines())


def test_duration_or_iterations_exactly_one():
    with pytest.raises(ConfigError) as exc:
        _load("    - {name: bw, kind: perftest, pairs: [[h1, h3]]}")
    assert "exactly one of duration: and iterations:" in "\n".join(exc.value.lines())


def test_expansion_server_on_dst_client_on_src_with_lossless_tos_and_devices():
    loaded, plan = _load()
    server, client = expand_workload(loaded.fabric, plan)
    assert (server.node, server.role, client.node, client.role) == ("h3", "receiver", "h1",
                                                                     "sender")
    # default class: the lossless roce class, DSCP 26 with ECT(0) = 106
    assert client.argv[client.argv.index("--tclass") + 1] == "106"
    assert client.argv[client.argv.index("--device") + 1] == "rxe_rxet_h1"
    assert server.argv[server.argv.index("--device") + 1] == "rxe_rxet_h3"
    assert client.argv[client.argv.index("--server") + 1] == plan.node(
        "h3").interfaces[0].address.split("/")[0]
    # 2 ms fabric at D=1000: perftest -D 2 (wall seconds)
    assert client.argv[client.argv.index("--duration-s") + 1] == "2"
    # both sides' QPs time out after 67 ms of fabric: 4.096 us x 2^24 wall at D=1000
    for spec in (client, server):
        assert spec.argv[spec.argv.index("--qp-timeout-exp") + 1] == "24"
    assert KIND.waits_ready(server) and not KIND.waits_ready(client)


def test_perftest_argv_matches_the_recorded_command_lines():
    assert perftest_argv("ib_write_bw", "rxe_h1", size_bytes=65536, qps=1, tclass=106,
                         gid_index=1, port=17000, duration_s=2, iterations=None,
                         server="10.0.0.3") == [
        "ib_write_bw", "-d", "rxe_h1", "-x", "1", "-F", "-s", "65536", "-p", "17000",
        "--tclass=106", "--report_gbits", "-q", "1", "-D", "2", "10.0.0.3"]
    lat = perftest_argv("ib_write_lat", "rxe_h2", size_bytes=64, qps=1, tclass=106,
                        gid_index=1, port=17001, duration_s=None, iterations=200, server=None)
    assert "--report_gbits" not in lat and lat[-2:] == ["-n", "200"]
    slow = perftest_argv("ib_write_bw", "rxe_h1", size_bytes=65536, qps=1, tclass=106,
                         gid_index=1, port=17000, duration_s=2, iterations=None,
                         server="10.0.0.3", qp_timeout_exp=24)
    assert slow[slow.index("-u") + 1] == "24"


def test_the_qp_timeout_is_dilated_to_67_ms_of_fabric():
    # 4.096 us x 2^14 = 67 ms at D = 1; at D = 1000 the wall timeout is 2^10 >= 1000 times it
    assert dilated_qp_timeout_exp(1) == 14
    assert dilated_qp_timeout_exp(1000) == 24
    assert dilated_qp_timeout_exp(1024) == 24 and dilated_qp_timeout_exp(1025) == 25
    for d in (1, 3, 100, 2000, 50_000):
        assert 4.096e-6 * 2 ** dilated_qp_timeout_exp(d) / d >= 4.096e-6 * 2 ** 14
    assert dilated_qp_timeout_exp(1e9) == 31          # the field's largest value


# ---- the parser on recorded outputs ---------------------------------------------------

def test_write_bw_report_parses_to_its_table_row():
    [row] = parse_report(_report("ib_write_bw_client.txt"))
    assert (row.bytes, row.iterations, row.bw_avg_gbps, row.msg_rate_mpps) == (
        65536, 304, 0.079632, 0.000152)
    assert row.t_avg_us is None
    # perftest's BW is the bytes it moved over the duration (2 s)
    assert row.bytes * row.iterations * 8 / 2 / 1e9 == pytest.approx(row.bw_avg_gbps, rel=2e-3)


def test_out_json_run_still_has_the_table_on_stdout():
    [row] = parse_report(_report("ib_write_bw_out_json_client.txt"))
    assert (row.iterations, row.bw_avg_gbps) == (180, 0.047139)


def test_write_lat_reports_parse_with_iterations_and_with_duration():
    [row] = parse_report(_report("ib_write_lat_client.txt"))
    assert (row.bytes, row.iterations, row.t_min_us, row.t_avg_us, row.t_p99_us,
            row.t_p999_us) == (64, 200, 88.24, 110.89, 343.36, 346.69)
    [row] = parse_report(_report("ib_write_lat_duration_client.txt"))
    assert (row.iterations, row.t_avg_us, row.tps) == (8210, 121.84, 4103.88)


@pytest.mark.parametrize("name, says", [("ib_write_bw_no_server.txt", "Couldn't connect"),
                                        ("ib_write_bw_bad_device.txt", "rxe_nope not found")])
def test_a_failed_run_is_an_error_quoting_perftest(name: str, says: str):
    with pytest.raises(PerftestOutputError) as exc:
        parse_report(_report(name))
    assert says in str(exc.value) and "no result table" in str(exc.value)


def test_empty_output_is_a_clear_error():
    with pytest.raises(PerftestOutputError, match="no output at all"):
        parse_report("")


def test_rows_are_fabric_units_in_declared_order():
    loaded, plan = _load()
    _, client = expand_workload(loaded.fabric, plan)
    res = {"rows": [r.as_dict() for r in parse_report(_report("ib_write_bw_client.txt"))],
           "netns": "initial"}
    [row] = perftest_rows(client, res, Dilation(1000))
    assert list(row) == list(KIND.result_fields)
    assert row["bw_gbps"] == pytest.approx(79.632)          # 0.079632 wall Gb/s x D=1000
    assert row["msg_rate_mpps"] == pytest.approx(0.152) and row["lat_avg_us"] is None
    assert (row["test"], row["src"], row["dst"], row["tos"]) == ("ib_write_bw", "h1", "h3", 106)


def test_send_bw_in_duration_mode_gets_its_rate_from_iterations():
    loaded, plan = _load("    - {name: s, kind: perftest, test: ib_send_bw, pairs: [[h1, h3]],"
                         " size: 64KB, duration: 2ms}")
    _, client = expand_workload(loaded.fabric, plan)
    res = {"rows": [r.as_dict() for r in parse_report(_report("ib_send_bw_client.txt"))]}
    [row] = perftest_rows(client, res, Dilation(1000))
    assert row["bw_gbps"] == pytest.approx(65536 * 118 * 8 / 2 / 1e9 * 1000)


def test_a_zero_bandwidth_for_done_messages_without_a_duration_is_empty_and_noted():
    loaded, plan = _load("    - {name: n, kind: perftest, test: ib_write_bw, pairs: [[h1, h3]],"
                         " size: 64KB, iterations: 100}")
    _, client = expand_workload(loaded.fabric, plan)
    starved = {"bytes": 64000, "iterations": 100, "bw_peak_gbps": 0.0, "bw_avg_gbps": 0.0,
               "msg_rate_mpps": 0.0}
    res = {"rc": 0, "rows": [starved]}
    [row] = perftest_rows(client, res, Dilation(1000))
    assert row["iterations"] == 100 and row["bw_gbps"] is None
    [note] = KIND.fidelity_notes([client], {client.name: res}, None)
    assert "completed 100 messages but reported 0 Gb/s" in note


def test_lat_rows_have_fabric_latency():
    loaded, plan = _load("    - {name: l, kind: perftest, test: ib_write_lat, pairs: [[h1, h3]],"
                         " size: 64, iterations: 200}")
    _, client = expand_workload(loaded.fabric, plan)
    res = {"rows": [r.as_dict() for r in parse_report(_report("ib_write_lat_client.txt"))]}
    [row] = perftest_rows(client, res, Dilation(1000))
    assert row["lat_avg_us"] == pytest.approx(0.11089) and row["bw_gbps"] is None


# ---- hw_counters ----------------------------------------------------------------------

def test_hw_counters_directory_parses_to_counters_without_lifespan():
    counters = read_hw_counters(DATA / "rxe_hw_counters")
    assert counters["sent_pkts"] == 100104 and counters["rcvd_pkts"] == 25207
    assert "lifespan" not in counters and len(counters) == 15
    assert list(counters) == sorted(counters)
    assert read_hw_counters(DATA / "no-such-dir") == {}


def test_placement_mode_refuses_before_building_on_an_old_kernel_outside_the_vm(monkeypatch):
    from testbed.net import rxe

    _, plan = _load()
    monkeypatch.setattr(rxe, "probe", lambda refresh=False: rxe.RxeProbe(
        (True, "ok"), (False, "initial namespace only"), (True, "ok")))
    with pytest.raises(RxeRefused, match="--vm"):
        rxe.placement_mode(plan, env={})
    assert rxe.placement_mode(plan, env={"TESTBED_VM": "1"}) == INITIAL_NS
    monkeypatch.setattr(rxe, "probe", lambda refresh=False: rxe.RxeProbe(
        (False, "not in this kernel"), (False, "-"), (False, "-")))
    with pytest.raises(RxeRefused, match="needs rdma_rxe"):
        rxe.placement_mode(plan, env={"TESTBED_VM": "1"})


def test_apply_plan_refuses_an_unplaceable_rxe_plan_before_recording_any_state(
        monkeypatch, tmp_path):
    from testbed.net import builder, rxe

    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "labs"))
    monkeypatch.delenv("TESTBED_VM", raising=False)
    monkeypatch.setattr(rxe, "probe", lambda refresh=False: rxe.RxeProbe(
        (True, "ok"), (False, "initial namespace only"), (True, "ok")))
    _, plan = _load()
    with pytest.raises(builder.BuildError, match="testbed run --vm"):
        builder.apply_plan(plan)
    assert not (tmp_path / "labs").exists()
