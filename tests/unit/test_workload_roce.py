"""RoCE traffic in a config: validation, expansion into server/client agents, results.

No root: configs are loaded and compiled, argv is parsed by the agent's own
parser, and result rows are built from agent output shaped like the real one.
"""

from __future__ import annotations

import os
import time
from fractions import Fraction as Fr

import pytest

from agents.rdma.cc import DCQCN_TUNABLE, DCTCP_PRESETS, DCTCP_TUNABLE, PRESETS
from agents.rdma.options import cc_params, cc_settings, make_np
from agents.roce import __main__ as roce_main
from agents.roce.perftest import flat_counters
from testbed.config import ConfigError, load_config_text
from testbed.plan import compile_plan
from testbed.plan.paths import Routes, host_address, longest_round_trip_ns
from testbed.results.store import Store
from testbed.run.workload import expand_workload, ready_file, run_view, workload_span_ns
from testbed.workloads.rdma import CC_PRESET_NAMES, roce_window_packets
from testbed.workloads.rdma_params import DcqcnCcParams, DctcpCcParams, cc_param_keys
from testbed.workloads.roce import KIND as ROCE
from testbed.workloads.roce import (
    ROCE_MAX_STREAMS_PER_HOST,
    ROCE_SETUP_PORT,
    ROCE_UDP_PORT,
    RoceTraffic,
    is_responder,
    responder_streams,
    roce_udp_port,
)
from testbed.workloads.udp import UdpTraffic
from tests.conftest import REPO

FABRIC = """\
name: rocewl
dilation: 2000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
{traffic}
"""


def _load(traffic: str):
    loaded = load_config_text(FABRIC.format(traffic=traffic), "roce.yaml")
    return loaded, compile_plan(loaded)


def _problems(traffic: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config_text(FABRIC.format(traffic=traffic), "roce.yaml")
    return exc.value.lines()


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _stream_argv(responder, k: int = 0) -> list[str]:
    """Stream k of a host's responder as a one-stream server's argv (its options, then
    the process's)."""
    return ["server", *responder_streams(responder)[k]["argv"], *responder.argv[1:]]


def _argv(spec) -> list[str]:
    """What one agent of the spec parses: a responder's first stream as a server's."""
    return _stream_argv(spec) if is_responder(spec) else spec.argv


def _responder_results(specs, results: dict) -> dict:
    """`results` with each stream's server result (keyed <client>-srv) moved where a
    host's responder writes it: under `streams` in the responder's JSON."""
    out = dict(results)
    for s in specs:
        if is_responder(s):
            out[s.name] = {"streams": {st["name"]: out.pop(st["name"])
                                       for st in responder_streams(s) if st["name"] in out}}
    return out


INCAST = "    - {name: inc, kind: roce_incast, senders: [h1, h2, h5], receiver: h8, duration: 1ms}"


def test_roce_entry_defaults():
    loaded, _ = _load(INCAST)
    (t,) = loaded.fabric.workload.traffic
    assert isinstance(t, RoceTraffic)
    assert (t.test, t.size_bytes, t.qps, t.cc, t.cc_preset, t.tclass, t.verify) == (
        "write_bw", 65536, 1, "dcqcn", None, "roce", True)
    assert t.preset == "hpcc-ns3-paper"     # HPCC run.py's dcqcn_paper: the default's timers
    assert t.start_ns == 0 and t.duration_ns == 1_000_000


def test_udp_and_roce_entries_live_side_by_side():
    loaded, plan = _load(INCAST + "\n    - {name: bg, kind: udp_pairs, pairs: [[h3, h4]], "
                                  "duration: 2ms, start: 100us}")
    kinds = [type(t) for t in loaded.fabric.workload.traffic]
    assert kinds == [RoceTraffic, UdpTraffic]
    specs = expand_workload(loaded.fabric, plan)
    assert {s.module for s in specs} == {"agents.roce", "agents.udp"}
    assert workload_span_ns(loaded.fabric) == 2_100_000


def test_incast_expands_to_one_responder_on_the_receiving_host_serving_every_stream():
    loaded, plan = _load(INCAST)
    specs = expand_workload(loaded.fabric, plan)
    servers = [s for s in specs if s.role == "receiver"]
    clients = [s for s in specs if s.role == "sender"]
    # the responder comes first so it listens before the clients set up
    assert specs == servers + clients
    (responder,) = servers
    assert (responder.name, responder.node, responder.dst) == ("roce-responder-h8", "h8", "h8")
    streams = responder_streams(responder)
    assert [st["name"] for st in streams] == ["inc-h1-h8-srv", "inc-h2-h8-srv", "inc-h5-h8-srv"]
    assert [s.name for s in clients] == ["inc-h1-h8", "inc-h2-h8", "inc-h5-h8"]
    assert [s.node for s in clients] == ["h1", "h2", "h5"]
    # one set-up port; every stream on RoCEv2's UDP port, one socket
    assert int(_opt(responder.argv, "--port")) == ROCE_SETUP_PORT
    assert [int(_opt(st["argv"], "--roce-port")) for st in streams] == [ROCE_UDP_PORT] * 3
    h8 = plan.node("h8").interfaces[0].address.split("/")[0]
    assert _opt(responder.argv, "--bind") == h8
    parser = roce_main.build_parser()
    for k, (st, client) in enumerate(zip(streams, clients, strict=True)):
        assert client.module == responder.module == "agents.roce"
        assert _opt(client.argv, "--server") == h8
        assert _opt(client.argv, "--port") == str(ROCE_SETUP_PORT)
        assert _opt(client.argv, "--stream") == st["name"]
        assert _opt(client.argv, "--bind") == plan.node(client.src).interfaces[0].address.split(
            "/")[0]
        assert (client.src, client.dst) == (client.node, "h8")
        # each stream takes set-up connections from its own client only
        assert _opt(st["argv"], "--peer-subnet") == _opt(client.argv, "--bind") + "/32"
        assert parser.parse_args(_stream_argv(responder, k)).test == "write_bw"


def test_argv_carries_the_config_in_fabric_units_and_parses():
    loaded, plan = _load("    - {name: w, kind: roce_pairs, pairs: [[h1, h6]], duration: 500us, "
                         "start: 20us, size: 1MB, qps: 2, test: send_bw, cc: dcqcn, "
                         "cc_preset: paper, cnp_interval: 80us, verify: false}")
    server, client = expand_workload(loaded.fabric, plan)
    parser = roce_main.build_parser()
    c = parser.parse_args(client.argv)
    s = parser.parse_args(_argv(server))
    assert (c.role, c.test, s.role, s.test) == ("client", "send_bw", "server", "send_bw")
    assert c.size == 1_000_000 and c.qps == 2 and c.duration_ns == 500_000
    assert c.cc == s.cc == "dcqcn" and c.cc_preset == s.cc_preset == "paper"
    assert s.cnp_interval_ns == 80_000 and c.cnp_interval_ns is None
    assert c.verify is False and s.verify is False
    assert c.dilation == s.dilation == 2000
    assert c.line_rate_bps == s.line_rate_bps == 100e9        # the hosts' NIC rate, fabric
    assert c.mtu == s.mtu == 4096
    assert c.dscp == s.dscp == 26 and c.cnp_dscp == s.cnp_dscp == 48
    assert c.spin_ns == s.spin_ns == 0
    assert c.tx_depth >= 2 and c.buffer_bytes >= c.size
    assert client.start_ns == 20_000 and client.duration_ns == 500_000
    # the runner adds these; the parser must take them
    parser.parse_args(client.argv + ["--control-sock", "/tmp/x.sock", "--ready-file",
                                     "/tmp/x.ready", "--start-at-mono-ns", "1"])


def test_messages_post_exactly_n_per_qp_and_the_span_is_the_busiest_host_at_line_rate():
    # 7 senders each write one 1 MB message to h8 at t = 0 (an FCT run)
    loaded, plan = _load("    - {name: fct, kind: roce_incast, senders: [h1, h2, h3, h4, h5, h6, "
                         "h7], receiver: h8, size: 1MB, messages: 1}\n"
                         "    - {name: two, kind: roce_pairs, pairs: [[h1, h2]], messages: 3, "
                         "qps: 2, size: 4096, start: 10us}")
    t = loaded.fabric.workload.traffic[0]
    assert (t.messages, t.duration_ns) == (1, None)
    parser = roce_main.build_parser()
    clients = [s for s in expand_workload(loaded.fabric, plan) if s.role == "sender"]
    for spec in clients:
        assert "--duration-ns" not in spec.argv and spec.duration_ns == 0
        c = parser.parse_args(spec.argv)
        assert (c.iters, c.duration_ns) == ((1, None) if spec.traffic == "fct" else (3, None))
    # h8 receives 7 x 1 MB: 245 packets of 4096 B each (the last 576 B), each with BTH 12 +
    # ICRC 4 + 66 B of UDP/IP/Ethernet, and one RETH of 16: 1 000 000 + 245 x 82 + 16 =
    # 1 020 106 B; 7 x that = 7 140 742 B at 100 Gb/s = 571 259.36 ns -> 571 260 ns.
    # `two`: h1 sends 2 QPs x 3 x (4096 + 82 + 16) B = 25 164 B from 10 us: 10 us + 2013.12 ns.
    assert workload_span_ns(loaded.fabric, plan) == 571_260
    assert workload_span_ns(loaded.fabric) == 10_000        # without a plan: starts only


def test_duration_or_messages_exactly_one():
    both = _problems("    - {name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, "
                     "messages: 4}")
    assert both == ["roce.yaml:12: workload.traffic[0].messages: duration and messages are both "
                    "given; give one: duration posts messages for that long, messages exactly "
                    "that many per QP"]
    neither = _problems("    - {name: x, kind: roce_pairs, pairs: [[h1, h2]]}")
    assert neither == ["roce.yaml:12: workload.traffic[0]: roce_pairs needs duration: (post "
                       "messages for that long) or messages: (post exactly that many per QP)"]
    zero = _problems("    - {name: x, kind: roce_pairs, pairs: [[h1, h2]], messages: 0}")
    assert zero == ["roce.yaml:12: workload.traffic[0].messages: 0 is too small; use a value "
                    ">= 1"]


def test_cc_none_passes_no_preset_and_verify_is_asked_by_both_sides():
    loaded, plan = _load("    - {name: n, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, "
                         "cc: none}")
    server, client = expand_workload(loaded.fabric, plan)
    for argv in (_argv(server), client.argv):
        assert _opt(argv, "--cc") == "none"
        assert "--cc-preset" not in argv and "--cnp-interval-ns" not in argv
        assert "--verify" in argv


def test_one_responder_per_host_serves_every_entrys_streams_a_socket_per_dscp():
    loaded, plan = _load(
        "    - {name: a, kind: roce_pairs, pairs: [[h1, h8], [h2, h3]], duration: 1ms}\n"
        "    - {name: b, kind: roce_all_to_all, hosts: [h3, h8], duration: 1ms}\n"
        "    - {name: c, kind: roce_pairs, pairs: [[h4, h8]], duration: 1ms, tclass: default, "
        "cc: none}")
    specs = expand_workload(loaded.fabric, plan)
    ports = {s.node: [(st["name"], int(_opt(st["argv"], "--roce-port")))
                      for st in responder_streams(s)] for s in specs if s.role == "receiver"}
    # a stream of another class (another DSCP) gets the host's next socket
    assert ports == {"h8": [("a-h1-h8-srv", 4791), ("b-h3-h8-srv", 4791),
                            ("c-h4-h8-srv", 4792)],
                     "h3": [("a-h2-h3-srv", 4791), ("b-h8-h3-srv", 4791)]}
    # the responders stand where their first stream's server would have (entry a's)
    assert [s.name for s in specs][:2] == ["roce-responder-h8", "roce-responder-h3"]
    clients = [s for s in specs if s.role == "sender" and s.traffic != "c"]
    assert [(s.src, s.dst) for s in clients] == [("h1", "h8"), ("h2", "h3"), ("h3", "h8"),
                                                  ("h8", "h3")]


def test_roce_ports_stay_below_the_udp_agents_ports():
    assert roce_udp_port(0) == 4791
    assert roce_udp_port(ROCE_MAX_STREAMS_PER_HOST - 1) < 6400      # the flows kind's first
    with pytest.raises(ValueError):
        roce_udp_port(20000 - 18515)


def test_roce_servers_skip_ultra_ethernets_port_4793():
    udp = [roce_udp_port(n) for n in range(ROCE_MAX_STREAMS_PER_HOST)]
    assert udp[:3] == [4791, 4792, 4794]
    assert 4793 not in udp and len(set(udp)) == len(udp)
    claimed = [p for r in ROCE.ports["udp"] for p in r]
    assert sorted(udp) == claimed


def test_preset_names_are_the_agents_and_match_their_kind():
    assert set(CC_PRESET_NAMES) == set(PRESETS) | set(DCTCP_PRESETS)
    for name in CC_PRESET_NAMES:       # every preset the agents have is a config value
        cc = "dcqcn" if name in PRESETS else "dctcp"
        loaded, _ = _load(f"    - {{name: x, kind: roce_pairs, pairs: [[h1, h2]], "
                          f"duration: 1ms, cc: {cc}, cc_preset: {name}}}")
        assert loaded.fabric.workload.traffic[0].preset == name
    assert any("cc_preset: must be 'paper', " in p and "did you mean 'hpcc-ns3'?" in p
               for p in _problems("    - {name: x, kind: roce_pairs, pairs: [[h1, h2]], "
                                  "duration: 1ms, cc_preset: hpcc}"))


# --- the in-flight window --------------------------------------------------------------

def _default_fabric_with(traffic: str):
    """configs/default.yaml with its workload replaced by `traffic` (one YAML list line),
    D pinned at 2000 (auto would take D from the machine's capacity and the workload)."""
    text = (REPO / "configs" / "default.yaml").read_text(encoding="utf-8").replace(
        "dilation: auto", "dilation: 2000")
    text = text[:text.index("workload:")] + f"workload:\n  traffic:\n{traffic}\n"
    loaded = load_config_text(text, "default.yaml")
    return loaded, compile_plan(loaded)


def test_auto_window_on_the_default_fabric_is_652_packets():
    loaded, plan = _default_fabric_with(
        "    - {name: inc, kind: roce_incast, senders: [h1, h5], receiver: h8, duration: 1ms}")
    # Longest host-to-host path: h1 -> leaf1 -> spine -> leaf2 -> h8 (either spine), four
    # egress ports: h1 eth0 (100G), leaf1 uplink (400G), spine downlink (400G), leaf2 swp4
    # (100G). Links: 2 m 100GBASE-CR1 120 ns, 100 m 400GBASE-DR4 600 ns one way.
    # Base RTT = 2 (120 + 600 + 600 + 120) = 2880 ns.
    # TC3 (roce, lossless) on every port: XOFF 1 MB (half the 2 MB buffer) + headroom
    # (2 x 9038 B frames + 2 x delay x rate + the response: the emulated PFC loop's 2 ms of
    # wall time at D = 2000 = 1 us, longer than 802.1Qbb's 3840 B): 100G 18 076 + 3 000 +
    # 12 500 = 33 576 B, 400G 18 076 + 60 000 + 50 000 = 128 076 B.
    # Drain: 100G 1 033 576 B x 8 / 100 Gb/s = 82 686.08 ns, 400G 1 128 076 B x 8 / 400 Gb/s
    # = 22 561.52 ns; twice each: 210 495.2 ns. Round trip 213 375.2 ns.
    # At h1's 100 Gb/s: 100e9 x 213 375.2e-9 / 8 = 2 667 190 B = 651.2 packets of 4096 B.
    assert {tuple(i.ifname for i in p) for p in egress_paths(plan, "h1", "h8")} == {
        ("eth0", "swp5", "swp2", "swp4"), ("eth0", "swp6", "swp2", "swp4")}
    assert longest_round_trip_ns(plan, 3) == Fr("213375.2")
    assert roce_window_packets(100 * 10**9, longest_round_trip_ns(plan, 3), 4096) == 652
    parser = roce_main.build_parser()
    for spec in expand_workload(loaded.fabric, plan):
        args = parser.parse_args(_argv(spec))
        assert args.window_packets == 652, spec.name
        if spec.role == "sender":   # a full window posted, and one 64 KiB message more
            assert args.tx_depth == 652 // 16 + 1 + 1 == 42


def egress_paths(plan, src: str, dst: str) -> list:
    """Every path the plan's routes can take from host `src` to host `dst`, each as the
    egress ports on the way (the sender's NIC first); ECMP next hops branch. The brute
    force longest_round_trip_ns's memoised walk is checked against."""
    routes = Routes(plan)
    address = host_address(plan, dst)
    paths: list = []

    def walk(node: str, path: list, seen: set[str]) -> None:
        for iface in routes.egress_toward(node, address):
            nxt = iface.peer.node
            if nxt == dst:
                paths.append(path + [iface])
            elif nxt not in seen and routes.nodes[nxt].role == "switch":  # hosts don't forward
                walk(nxt, path + [iface], seen | {nxt})

    walk(src, [], {src})
    return paths


def _brute_port_ns(plan, iface, tc: int = 3) -> Fr:
    """An egress port's term of the round trip, spelt out: delay there and back, plus its
    class's XOFF + headroom (PFC) or limit (no PFC) drained at the port's rate."""
    c = next(c for c in iface.egress.classes if c.tc == tc)
    held = c.limit_bytes if c.pfc is None else min(c.limit_bytes,
                                                   c.pfc.xoff_bytes + c.pfc.headroom_bytes)
    return 2 * plan.links[iface.link].delay_ns + Fr(held * 8 * 10**9, iface.egress.rate_bps)


@pytest.mark.parametrize("name", ["default", "explicit", "ring", "single"])
def test_round_trip_is_the_longest_over_every_path_the_routes_allow(name):
    loaded = load_config_text((REPO / "tests" / "golden" / f"{name}.yaml").read_text(), name)
    plan = compile_plan(loaded)
    hosts = [h.name for h in plan.hosts()]
    paths = [p for a in hosts for b in hosts if a != b for p in egress_paths(plan, a, b)]
    assert paths and all(p[0].ifname.startswith("eth") for p in paths)   # a host NIC first
    brute = max(sum(_brute_port_ns(plan, i) for i in p) for p in paths)
    assert longest_round_trip_ns(plan, 3) == brute


def test_window_is_at_least_rxes_and_at_most_2_to_the_22():
    assert roce_window_packets(10**9, Fr(1000), 4096) == 128           # 1 Gb/s x 1 us: 0.03
    assert roce_window_packets(10**12, Fr(10**9), 256) == 1 << 22      # 1 Tb/s x 1 s
    assert roce_window_packets(100 * 10**9, Fr(8 * 4096 * 200, 100), 4096) == 200   # exact


def test_a_given_window_goes_to_both_agents():
    loaded, plan = _load("    - {name: w, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, "
                         "window: 4096, size: 4096}")
    server, client = expand_workload(loaded.fabric, plan)
    parser = roce_main.build_parser()
    assert parser.parse_args(_argv(server)).window_packets == 4096
    c = parser.parse_args(client.argv)
    assert (c.window_packets, c.tx_depth) == (4096, 4097)


@pytest.mark.parametrize("value", ["0", "5000000", "13us", "true", "1.5"])
def test_a_bad_window_says_what_it_takes(value):
    problems = _problems(f"    - {{name: w, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, "
                         f"window: {value}}}")
    assert len(problems) == 1 and "workload.traffic[0].window: expected a whole number of " \
        "packets, 1..2^22 (4194304), or auto" in problems[0], problems
    if value == "13us":
        assert "DCTCP's window, a time, is cc_params.window" in problems[0]


def test_cc_params_names_are_the_agents_tunables_without_unit_suffixes():
    assert set(DcqcnCcParams.model_fields) == set(DCQCN_TUNABLE)
    assert set(DctcpCcParams.model_fields) == set(DCTCP_TUNABLE)
    for model, kind in ((DcqcnCcParams, "dcqcn"), (DctcpCcParams, "dctcp")):
        for name, key in zip(model.model_fields, cc_param_keys(kind), strict=True):
            assert name.removesuffix("_ns").removesuffix("_bps").removesuffix("_bytes") == key


def test_cc_params_reach_both_agents_and_apply_as_absolute_values_on_the_scaled_preset():
    loaded, plan = _load("    - {name: t, kind: roce_pairs, pairs: [[h1, h6]], duration: 1ms, "
                         "cc_preset: hpcc-ns3, cc_params: {rai: 7Mbps, alpha_timer: 2us, "
                         "byte_counter: 1MB, rate_decrease_interval: none, np_mode: timer, "
                         "g: 0.0625}}")
    server, client = expand_workload(loaded.fabric, plan)
    parser = roce_main.build_parser()
    want = {"rai_bps": 7_000_000, "alpha_timer_ns": 2_000, "byte_counter_bytes": 1_000_000,
            "rate_decrease_interval_ns": None, "np_mode": "timer", "g": 0.0625}
    for argv in (_argv(server), client.argv):
        args = parser.parse_args(argv)
        assert args.cc_params == want
        p = cc_params(args, cc_settings(args))
        # hpcc-ns3 is per 25G: R_HAI 50 -> 200 Mb/s on the 100G NIC, R_AI as given
        assert (p.rai_bps, p.rhai_bps, p.alpha_timer_ns, p.g) == (7e6, 200e6, 2_000, 0.0625)
        assert p.rate_decrease_interval_ns is None and p.byte_counter_bytes == 1_000_000
    np_ = make_np(parser.parse_args(_argv(server)), "dcqcn", p)
    assert (np_.cnp_interval_ns, np_.mode) == (0, "timer")
    # no cc_params: no --cc-params, the agents run the preset as it is
    loaded, plan = _load(INCAST)
    assert all("--cc-params" not in _argv(s) for s in expand_workload(loaded.fabric, plan))


def test_cnp_interval_keeps_the_presets_np_mode():
    loaded, plan = _load("    - {name: t, kind: roce_pairs, pairs: [[h1, h6]], duration: 1ms, "
                         "cc_preset: ns3-rdma, cnp_interval: 80us}")
    server, _ = expand_workload(loaded.fabric, plan)
    args = roce_main.build_parser().parse_args(_argv(server))
    np_ = make_np(args, "dcqcn", cc_params(args, cc_settings(args)))
    assert (np_.cnp_interval_ns, np_.mode) == (80_000, "timer")     # ns3-rdma's mode


@pytest.mark.parametrize(("entry", "expected"), [
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc_preset: rfc8257}",
     "workload.traffic[0].cc_preset: 'rfc8257' is not a DCQCN preset"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc: none, "
     "cc_preset: paper}", "cc_preset 'paper' does nothing with cc: none"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, tclass: default}",
     "workload.traffic[0].tclass: class 'default' (TC0) does not mark ECN"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, size: 0}",
     "workload.traffic[0].size: message size 0 B"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, rate: 10Gbps}",
     "workload.traffic[0].rate: unknown field 'rate': only udp_incast, udp_all_to_all, "
     "udp_pairs traffic has it"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duraton: 1ms}",
     "workload.traffic[0].duraton: unknown field 'duraton'; did you mean 'duration'?"),
    ("{name: x, kind: roce_incst, senders: [h1], receiver: h2, duration: 1ms}",
     "did you mean 'roce_incast'?"),
    ("{name: x, kind: roce_incast, senders: [h1, h9], receiver: h2, duration: 1ms}",
     "workload.traffic[0].senders[1]: 'h9' is not a host of this fabric"),
    ("{name: x, kind: roce_incast, pairs: [[h1, h2]], duration: 1ms}",
     "roce_incast needs senders: [...] and receiver:"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, qps: 0}",
     "workload.traffic[0].qps: 0 is too small"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc_params: {g: 0.1, "
     "incrase_timer: 55us}}", "workload.traffic[0].cc_params.incrase_timer: unknown DCQCN "
     "parameter 'incrase_timer'; did you mean 'increase_timer'? (DCQCN parameters: alpha_timer, "
     "increase_timer, "),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc: dctcp, "
     "cc_params: {byte_counter: 10MB}}", "workload.traffic[0].cc_params.byte_counter: "
     "byte_counter is a DCQCN parameter, but this entry has cc: dctcp; DCTCP parameters: "
     "window, g, rai, mss, min_rate, initial_alpha, cnp_marked"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc_params: {alpha_timer: "
     "5 fortnights}}", "workload.traffic[0].cc_params.alpha_timer: unknown unit"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc_params: {rai: 5MB}}",
     "workload.traffic[0].cc_params.rai: '5MB' looks like bytes per second"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc_params: {kmax: 1MB}}",
     "cc_params.kmax: kmax is the switch's ECN marking, not a DCQCN parameter; set it on the "
     "port class (qos.<class>.ecn.kmax)"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc: none, "
     "cc_params: {g: 0.1}}", "workload.traffic[0].cc_params: cc: none has no parameters"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cnp_interval: 4us, "
     "cc_params: {cnp_interval: 10us}}", "cc_params.cnp_interval: cnp_interval is given twice"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc_params: {min_rate: "
     "200Gbps}}", "cc_params.min_rate: 200Gbps is above the line rate of sender h1 (100Gbps)"),
    ("{name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, cc_params: {fast_recovery"
     "_steps: 0, byte_counter: none, initial_alpha: 1.5}}",
     "cc_params.fast_recovery_steps: 0 is too small; use a value >= 1"),
])
def test_roce_config_problems_name_the_field(entry, expected):
    problems = _problems(f"    - {entry}")
    assert any(expected in p for p in problems), problems


def test_every_cc_params_problem_is_reported_at_once():
    problems = _problems("    - {name: x, kind: roce_pairs, pairs: [[h1, h2]], duration: 1ms, "
                         "cc_params: {alpha_timr: 1us, window: 5us, g: 0, initial_alpha: 2, "
                         "increase_timer: 5uss, min_rate: none}}")
    fields = [p.split(": ")[1] for p in problems]
    assert fields == [f"workload.traffic[0].cc_params.{k}" for k in (
        "alpha_timr", "g", "increase_timer", "initial_alpha", "min_rate", "window")]


def test_a_misspelt_required_field_is_reported_once():
    problems = _problems("    - {name: x, kind: roce_pairs, pairs: [[h1, h2]], duraton: 1ms}")
    assert len(problems) == 1


def test_udp_problems_still_name_udp_fields():
    problems = _problems("    - {name: x, kind: udp_pairs, pairs: [[h1, h2]], duration: 1ms, "
                         "qps: 2}")
    assert problems == ["roce.yaml:12: workload.traffic[0].qps: unknown field 'qps': only "
                        "roce_incast, roce_all_to_all, roce_pairs, allreduce, reducescatter, "
                        "allgather, broadcast, alltoall, training, perftest traffic has it; fields "
                        "here: "
                        "duration, ecn, flows, hosts, kind, name, pairs, rate, receiver, "
                        "senders, size, start, tclass"]


# --- live snapshot and result rows ------------------------------------------------------

def _qp(qpn: int, **kw) -> dict:
    req = {"packets_sent": 10, "bytes_sent": 41_000, "wire_bytes_sent": 41_660,
           "payload_bytes_sent": 40_960, "bytes_completed": 40_960, "messages_completed": 1,
           "retransmissions": 2, "naks_received": 1, "rnr_naks_received": 0,
           "fatal_naks_received": 0, "timeouts": 1, "cnps_received": 3}
    rsp = {"packets_received": 9, "payload_bytes_received": 36_864, "duplicates": 0,
           "ooo_drops": 1, "naks_sent": 1, "ce_packets_received": 4, "cnps_sent": 3,
           "acks_sent": 2}
    return {"qpn": qpn, "requester": {**req, **kw}, "responder": {**rsp, **kw},
            "rc_bps": 25e9, "rt_bps": 50e9, "alpha": 0.5, "packets_received": 9,
            "bytes_received": 37_000}


def test_snapshot_numbers_sum_over_qps_for_time_series():
    qps = [_qp(0x300), _qp(0x200)]
    send = flat_counters("client", qps)
    assert send["mode"] == "send"
    assert send["packets"] == 20 and send["bytes"] == 82_000 and send["wire_bytes"] == 83_320
    assert send["retransmissions"] == 4 and send["timeouts"] == 2 and send["cnps"] == 6
    assert send["rc_bps"] == 50e9 and send["rt_bps"] == 100e9
    assert send["qp0.rc_bps"] == 25e9 and send["qp1.alpha"] == 0.5 and send["qp0.cnps"] == 3
    recv = flat_counters("server", qps)
    assert recv["mode"] == "recv"
    assert recv["bytes"] == 2 * 36_864           # RDMA payload accepted in order
    assert recv["wire_bytes"] == 2 * (37_000 + 66 * 9)
    assert recv["ce_packets"] == 8 and recv["cnps"] == 6 and recv["naks"] == 2
    numeric = {k for k, v in {**send, **recv}.items() if isinstance(v, int | float)}
    assert numeric >= {"packets", "bytes", "rc_bps", "ce_packets"}


def test_one_result_row_per_stream_from_client_and_server(tmp_path):
    loaded, plan = _load(INCAST)
    specs = expand_workload(loaded.fabric, plan)
    client = {"role": "client", "cc": "dcqcn", "cc_preset": "hpcc-ns3-paper", "qp_count": 1,
              "cc_overrides": {"g": 0.0625}, "window_packets": 642,
              "start_late_fabric_ns": 1_500,
              "bytes": 4 << 20, "messages": 64, "elapsed_fabric_ns": 400_000,
              "bw_fabric_bps": (4 << 20) * 8 / 400e-6, "verified": True, "error": None,
              "qps": {"770": _qp(770)}}
    server = {"role": "server", "verified": True, "error": None, "qps": {"512": _qp(512)}}
    results = _responder_results(specs, {n: r for s in specs if s.role == "sender"
                                         for n, r in ((s.name, client), (f"{s.name}-srv", server))})
    store = Store(tmp_path / "c.sqlite", create=True)
    for row in ROCE.result_rows(specs, results, run_view(plan, tmp_path, 0)):
        store.add_result(row.traffic, row.kind, row.fields)
    rows = store.results()
    store.close()
    assert [(r["src"], r["dst"]) for r in rows] == [("h1", "h8"), ("h2", "h8"), ("h5", "h8")]
    row = rows[0]
    assert row["workload"] == "inc" and row["kind"] == "roce_incast"
    assert row["bytes"] == 4 << 20 and row["time_us"] == 400.0
    # posted 1.5 us after the common start (the entry starts at 0), done 400 us later
    assert (row["start_us"], row["end_us"]) == (1.5, 401.5)
    assert row["gbps"] == pytest.approx(83.886, abs=1e-3)
    assert (row["retransmissions"], row["naks"], row["timeouts"]) == (2, 1, 1)
    assert (row["cnps_sent"], row["cnps_received"], row["ce_received"]) == (3, 3, 4)
    assert row["verified"] is True and row["cc"] == "dcqcn/hpcc-ns3-paper"
    assert row["cc_overrides"] == {"g": 0.0625} and row["window_packets"] == 642
    assert (row["tx_packets"], row["rx_packets"], row["lost"]) == (10, 9, 1)
    assert row["rx_bytes"] == 37_000
    assert row["rx_fabric_bps"] == round((37_000 + 66 * 9) * 8 / 400e-6)


def test_fidelity_names_late_clients_bad_data_and_timeouts(tmp_path):
    loaded, plan = _load(INCAST)
    specs = expand_workload(loaded.fabric, plan)
    (tmp_path / "agents").mkdir()
    t0 = time.time_ns() - 10 ** 9
    for s in specs:
        if s.role == "sender":
            path = ready_file(tmp_path / "agents", s)
            path.touch()
            late = 300_000_000 if s.src == "h2" else 0          # h2 set up 300 ms late
            os.utime(path, ns=(t0 + late, t0 + late))
    results = {"inc-h1-h8": {"verified": False, "first_mismatch": {"qp": 0, "offset": 8},
                             "qps": {"1": _qp(1, timeouts=0)}},
               "inc-h2-h8": {"verified": True, "qps": {"1": _qp(1, timeouts=0)}},
               "inc-h5-h8": {"verified": True, "qps": {"1": _qp(1, timeouts=3)}},
               "inc-h1-h8-srv": {"error": "remote_access_error"}}
    results = _responder_results(specs, results)
    notes = ROCE.fidelity_notes(specs, results, run_view(plan, tmp_path / "agents", t0))
    text = "\n".join(notes)
    assert "RoCE server inc-h1-h8-srv on h8: remote_access_error" in text
    assert "inc-h1-h8: the data did not arrive byte-exact" in text
    assert "inc-h2-h8 on h2 finished set-up 300 ms (wall) after its start time" in text
    assert "150.0 us fabric late" in text
    assert "inc-h5-h8: 3 ACK timeouts" in text
    assert len(notes) == 4
    # with a drop in a lossless queue, timeouts are expected and not a fidelity note
    notes = ROCE.fidelity_notes(specs, results, run_view(plan, tmp_path / "agents", t0,
                                                         lossless_drops=1))
    assert not any("ACK timeouts" in n for n in notes)


# --- pinning QPs to a path (via) ------------------------------------------------------

PINNED = ("    - {name: a, kind: roce_pairs, pairs: [[h1, h5]], duration: 1ms, qps: 2, "
          "via: [spine1]}\n"
          "    - {name: b, kind: roce_pairs, pairs: [[h2, h6]], duration: 1ms}")


def test_via_is_carried_by_the_pinned_entrys_clients_only():
    loaded, plan = _load(PINNED)
    specs = expand_workload(loaded.fabric, plan)
    clients = {s.traffic: s for s in specs if s.role == "sender"}
    assert clients["a"].via == ("spine1",) and clients["b"].via == ()
    assert all(s.via == () for s in specs if s.role == "receiver")
    (pin,) = ROCE.path_pins(specs)
    # one source port per QP, to the pinned stream's own server's RoCE port
    assert (pin.sender, pin.src, pin.dst, pin.count, pin.via) == (
        clients["a"].name, "h1", "h5", 2, ("spine1",))
    server = next(s for s in specs if s.role == "receiver" and s.traffic == "a")
    assert pin.dport == int(_opt(_argv(server), "--roce-port"))


def test_pinned_client_argv_gives_each_qp_its_port_and_parses():
    loaded, plan = _load(PINNED)
    specs = expand_workload(loaded.fabric, plan)
    client = next(s for s in specs if s.traffic == "a" and s.role == "sender")
    pinned = ROCE.pinned(client, [49152, 49155])
    assert pinned.name == client.name and pinned.via == client.via
    args = roce_main.build_parser().parse_args(pinned.argv)
    assert args.sport == [49152, 49155] and args.qps == 2
    assert roce_main.build_parser().parse_args(client.argv).sport is None


@pytest.mark.parametrize("argv, message", [
    (["--qps", "2", "--sport", "50000"], "--sport is given 1 times for 2 QP(s)"),
    (["--qps", "2", "--sport", "50000", "--sport", "50000"], "its own source port"),
])
def test_the_agent_refuses_sports_that_do_not_give_one_per_qp(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        roce_main.main(["client", "write_bw", "--server", "127.0.0.1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("via, expected", [
    ("[spin1]", "workload.traffic[0].via[0]: unknown node 'spin1'; did you mean 'spine1'?"),
    ("[h3]", "workload.traffic[0].via[0]: 'h3' is a host; via lists the switches"),
    ("[spine1, spine1]", "workload.traffic[0].via[1]: 'spine1' is listed twice"),
    ("[]", "workload.traffic[0].via: via is empty"),
    # h1 and h2 share leaf1: no path between them leaves it
    ("[spine2]", "workload.traffic[0].via: no equal-cost path from h1 to h2 crosses spine2: "
                 "its paths cross leaf1"),
])
def test_a_via_the_fabric_cannot_honour_is_refused_at_load(via, expected):
    problems = _problems("    - {name: x, kind: roce_pairs, pairs: [[h1, h5], [h1, h2]], "
                         f"duration: 1ms, via: {via}}}")
    assert any(expected in p for p in problems), problems


def test_via_through_either_spine_or_a_leaf_on_the_way_is_accepted():
    for via in ("[spine1]", "[spine2]", "[leaf1, spine2, leaf2]"):
        loaded, _ = _load("    - {name: x, kind: roce_incast, senders: [h1, h2], receiver: h8, "
                          f"duration: 1ms, via: {via}}}")
        assert loaded.fabric.workload.traffic[0].via


def test_switches_between_matches_the_plans_routes_on_every_pair():
    from testbed.net.paths import switches_between as by_plan
    from testbed.workloads.roce import switches_between as by_topology
    for name in ("default", "ring", "explicit", "shared", "single"):
        loaded = load_config_text((REPO / "tests" / "golden" / f"{name}.yaml").read_text(),
                                  f"{name}.yaml")
        plan = compile_plan(loaded)
        roles = {n.name: n.role for n in plan.nodes}

        def neighbours(node: str, plan=plan) -> list[str]:
            return list(dict.fromkeys(i.peer.node for i in plan.node(node).interfaces))

        hosts = [h.name for h in plan.hosts()]
        for src in hosts:
            for dst in hosts:
                if src != dst:
                    assert by_topology(roles, neighbours, src, dst) == by_plan(
                        plan, src, dst), (name, src, dst)


def test_result_rows_carry_each_qps_source_port_and_the_via(tmp_path):
    loaded, plan = _load(PINNED)
    specs = expand_workload(loaded.fabric, plan)
    qps = {"770": {**_qp(770), "sport": 49152}, "771": {**_qp(771), "sport": 49155}}
    client = {"role": "client", "qp_count": 2, "bytes": 1, "messages": 1,
              "elapsed_fabric_ns": 1000, "qps": qps}
    results = {s.name: (client if s.role == "sender" else {"qps": {}}) for s in specs}
    rows = {r.traffic: r.fields for r in ROCE.result_rows(specs, results,
                                                         run_view(plan, tmp_path, 0))}
    assert rows["a"]["sports"] == [49152, 49155] and rows["a"]["via"] == ["spine1"]
    assert rows["b"]["via"] is None


def test_the_run_gives_pinned_clients_distinct_ports_per_host_and_says_which(monkeypatch):
    from contextlib import nullcontext

    from testbed.run import pinning
    loaded, plan = _load(
        "    - {name: a, kind: roce_pairs, pairs: [[h1, h5]], duration: 1ms, qps: 2, "
        "via: [spine1]}\n"
        "    - {name: b, kind: roce_pairs, pairs: [[h1, h6], [h2, h6]], duration: 1ms, "
        "via: [spine2]}\n"
        "    - {name: c, kind: roce_pairs, pairs: [[h3, h7]], duration: 1ms}")
    specs = expand_workload(loaded.fabric, plan)
    asked = []

    def fake_pick(plan, src, dst, via, *, dport, count, exclude, entry, lookup):
        asked.append((src, dst, tuple(via), dport, count, set(exclude), entry))
        free = [p for p in range(49152, 49200) if p not in exclude]
        return [(p, [(src, "eth0"), ("leaf1", "swp5"), (via[0], "swp3")])
                for p in free[:count]]

    monkeypatch.setattr(pinning, "pick_sports", fake_pick)
    monkeypatch.setattr(pinning, "RouteLookup", lambda plan: nullcontext())
    out, done = pinning.pin_paths(plan, specs)
    assert [s.name for s in out] == [s.name for s in specs]
    argv = {s.name: s.argv for s in out if s.role == "sender"}
    sports = {n: roce_main.build_parser().parse_args(a).sport for n, a in argv.items()}
    # h1's second client skips the ports its first took; h2 starts again at the bottom
    assert sports == {"a-h1-h5": [49152, 49153], "b-h1-h6": [49154], "b-h2-h6": [49152],
                      "c-h3-h7": None}
    assert asked[0][:5] == ("h1", "h5", ("spine1",), ROCE_UDP_PORT, 2)
    assert asked[0][6] == "workload traffic 'a'"
    assert asked[1][5] == {49152, 49153}
    assert [(p.sender, p.sports) for p in done] == [
        ("a-h1-h5", (49152, 49153)), ("b-h1-h6", (49154,)), ("b-h2-h6", (49152,))]
    assert done[1].paths == ("h1:eth0 -> leaf1:swp5 -> spine2:swp3",)
    # the servers are untouched
    assert [s for s in out if s.role == "receiver"] == [s for s in specs if s.role == "receiver"]


# --- which packet path the agents ran (agents.fast) -------------------------------------

def test_rows_and_notes_say_which_packet_path_ran(tmp_path):
    from testbed.workloads.roce import packet_path

    on = {"on": True, "reason": None}
    missing = {"on": False, "reason": "extension not available (...): run `make setup`"}
    chosen = {"on": False, "reason": "turned off: TESTBED_FASTPATH=0"}
    assert packet_path({"fast_path": on}, {"fast_path": on}) == "fast"
    assert packet_path({"fast_path": chosen}, {"fast_path": chosen}) == "python"
    assert packet_path({"fast_path": on}, {"fast_path": missing}) == "client fast, server python"
    assert packet_path({}, {}) is None
    loaded, plan = _load(INCAST)
    specs = expand_workload(loaded.fabric, plan)
    (tmp_path / "agents").mkdir()
    t0 = time.time_ns()
    for s in specs:
        if s.role == "sender":
            ready_file(tmp_path / "agents", s).touch()
    results = {n: {"verified": True, "qps": {"1": _qp(1, timeouts=0)},
                   "fast_path": chosen} for s in specs if s.role == "sender"
               for n in (s.name, f"{s.name}-srv")}
    results["inc-h1-h8-srv"]["fast_path"] = missing
    results = _responder_results(specs, results)
    rows = {r.fields["src"]: r.fields for r in ROCE.result_rows(
        specs, results, run_view(plan, tmp_path / "agents", t0))}
    assert rows["h1"]["packet_path"] == "python" and rows["h2"]["packet_path"] == "python"
    notes = ROCE.fidelity_notes(specs, results, run_view(plan, tmp_path / "agents", t0))
    # only the side forced onto the Python path is a note; choosing it is not
    assert [n for n in notes if "packet path" in n] == [
        "RoCE client inc-h1-h8: the server ran the pure-Python packet path, not the compiled "
        "one: extension not available (...): run `make setup` (same packets, fewer per second "
        "of CPU)"]
