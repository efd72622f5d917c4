"""`kind: flows` in a config: validation, expansion into one agent per host with its
schedule, and the flow records, accounts and notes built from agent output shaped like
the real one (agents/flows/host.py). No root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.flows import __main__ as flows_main
from agents.flows.host import parse_schedule
from testbed.config import ConfigError, load_config_text
from testbed.plan import compile_plan
from testbed.plan.paths import base_round_trip_ns, host_address
from testbed.results.flows import fct_txt_line
from testbed.run.workload import expand_workload, run_view
from testbed.workloads.flows import (
    FLOWS_UDP_PORT,
    KIND,
    ideal_fct_ns,
    message_wire_bytes,
)

FABRIC = """\
name: flowswl
dilation: 2000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
{traffic}
"""

EXPLICIT = """\
    - name: a
      kind: flows
      time_offset: 2s
      fct_dport: 100
      flows:
        - {src: h1, dst: h4, size: 1MB, start: 10us}
        - {src: h2, dst: h4, size: 4KB, start: 5us}
        - {src: h4, dst: h1, size: 64KB, start: 20us}
    - name: b
      kind: flows
      incast:
        - {senders: [h1, h2, h3], receiver: h4, size: 100KB, period: 100us, bursts: 2}
"""


def _load(traffic: str):
    loaded = load_config_text(FABRIC.format(traffic=traffic), "flows.yaml")
    return loaded, compile_plan(loaded)


def _problems(traffic: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config_text(FABRIC.format(traffic=traffic), "flows.yaml")
    return exc.value.lines()


def _schedule(spec) -> dict:
    return json.loads(dict(spec.inputs)["schedule.json"])


def test_one_agent_per_host_with_its_flows_ids_unique_and_a_port_per_entry() -> None:
    loaded, plan = _load(EXPLICIT)
    specs = expand_workload(loaded.fabric, plan)
    assert [(s.traffic, s.node) for s in specs] == [
        ("a", "h1"), ("a", "h2"), ("a", "h4"), ("b", "h1"), ("b", "h2"), ("b", "h3"),
        ("b", "h4")]
    ids = [row[0] for s in specs for row in _schedule(s)["out"]]
    assert sorted(ids) == list(range(3 + 6))          # 3 explicit, 2 bursts of 3
    a_h4 = _schedule(specs[2])
    # entry a: in start order, h2's 4 KB flow (5 us) is flow 0
    assert a_h4["in"] == [[0, host_address(plan, "h2"), 4000],
                          [1, host_address(plan, "h1"), 1_000_000]]
    assert a_h4["out"][0][2] == FLOWS_UDP_PORT and a_h4["out"][0][6] == "h1"
    assert all(row[2] == FLOWS_UDP_PORT + 1 for s in specs[3:] for row in _schedule(s)["out"])
    assert a_h4["time_offset_ns"] == 2_000_000_000 and a_h4["fct_dport"] == 100
    # the agent reads its own schedule and argv
    for spec in specs:
        out, inc = parse_schedule(_schedule(spec))
        assert [f.start_ns for f in out] == sorted(f.start_ns for f in out)
        args = flows_main.build_parser().parse_args(
            [*spec.argv, "--schedule", "x.json"])
        assert args.bind == host_address(plan, spec.node)
        assert args.dilation == 2000 and args.cc == "dcqcn"


def test_bursts_start_together_every_period() -> None:
    loaded, plan = _load(EXPLICIT)
    specs = [s for s in expand_workload(loaded.fabric, plan) if s.traffic == "b"]
    starts = sorted(row[4] for s in specs for row in _schedule(s)["out"])
    assert starts == [0, 0, 0, 100_000, 100_000, 100_000]


def test_generated_flows_come_from_the_distribution_and_are_reproducible() -> None:
    traffic = """\
    - name: g
      kind: flows
      hosts: [h1, h2, h3]
      generate: {distribution: web_search, load: 0.3, duration: 2ms, seed: 5}
"""
    loaded, plan = _load(traffic)
    one = [_schedule(s) for s in expand_workload(loaded.fabric, plan)]
    two = [_schedule(s) for s in expand_workload(loaded.fabric, plan)]
    assert one == two
    senders = {row[6] for d in one for row in d["out"]} | {s.node for s in
                                                          expand_workload(loaded.fabric, plan)}
    assert senders <= {"h1", "h2", "h3"}
    assert sum(len(d["out"]) for d in one) >= 3


@pytest.mark.parametrize(("entry", "expected"), [
    ("{name: e, kind: flows}", "needs flows: (explicit), generate:"),
    ("{name: e, kind: flows, flows: [{src: h1, dst: h9, size: 1MB}]}", "unknown host 'h9'"),
    ("{name: e, kind: flows, flows: [{src: h1, dst: h1, size: 1MB}]}", "a flow from 'h1' to "
     "itself"),
    ("{name: e, kind: flows, incast: [{senders: [h1], receiver: h2, size: 1MB, bursts: 3}]}",
     "3 bursts need a period"),
    ("{name: e, kind: flows, incast: [{senders: [h2], receiver: h2, size: 1MB}]}",
     "is the burst's receiver too"),
    ("{name: e, kind: flows, generate: {distribution: web_serch, load: 0.3, duration: 1ms}}",
     "web_search"),
    ("{name: e, kind: flows, generate: {distribution: web_search, load: 1.5, duration: 1ms}}",
     "load"),
    ("{name: e, kind: flows, tclass: default, flows: [{src: h1, dst: h2, size: 1MB}]}",
     "does not mark ECN"),
])
def test_config_problems_name_the_field(entry: str, expected: str) -> None:
    lines = _problems(f"    - {entry}\n")
    assert any(expected in line for line in lines), lines


def _results(specs, done: dict[int, tuple[int, int]], *, socket_drops: int = 0,
             cnps: int = 0) -> dict:
    """Agent output: flows in `done` finished (posted, done), the rest never did."""
    out = {}
    for spec in specs:
        doc = _schedule(spec)
        sent = {k: [] for k in ("flow_id", "sport", "posted_ns", "done_ns", "packets",
                                "retransmissions", "timeouts", "cnps_received", "error")}
        for row in doc["out"]:
            fid, size = row[0], row[3]
            posted, fin = done.get(fid, (row[4] + 100, None))
            pk = -(-size // 4096)
            for k, v in (("flow_id", fid), ("sport", 49152 + fid), ("posted_ns", posted),
                         ("done_ns", fin), ("packets", pk), ("retransmissions", 0),
                         ("timeouts", 0), ("cnps_received", cnps),
                         ("error", None if fin is not None else "unfinished")):
                sent[k].append(v)
        received = {k: [] for k in ("flow_id", "first_ns", "done_ns", "packets",
                                    "ce_packets", "cnps_sent", "ooo_drops", "duplicates")}
        for row in doc["in"]:
            fid, size = row[0], row[2]
            pk = -(-size // 4096)
            short = 3 if socket_drops else 0
            for k, v in (("flow_id", fid), ("first_ns", 0), ("done_ns", 1), ("packets", pk
                                                                              - short),
                         ("ce_packets", 0), ("cnps_sent", 0), ("ooo_drops", short),
                         ("duplicates", 0)):
                received[k].append(v)
        out[spec.name] = {"role": "flows", "sent": sent, "received": received,
                          "rx_bytes": sum(row[2] for row in doc["in"]),
                          "flows_out": len(doc["out"]), "rx_socket_drops": socket_drops,
                          "cc": "dcqcn", "cc_preset": "hpcc-ns3-paper"}
    return out


def test_records_time_each_flow_from_its_post_to_its_last_ack(tmp_path: Path) -> None:
    loaded, plan = _load(EXPLICIT)
    specs = [s for s in expand_workload(loaded.fabric, plan) if s.traffic == "a"]
    view = run_view(plan, tmp_path, 0)
    # flow 0: h2 -> h4 4 KB, flow 1: h1 -> h4 1 MB (posted 2 us late); flow 2 never done
    results = _results(specs, {0: (5_000, 7_500), 1: (12_000, 100_000)})
    recs = KIND.flow_records(specs, results, view)
    assert [(r.flow_id, r.src, r.dst, r.size_bytes) for r in recs] == [
        (0, "h2", "h4", 4000), (1, "h1", "h4", 1_000_000), (2, "h4", "h1", 64_000)]
    r0, r1, r2 = recs
    assert r0.fct_ns == 2_500 and r1.fct_ns == 88_000 and r2.fct_ns is None
    assert r1.extra["posted_late_ns"] == 2_000
    rtt = base_round_trip_ns(plan, "h1", "h4")
    assert r1.ideal_fct_ns == ideal_fct_ns(1_000_000, 4096, 100 * 10**9, rtt)
    assert r1.ideal_fct_ns == rtt + -(-message_wire_bytes(1_000_000, 4096) * 8 * 10**9
                                      // (100 * 10**9))
    assert r1.slowdown == pytest.approx(max(1.0, 88_000 / r1.ideal_fct_ns))
    assert r2.slowdown is None
    # fct.txt shows HPCC's clock and the fct_dport label, flows.csv the real port
    assert r1.time_offset_ns == 2_000_000_000 and r1.dport == FLOWS_UDP_PORT
    fields = fct_txt_line(r1).split()
    assert fields[3] == "100" and fields[5] == str(2_000_000_000 + 10_000)
    rows = KIND.result_rows(specs, results, view)
    assert len(rows) == 1 and rows[0].fields["flows"] == 3
    assert rows[0].fields["finished"] == 2 and rows[0].fields["unfinished"] == 1
    # what the receivers took, which the run's delivered total sums
    assert rows[0].fields["rx_bytes"] == 1_000_000 + 4_000 + 64_000
    notes = KIND.fidelity_notes(specs, results, view)
    assert any("1 flows had not finished" in n for n in notes), notes


def test_a_receivers_socket_drops_explain_its_streams_gaps(tmp_path: Path) -> None:
    loaded, plan = _load(EXPLICIT)
    specs = [s for s in expand_workload(loaded.fabric, plan) if s.traffic == "b"]
    view = run_view(plan, tmp_path, 0)
    done = {i: (0, 50_000) for i in range(3, 9)}
    # each flow into h4 misses 3 packets: 6 per stream, all 18 dropped in h4's socket
    accounts = KIND.stream_accounts(specs, _results(specs, done, socket_drops=18), [], view)
    assert {a["name"] for a in accounts} == {"b-h1-h4", "b-h2-h4", "b-h3-h4"}
    assert [a["socket_drops"] for a in accounts] == [6, 6, 6]
    assert all(a["reordered"] == 0 and a["lost_counted"] for a in accounts)
    clean = KIND.stream_accounts(specs, _results(specs, done), [], view)
    assert all(a["socket_drops"] == 0 and a["sent"] == a["received"] for a in clean)
    # fewer drops than gaps: the rest stay unexplained (conservation will say so)
    short = KIND.stream_accounts(specs, _results(specs, done, socket_drops=12), [], view)
    assert [a["socket_drops"] for a in short] == [6, 6, 0]
    assert short[2]["reordered"] == 6 and not short[2]["lost_counted"]
    notes = KIND.fidelity_notes(specs, _results(specs, done, socket_drops=12), view)
    assert any("receive socket dropped 12 datagrams" in n for n in notes), notes


def test_an_agent_below_line_rate_with_nothing_slowing_it_is_named(tmp_path: Path) -> None:
    traffic = "    - {name: big, kind: flows, flows: [{src: h1, dst: h4, size: 10MB}]}\n"
    loaded, plan = _load(traffic)
    specs = expand_workload(loaded.fabric, plan)
    view = run_view(plan, tmp_path, 0)
    ideal = ideal_fct_ns(10_000_000, 4096, 100 * 10**9, base_round_trip_ns(plan, "h1", "h4"))
    slow = _results(specs, {0: (0, 3 * ideal)})
    assert any("% of its line rate" in n for n in KIND.fidelity_notes(specs, slow, view))
    fine = _results(specs, {0: (0, ideal)})
    assert not any("% of its line rate" in n for n in KIND.fidelity_notes(specs, fine, view))
    # a CNP (or a pause) is the fabric slowing it: not the agent
    cut = _results(specs, {0: (0, 3 * ideal)}, cnps=5)
    assert not any("% of its line rate" in n for n in KIND.fidelity_notes(specs, cut, view))
    fast = _results(specs, {0: (0, ideal // 2)})
    assert any("faster than their ideal" in n for n in KIND.fidelity_notes(specs, fast, view))


def test_a_window_too_short_for_the_distribution_is_named(tmp_path: Path) -> None:
    """1 ms of web search at 0.3 holds ~2 mean flows per host: holding the load exactly
    fills it with small flows, and the notes say the sizes left the CDF."""
    short = "    - {name: g, kind: flows, generate: {distribution: web_search, load: 0.3, " \
            "duration: 1ms}}\n"
    loaded, plan = _load(short)
    specs = expand_workload(loaded.fabric, plan)
    gen = _schedule(specs[0])["generated"]
    assert gen["expected_flows"] < 20 and gen["flows"] > gen["expected_flows"]
    notes = KIND.fidelity_notes(specs, _results(specs, {}), run_view(plan, tmp_path, 0))
    assert any("depart from web_search's CDF" in n for n in notes) == (gen["ks"] >
                                                                       gen["ks_bound"])
    assert gen["ks"] > gen["ks_bound"]


def test_cc_params_are_checked_against_the_entrys_senders_as_for_roce() -> None:
    lines = _problems("    - {name: e, kind: flows, flows: [{src: h1, dst: h2, size: 1MB}],\n"
                      "       cnp_interval: 50us, cc_params: {min_rate: 200Gbps, "
                      "cnp_interval: 4us}}\n")
    assert any("cnp_interval is given twice" in line for line in lines), lines
    assert any("above the line rate of sender h1" in line for line in lines), lines


def test_generate_takes_its_host_set_there_or_on_the_entry_not_both() -> None:
    inner = "    - {name: g, kind: flows, generate: {distribution: hadoop, load: 0.3, " \
            "duration: 200us, hosts: [h1, h2]}}\n"
    loaded, plan = _load(inner)
    assert {s.node for s in expand_workload(loaded.fabric, plan)} <= {"h1", "h2"}
    both = "    - {name: g, kind: flows, hosts: [h1, h2], generate: {distribution: hadoop, " \
           "load: 0.3, duration: 200us, hosts: [h1, h9]}}\n"
    lines = _problems(both)
    assert any("hosts is given twice" in line for line in lines), lines
    assert any("unknown host 'h9'" in line for line in lines), lines


def test_a_late_post_names_blocked_sends_when_the_agent_counted_them(tmp_path: Path) -> None:
    loaded, plan = _load(EXPLICIT)
    specs = [s for s in expand_workload(loaded.fabric, plan) if s.traffic == "a"]
    view = run_view(plan, tmp_path, 0)
    # flow 1 (h1 -> h4, due at 10 us) posted 30 us late
    results = _results(specs, {0: (5_000, 7_500), 1: (40_000, 130_000), 2: (20_000, 30_000)})
    late = [n for n in KIND.fidelity_notes(specs, results, view) if "posted more than" in n]
    assert len(late) == 1 and "a-h1" in late[0] and "at most 30.0 us" in late[0]
    assert "short of CPU" in late[0] and "blocked" not in late[0]
    results["a-h1"]["tx_sockets"] = {"send_eagain": 3}
    late = [n for n in KIND.fidelity_notes(specs, results, view) if "posted more than" in n]
    assert "3 of its sends waited out the send timeout" in late[0]


UET_FABRIC = FABRIC.replace("workload:", """traffic_classes:
  - {{tc: 2, name: uet, dscp: [10], ecn: true}}
  - {{tc: 4, name: plain, dscp: [12]}}
  - {{tc: 6, name: cnp, dscp: [48], strict: true}}
  - {{tc: 0, name: default, default: true}}
workload:""")


def _uet_problems(traffic: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config_text(UET_FABRIC.format(traffic=traffic), "flows.yaml")
    return exc.value.lines()


def test_a_uet_flows_entry_runs_one_uet_nic_per_host_on_its_class() -> None:
    loaded = load_config_text(UET_FABRIC.format(traffic="""\
    - name: u
      kind: flows
      transport: uet
      tclass: uet
      entropies: 32
      flows:
        - {src: h1, dst: h4, size: 1MB, start: 10us}
        - {src: h2, dst: h4, size: 4KB, start: 5us}
"""), "flows.yaml")
    entry = loaded.fabric.workload.traffic[0]
    assert entry.cc == "nscc"                  # the default follows the transport
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    assert sorted(s.node for s in specs) == ["h1", "h2", "h4"]
    h1 = next(s for s in specs if s.node == "h1")
    argv = h1.argv
    assert argv[argv.index("--transport") + 1] == "uet"
    assert argv[argv.index("--uet-cc") + 1] == "nscc"
    assert argv[argv.index("--entropy") + 1] == "spray"
    assert argv[argv.index("--entropies") + 1] == "32"
    assert argv[argv.index("--dscp") + 1] == "10"
    assert argv[argv.index("--payload-bytes") + 1] == "4096"
    # NSCC's base RTT is the plan's empty-queue round trip to the host's peer
    assert float(argv[argv.index("--base-rtt-ns") + 1]) == base_round_trip_ns(plan, "h1", "h4")
    parsed = flows_main.build_parser().parse_args(argv + ["--schedule", "x"])
    assert (parsed.transport, parsed.uet_cc, parsed.entropies) == ("uet", "nscc", 32)
    assert _schedule(h1)["out"][0][1:4] == [host_address(plan, "h4"), FLOWS_UDP_PORT,
                                           1_000_000]


@pytest.mark.parametrize(("entry", "expected"), [
    ("{name: e, kind: flows, transport: uet, flows: [{src: h1, dst: h2, size: 1MB}]}",
     "transport: uet needs its traffic class named"),
    ("{name: e, kind: flows, transport: uet, tclass: uet, cc: dcqcn, "
     "flows: [{src: h1, dst: h2, size: 1MB}]}", "cc dcqcn is RoCE's"),
    ("{name: e, kind: flows, cc: nscc, flows: [{src: h1, dst: h2, size: 1MB}]}",
     "cc nscc is Ultra Ethernet's"),
    ("{name: e, kind: flows, entropy: spray, flows: [{src: h1, dst: h2, size: 1MB}]}",
     "entropy is for transport: uet"),
    ("{name: e, kind: flows, transport: uet, tclass: uet, cc_preset: hpcc-ns3, "
     "flows: [{src: h1, dst: h2, size: 1MB}]}", "cc_preset is RoCE's"),
    ("{name: e, kind: flows, transport: uet, tclass: plain, "
     "flows: [{src: h1, dst: h2, size: 1MB}]}", "NSCC never sees a marked ACK"),
])
def test_uet_flows_problems_name_the_field(entry: str, expected: str) -> None:
    lines = _uet_problems(f"    - {entry}\n")
    assert any(expected in line for line in lines), lines


def test_credit_needs_no_ecn_class_but_two_uet_entries_on_one_host_are_refused() -> None:
    load_config_text(UET_FABRIC.format(traffic="""\
    - {name: c, kind: flows, transport: uet, tclass: plain, cc: credit,
       flows: [{src: h1, dst: h2, size: 1MB}]}
"""), "flows.yaml")
    lines = _uet_problems("""\
    - {name: a, kind: flows, transport: uet, tclass: uet, flows: [{src: h1, dst: h2, size: 1MB}]}
    - {name: b, kind: flows, transport: uet, tclass: uet, flows: [{src: h3, dst: h2, size: 1MB}]}
""")
    assert any("workload.traffic[1]" in line and "on h2 binds udp 4793" in line
               and "entry 'a'" in line for line in lines), lines
    assert not any("on h1" in line or "on h3" in line for line in lines), lines
