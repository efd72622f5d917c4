"""DCQCN around rxe (agents/rxe_cc): CNP generation from recorded CE counts, the CNP's
bytes, the reaction point's rate decisions and the class-rate commands, all pure; the
counter program's layouts against its BTF."""

from __future__ import annotations

import json
import re
import shutil
import socket
import struct
import subprocess

import pytest
from scapy.contrib.roce import BTH, CNPPadding
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from agents.rdma.cc import preset
from agents.rxe_cc import maps as rxemaps
from agents.rxe_cc.__main__ import class_message, handle, parse_qps
from agents.rxe_cc.logic import (
    ClassRate,
    ClassRateLimiter,
    NotificationPoint,
    ReactionPoint,
    build_cnp_frame,
    cnp_sport,
)
from agents.wire.icrc import icrc_of_ip_packet
from agents.wire.netlink import attrs

US = 1_000
GBPS = 1_000_000_000

# CE counters of two local QPs as a poller saw them (fabric ns, {lqpn: CE packets so far}):
# QP 17 is marked steadily, QP 18 has one burst, then a counter reset (entry made anew).
RECORDED = [
    (0, {17: 0}),
    (10 * US, {17: 3}),
    (20 * US, {17: 9, 18: 0}),
    (40 * US, {17: 15, 18: 4}),
    (55 * US, {17: 20, 18: 4}),
    (60 * US, {17: 21, 18: 4}),
    (80 * US, {17: 21, 18: 4}),
    (120 * US, {17: 30, 18: 2}),
]


def test_np_sends_at_most_one_cnp_per_interval_per_qp_from_recorded_ce_counts():
    np = NotificationPoint(50 * US, "interval")
    sent = [(t, np.observe(counts, t)) for t, counts in RECORDED]
    assert sent == [
        (0, []),
        (10 * US, [17]),          # the first CE packets: a CNP at once
        (20 * US, []),            # 17 marked again within 50 us: coalesced
        (40 * US, [18]),          # 18's first marks
        (55 * US, []),            # 45 us after 17's CNP: still inside its interval
        (60 * US, [17]),          # 50 us after it: the next CE packet earns one
        (80 * US, []),            # no new marks
        (120 * US, [17, 18]),     # 17 marked; 18's counter went back (reset): 2 new marks
    ]
    assert np.ce_packets == 30 + 4 + 2
    assert np.cnps_due == 5


def test_np_interval_zero_sends_one_cnp_per_poll_with_new_marks():
    np = NotificationPoint(0)
    assert [np.observe(c, t) for t, c in RECORDED] == [[], [17], [17], [17, 18], [17], [17],
                                                        [], [17, 18]]


def test_np_timer_mode_uses_slots_from_the_first_mark():
    np = NotificationPoint(50 * US, "timer")
    out = [np.observe({17: n}, t) for t, n in [(10 * US, 1), (40 * US, 2), (59 * US, 3),
                                                (61 * US, 4), (100 * US, 5)]]
    # slots [10, 60), [60, 110): one CNP in each
    assert out == [[17], [], [], [17], []]


def test_cnp_frame_decodes_with_scapy_and_carries_a_valid_icrc():
    frame = build_cnp_frame("02:00:00:00:00:03", "02:00:00:00:00:fe", "10.0.0.5",
                            "10.0.0.1", 0x11, 48, cnp_sport(0x11))
    pkt = Ether(frame)
    assert pkt[Ether].dst == "02:00:00:00:00:fe" and pkt[Ether].src == "02:00:00:00:00:03"
    ip = pkt[IP]
    assert (ip.src, ip.dst, ip.tos >> 2, ip.tos & 3, ip.id, int(ip.flags)) == (
        "10.0.0.5", "10.0.0.1", 48, 0, 0, 2)
    assert pkt[UDP].dport == 4791 and pkt[UDP].sport == cnp_sport(0x11) >= 0xC000
    bth = pkt[BTH]
    assert (bth.opcode, bth.becn, bth.fecn, bth.dqpn, bth.psn, bth.pkey) == (
        0x81, 1, 0, 0x11, 0, 0xFFFF)
    assert bytes(pkt[CNPPadding])[:16] == bytes(16)
    assert len(pkt[UDP].payload) == 12 + 16 + 4
    stored, computed = icrc_of_ip_packet(frame[14:])
    assert stored == computed
    # scapy's own ICRC (computed when the field is left empty) agrees
    again = Ether(frame)
    again[BTH].icrc = None
    assert Ether(bytes(again))[BTH].icrc == bth.icrc
    # a corrupted byte under the ICRC is caught
    bad = bytearray(frame)
    bad[14 + 20 + 8 + 7] ^= 1                # the DestQP
    assert len(set(icrc_of_ip_packet(bytes(bad[14:])))) == 2


def test_rp_cuts_the_rate_on_each_new_cnp_and_recovers_in_fabric_time():
    line = 10 * GBPS
    params = preset("paper", line)
    rp = ReactionPoint(params, line, 0)
    assert rp.observe(0, 0) == line
    after_one = rp.observe(1, 1 * US)
    assert after_one == pytest.approx(line * (1 - params.initial_alpha / 2))
    assert rp.rate_cuts == 1 and rp.cnps_received == 1
    after_three = rp.observe(3, 2 * US)          # two more CNPs in one poll: two cuts
    assert rp.rate_cuts == 3 and after_three < after_one
    assert rp.observe(3, 3 * US) == after_three  # no new CNP, no timer due yet
    recovered = rp.advance(3 * US + 20 * params.increase_timer_ns)
    assert after_three < recovered <= line       # fast recovery and additive increase
    assert rp.observe(1, 2000 * US) <= line      # a counter reset counts from zero
    assert rp.cnps_received == 4


def test_rp_byte_counter_is_fed_from_snapshots():
    line = 10 * GBPS
    params = preset("paper", line)              # byte counter 10 MB
    rp = ReactionPoint(params, line, 0)
    rp.on_bytes_sent(5_000_000, 0)              # the first snapshot is the baseline
    rp.observe(1, 1 * US)
    cut = rp.rate_bps
    rp.on_bytes_sent(5_000_000 + params.byte_counter_bytes, 2 * US)
    assert rp.rp.snapshot()["counters"]["byte_events"] == 1 and rp.rate_bps > cut


def _limiter(**kw) -> ClassRateLimiter:
    args = dict(dilation_factor=100, line_rate_bps=10 * GBPS,
                planned_wall_rate_bps=50_000_000, planned_wall_ceil_bps=100_000_000,
                min_interval_ns=50 * US)
    args.update(kw)
    return ClassRateLimiter(**args)


def test_class_rate_commands_follow_dcqcn_at_a_bounded_rate():
    lim = _limiter()
    assert lim.decide(10 * GBPS, 0) is None                  # line rate, nothing applied
    cut = lim.decide(5 * GBPS, 1 * US)
    assert cut == ClassRate(50_000_000, 50_000_000, 5 * GBPS, False)
    assert lim.decide(2 * GBPS, 20 * US) is None and lim.suppressed == 1   # too soon
    low = lim.decide(2 * GBPS, 60 * US)
    assert low == ClassRate(20_000_000, 20_000_000, 2 * GBPS, False)  # rate <= ceil
    assert lim.decide(2.01 * GBPS, 200 * US) is None         # below min_change: not sent
    restore = lim.decide(10 * GBPS, 300 * US)
    assert restore == ClassRate(50_000_000, 100_000_000, 10 * GBPS, True)
    assert lim.applied_bps is None and lim.updates == 3


def test_rp_to_class_commands_end_to_end_pure():
    """CNPs in -> DCQCN decisions -> the HTB class commands the agent would send."""
    line = 10 * GBPS
    params = preset("hpcc-ns3-paper", line)
    rp = ReactionPoint(params, line, 0)
    lim = _limiter(min_interval_ns=params.cnp_interval_ns)
    commands = []
    cnps = 0
    for step in range(40):
        t = step * 10 * US
        if step < 20 and step % 5 == 0:
            cnps += 1
        rate = rp.observe(cnps, t)
        change = lim.decide(rate, t)
        if change is not None:
            commands.append((t, change))
    assert commands, "a CNP must change the class"
    first = commands[0][1]
    assert not first.restore and first.wall_ceil_bps < 100_000_000
    assert all(b[0] - a[0] >= params.cnp_interval_ns for a, b in
               zip(commands, commands[1:], strict=False))
    assert min(c.wall_ceil_bps for _, c in commands) <= 60_000_000


def test_class_message_is_an_htb_change_of_the_class_only():
    msg = class_message(7, handle("1:13"), handle("1:1"),
                        ClassRate(20_000_000, 30_000_000, 3 * GBPS, False), 1, 9000, 24, 9000)
    length, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", msg, 0)
    assert length == len(msg) and kind == 40          # RTM_NEWTCLASS, never a qdisc message
    _family, _pad1, _pad2, ifindex, tc_handle, parent, _info = struct.unpack_from(
        "=BBHiIII", msg, 16)
    assert (ifindex, tc_handle, parent) == (7, 0x10013, 0x10001)
    names = [k for k, _s, _e in attrs(msg, 36, len(msg))]
    assert 1 in names and 2 in names                  # TCA_KIND "htb", TCA_OPTIONS
    kind_attr = next((s, e) for k, s, e in attrs(msg, 36, len(msg)) if k == 1)
    assert msg[kind_attr[0]:kind_attr[1]].rstrip(b"\0") == b"htb"


def test_cnp_source_port_is_rxes_rule():
    from agents.rdma.transport import rxe_sport
    assert all(cnp_sport(q) == rxe_sport(q) for q in (1, 17, 18, 0x123456, 0xFFFFFF))


def test_parse_qps_keeps_connected_qps_of_one_device():
    text = json.dumps([
        {"ifname": "rxe_h3", "port": 1, "lqpn": 1, "type": "GSI", "state": "RTS"},
        {"ifname": "rxe_h3", "port": 1, "lqpn": 17, "rqpn": 19, "type": "RC", "state": "RTS"},
        {"ifname": "rxe_h1", "port": 1, "lqpn": 17, "rqpn": 17, "type": "RC", "state": "RTS"},
        # recorded on 6.1: a RESET twin with rqpn 0 listed beside the connected QP
        {"ifindex": 2, "ifname": "rxe_h3", "lqpn": 18, "rqpn": 0, "type": "RC",
         "state": "RESET"},
        {"ifindex": 2, "ifname": "rxe_h3", "port": 1, "lqpn": 18, "rqpn": 17, "type": "RC",
         "state": "RTR"},
        {"ifindex": 2, "ifname": "rxe_h3", "lqpn": 20, "rqpn": 0, "type": "RC",
         "state": "RESET"},
    ])
    assert parse_qps(text, "rxe_h3") == {17: 19, 18: 17}
    assert parse_qps("", None) == {}


def test_map_value_decodes():
    key = struct.pack("=I", 17)
    value = rxemaps.QP_COUNTS.pack(10, 4, 1, 11000, struct.unpack("=I", socket.inet_aton(
        "10.0.0.1"))[0], struct.unpack("=I", socket.inet_aton("10.0.0.5"))[0], 0xC123, 0, 0)
    q = rxemaps.decode_qp(key, value)
    assert q == rxemaps.QpCounts(17, 10, 4, 1, 11000, "10.0.0.1", "10.0.0.5", 0xC123)


_SIZES = {"B": 1, "H": 2, "I": 4, "Q": 8}


def _offsets(layout) -> list[int]:
    out, off = [], 0
    for code in re.findall(r"(\d*)([BHIQ])", layout.format):
        for _ in range(int(code[0] or 1)):
            out.append(off)
            off += _SIZES[code[1]]
    return out


@pytest.mark.skipif(not (shutil.which("clang") and shutil.which("bpftool")),
                    reason="needs clang and bpftool")
def test_counter_program_btf_matches_python_layouts(tmp_path):
    from testbed.net.rxecc import ensure_rxe_cc_object
    obj = ensure_rxe_cc_object(tmp_path)
    assert re.fullmatch(r"rxe_cc-[0-9a-f]{16}\.o", obj.name)
    res = subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(obj)],
                         capture_output=True, text=True, check=True)
    structs = {t["name"]: t for t in json.loads(res.stdout)["types"] if t["kind"] == "STRUCT"}
    for name, (layout, fields) in rxemaps.LAYOUTS.items():
        btf = structs[name]
        assert btf["size"] == layout.size, name
        got = [(m["name"], m["bits_offset"] // 8) for m in btf["members"]]
        assert got == list(zip(fields, _offsets(layout), strict=True)), name


# --- the control plane's side: which hosts, which arguments ----------------------------

RXE_FABRIC = """
name: rxecc
dilation: 100
topology:
  kind: leaf_spine
  spines: 1
  leaves: 1
  hosts_per_leaf: 3
  host_link: {port: 100GBASE-CR1, length: 2m}
  fabric_link: {port: 400GBASE-DR4, length: 100m}
hosts:
  - {name: h1, endpoint: rxe}
  - {name: h3, endpoint: rxe}
"""


def _plan(text: str = RXE_FABRIC):
    from testbed.config import load_config_text
    from testbed.plan import compile_plan
    return compile_plan(load_config_text(text))


def test_rxe_cc_runs_on_rxe_hosts_with_a_lossless_ecn_class_only():
    from testbed.run.fabric_agents import rxe_cc_hosts
    plan = _plan()
    assert [h.name for h in rxe_cc_hosts(plan)] == ["h1", "h3"]
    no_ecn = RXE_FABRIC + """traffic_classes:
  - {name: roce, tc: 3, dscp: [26], lossless: true, ecn: false}
  - {name: cnp, tc: 6, dscp: [48], strict: true}
  - {name: default, tc: 0, default: true}
"""
    assert not any(t.ecn for t in _plan(no_ecn).traffic_classes)
    assert rxe_cc_hosts(_plan(no_ecn)) == []


def test_rxe_cc_argv_names_the_nic_the_cnp_path_and_the_lossless_class():
    from testbed.run.fabric_agents import RxeDcqcn, lossless_ecn_class, rxe_cc_argv
    plan = _plan()
    h1 = plan.node("h1")
    argv = rxe_cc_argv(plan, h1, RxeDcqcn("hpcc-ns3-paper", (("min_rate_bps", 2e9),)))
    opts = dict(zip(argv[::1], argv[1::1], strict=False))
    iface = h1.interfaces[0]
    cls = lossless_ecn_class(plan, iface)
    peer_mac = next(i.mac for i in plan.node(iface.peer.node).interfaces
                    if i.ifname == iface.peer.ifname)
    assert "--np" in argv and "--rp" in argv
    assert opts["--ifname"] == iface.ifname and opts["--gw-mac"] == peer_mac
    assert opts["--classid"] == cls.classid and int(opts["--wall-ceil-bps"]) == cls.wall_ceil_bps
    assert int(opts["--line-rate-bps"]) == iface.egress.rate_bps
    assert int(opts["--dilation"]) == 100 and opts["--dcqcn-preset"] == "hpcc-ns3-paper"
    assert int(opts["--cnp-dscp"]) == 48
    assert json.loads(opts["--cc-params"]) == {"min_rate_bps": 2e9}
    # the agent accepts them all
    from agents.rxe_cc.__main__ import build_parser
    args = build_parser().parse_args(argv)
    assert args.np and args.rp and args.lossless_tc == cls.tc


class _Entry:
    def __init__(self, kind: str, cc: str = "dcqcn", preset: str | None = None,
                 overrides: dict | None = None) -> None:
        self.kind, self.cc, self.preset, self._o = kind, cc, preset, overrides or {}

    def cc_overrides(self) -> dict:
        return self._o


def test_rxe_dcqcn_follows_the_perftest_entry():
    from testbed.run.fabric_agents import RxeDcqcn, rxe_dcqcn_of
    assert rxe_dcqcn_of([]) == RxeDcqcn("hpcc-ns3-paper")
    assert rxe_dcqcn_of([_Entry("roce_incast", "none"), _Entry("perftest", preset="paper",
                                                                overrides={"g": 0.5})]) == \
        RxeDcqcn("paper", (("g", 0.5),))
    assert rxe_dcqcn_of([_Entry("perftest", "none")]) is None


def test_the_note_says_the_rate_is_per_host_class():
    from testbed.run.fabric_agents import RxeDcqcn, rxe_cc_hosts, rxe_cc_note
    note = rxe_cc_note(rxe_cc_hosts(_plan()), RxeDcqcn())
    assert "per HOST CLASS" in note and "not per QP" in note and "h1, h3" in note


def test_the_run_starts_rxe_cc_on_rxe_hosts_and_notes_the_per_host_class_rate(monkeypatch):
    """runner.start_rxe_cc: agents for the rxe hosts (the starting itself stubbed: it
    attaches BPF and starts processes), their endpoints sampled, the fidelity note."""
    from types import SimpleNamespace

    from testbed.config import load_config_text
    from testbed.run import runner
    from testbed.run.collector import AgentEndpoint

    loaded = load_config_text(RXE_FABRIC)
    plan = _plan()
    started = {}

    def fake_start(plan_, directory, dcqcn):
        started["hosts"] = [n.name for n in runner.rxe_cc_hosts(plan_)]
        started["dcqcn"] = dcqcn
        return [(SimpleNamespace(name=f"rxe-cc-{h}"),
                 AgentEndpoint(f"rxe-cc-{h}", h, f"/nonexistent/{h}.sock"))
                for h in started["hosts"]]

    notes: list[str] = []
    run = SimpleNamespace(plan=plan, loaded=loaded, agents_dir=None, fabric_procs=[],
                          endpoints=[], notes=SimpleNamespace(add=notes.append),
                          options=SimpleNamespace(say=lambda _m: None))
    monkeypatch.setattr(runner, "start_rxe_cc_agents", fake_start)
    runner.start_rxe_cc(run)
    assert started["hosts"] == ["h1", "h3"] and started["dcqcn"].preset == "hpcc-ns3-paper"
    assert [e.name for e in run.endpoints] == ["rxe-cc-h1", "rxe-cc-h3"]
    assert len(run.fabric_procs) == 2
    assert len(notes) == 1 and "not per QP" in notes[0]


def test_a_cnp_for_a_qp_not_yet_in_the_table_is_held_and_sent_once_it_is():
    from types import SimpleNamespace

    from agents.rxe_cc.__main__ import Agent

    agent = Agent.__new__(Agent)          # only the CNP bookkeeping, no sockets or maps
    agent.counters = {"cnps_sent": 0, "cnps_unresolved": 0, "cnps_deferred": 0,
                      "cnps_after_close": 0}
    agent.held_cnps = {}
    agent.seen_qps = set()
    table: dict[int, int] = {}
    agent.peer_qpn = table.get
    sent = []
    agent._send_cnp_to = lambda q, peer: sent.append((q.dest_qp, peer))
    q17 = SimpleNamespace(dest_qp=17)
    agent.send_cnp(q17)                   # marked before rdma lists QP 17: held
    agent.send_cnp(q17)                   # a newer one replaces it: the first is lost
    assert sent == [] and agent.counters["cnps_deferred"] == 1
    assert agent.counters["cnps_unresolved"] == 1
    agent.send_held_cnps()                # the table still does not know it
    assert sent == [] and agent.held_cnps
    table[17] = 33
    agent.send_held_cnps()
    assert sent == [(17, 33)] and not agent.held_cnps
    agent.send_cnp(SimpleNamespace(dest_qp=18))
    # one never resolved counts as unresolved in the agent's snapshot
    assert agent.counters["cnps_unresolved"] + len(agent.held_cnps) == 2
    # a QP the table listed once and no longer does has closed: nothing held, counted apart
    agent.seen_qps.add(19)
    agent.send_cnp(SimpleNamespace(dest_qp=19))
    assert agent.counters["cnps_after_close"] == 1 and 19 not in agent.held_cnps
