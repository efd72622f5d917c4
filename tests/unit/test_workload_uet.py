"""The uet kinds in a config: validation with clear problems, expansion into one agent
per host with its streams as a schedule, the host agent's streams over a fake NIC (every
byte checked, messages completing out of order, a corrupted byte caught, the last SEND
that tells a duration stream's count), and the result rows, accounts and notes built from
that agent's real output. No root."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from agents.runtime.lifecycle import Lifecycle
from agents.timebase import Dilation, FabricClock
from agents.uet import __main__ as uet_main
from agents.uet.host import DONE_INDEX, KEY_BASE, UetHost, parse_schedule, pattern
from testbed.config import ConfigError, load_config_text
from testbed.plan import compile_plan
from testbed.plan.paths import host_address
from testbed.run.workload import expand_workload, run_view
from testbed.workloads import uet as uet_kind
from testbed.workloads.registry import REGISTRY
from testbed.workloads.uet import KIND, UET_UDP_PORT, resolve_class, slots_and_depth

REPO = Path(__file__).resolve().parents[2]

FABRIC = """\
name: uetwl
dilation: 1000
traffic_classes:
  - {{tc: 3, name: roce, dscp: [26], lossless: true, ecn: true}}
  - {{tc: 6, name: cnp, dscp: [48], strict: true}}
  - {{tc: 2, name: uet, dscp: [18], ecn: true}}
  - {{tc: 0, name: default, default: true}}
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

PAIRS = """\
    - {name: a, kind: uet_pairs, pairs: [[h1, h5], [h2, h5], [h5, h1]], size: 1MB,
       messages: 4, tclass: uet}
    - {name: b, kind: uet_incast, senders: [h3, h4], receiver: h6, size: 64KB,
       duration: 100us, start: 10us, tclass: uet, test: send_bw, entropy: reps,
       entropies: 8, cc: none}
"""


def _load(traffic: str):
    loaded = load_config_text(FABRIC.format(traffic=traffic), "uet.yaml")
    return loaded, compile_plan(loaded)


def _problems(traffic: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config_text(FABRIC.format(traffic=traffic), "uet.yaml")
    return exc.value.lines()


def _schedule(spec) -> dict:
    return json.loads(dict(spec.inputs)["schedule.json"])


def test_the_kind_is_registered_and_owns_udp_4793() -> None:
    assert REGISTRY.of("uet_pairs") is KIND and REGISTRY.of("uet_all_to_all") is KIND
    assert UET_UDP_PORT in KIND.ports["udp"]
    roce = REGISTRY.of("roce_pairs")
    from testbed.workloads.registry import port_ranges
    assert not any(UET_UDP_PORT in r for r in port_ranges(roce.ports["udp"]))


def test_one_agent_per_host_with_every_stream_of_it_and_receivers_first() -> None:
    loaded, plan = _load(PAIRS)
    specs = expand_workload(loaded.fabric, plan)
    assert [(s.traffic, s.node, s.role) for s in specs] == [
        ("a", "h1", "sender"), ("a", "h2", "sender"), ("a", "h5", "sender"),
        ("b", "h6", "receiver"), ("b", "h3", "sender"), ("b", "h4", "sender")]
    h5 = _schedule(specs[2])
    # h5 targets streams 0 (from h1) and 1 (from h2) and initiates stream 2 to h1
    assert [(r["stream"], r["peer_host"]) for r in h5["in"]] == [(0, "h1"), (1, "h2")]
    assert [(r["stream"], r["peer"]) for r in h5["out"]] == [(2, host_address(plan, "h1"))]
    assert h5["tclass"] == {"name": "uet", "tc": 2, "lossless": False, "ecn": True,
                            "trim": False}
    # stream numbers run across entries; both ends of a stream hold the same row
    b = [_schedule(s) for s in specs[3:]]
    assert [r["stream"] for r in b[0]["in"]] == [3, 4]
    assert b[1]["out"][0]["seed"] == b[0]["in"][0]["seed"]
    assert b[1]["out"][0]["start_ns"] == 10_000 and b[1]["out"][0]["duration_ns"] == 100_000
    for spec in specs:
        out, inc = parse_schedule(_schedule(spec))
        args = uet_main.build_parser().parse_args([*spec.argv, "--schedule", "x.json"])
        assert args.bind == host_address(plan, spec.node)
        assert args.dscp == 18 and args.dilation == 1000
        assert args.payload_bytes == loaded.fabric.roce_mtu_bytes
        opts = uet_main.nic_options(args)
        assert opts["cc"] == ("nscc" if spec.traffic == "a" else "none")
        assert opts["entropy"] == ("spray" if spec.traffic == "a" else "reps")
        assert all(1 <= s.depth <= s.slots for s in out)
    # a host that only receives is waited for; senders are not
    assert [KIND.waits_ready(s) for s in specs] == [False, False, False, True, False, False]


def test_a_region_has_a_slot_per_outstanding_message_and_no_more_than_it_needs() -> None:
    assert slots_and_depth(64 << 20, 1, 256, 4096) == (1, 1)          # one 64 MiB WRITE
    slots, depth = slots_and_depth(65536, None, 256, 4096)
    assert slots == 128 and depth == 256 // 16 + 1
    assert slots_and_depth(1 << 20, 4, 1024, 4096) == (4, 4)


def test_a_sprayed_initiator_asks_for_an_equal_share_of_ports_on_each_spine() -> None:
    loaded, plan = _load(PAIRS.replace("tclass: uet}", "tclass: uet, entropies: 12}", 1))
    specs = expand_workload(loaded.fabric, plan)
    pins = KIND.path_pins(specs)
    assert [(p.sender, p.dst, p.via, p.count, p.dport) for p in pins][:2] == [
        ("a-h1", "h5", ("spine1",), 6, UET_UDP_PORT), ("a-h1", "h5", ("spine2",), 6,
                                                       UET_UDP_PORT)]
    assert {p.sender for p in pins} == {"a-h1", "a-h2", "a-h5", "b-h3", "b-h4"}
    h1 = next(s for s in specs if s.name == "a-h1")
    given = KIND.pinned(KIND.pinned(h1, [49152, 49155]), [49153])
    args = uet_main.build_parser().parse_args([*given.argv, "--schedule", "x"])
    opts = uet_main.nic_options(args)
    assert opts["sports"] == (49152, 49155, 49153) and opts["entropies"] == 3
    # hosts on one leaf: one path, nothing to balance; hashed: never
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h2]], messages: 1, "
                         "tclass: uet}\n")
    assert KIND.path_pins(expand_workload(loaded.fabric, plan)) == []
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], messages: 1, "
                         "tclass: uet, entropy_paths: hashed}\n")
    assert KIND.path_pins(expand_workload(loaded.fabric, plan)) == []
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], messages: 1, "
                         "tclass: uet, entropies: 1}\n")    # fewer ports than spines
    assert KIND.path_pins(expand_workload(loaded.fabric, plan)) == []


@pytest.mark.parametrize(("entry", "expected"), [
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], messages: 1}",
     "no traffic class has trim: true, so a uet entry needs tclass:"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], messages: 1, tclass: default}",
     "class 'default' (TC0) does not mark ECN, so NSCC never sees a congestion mark"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], messages: 1, tclass: nosuch}",
     "unknown traffic class 'nosuch'"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], tclass: uet}",
     "uet_pairs needs duration: (post messages for that long) or messages:"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], tclass: uet, messages: 2, duration: 1ms}",
     "duration and messages are both given"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2], [h1, h2]], tclass: uet, messages: 2}",
     "[h1, h2] is listed twice"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], tclass: uet, messages: 2, size: 2GiB}",
     "outside 1 B .. 1 GiB"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], tclass: uet, messages: 2, entropy: ecmp}",
     "entropy"),
    ("{name: e, kind: uet_pairs, pairs: [[h1, h2]], tclass: uet, messages: 2, cc: dcqcn}",
     "cc"),
])
def test_config_problems_say_what_to_do(entry: str, expected: str) -> None:
    lines = _problems(f"    - {entry}\n")
    assert any(expected in line for line in lines), lines


def test_a_credit_or_windowed_stream_needs_no_ecn_class() -> None:
    for cc in ("credit", "none"):
        loaded, _ = _load(f"    - {{name: e, kind: uet_pairs, pairs: [[h1, h2]], messages: 1, "
                          f"tclass: default, cc: {cc}}}\n")
        assert loaded.fabric.workload is not None


def test_two_uet_entries_on_one_host_are_refused_with_the_hosts_named() -> None:
    lines = _problems("""\
    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], messages: 1, tclass: uet}
    - {name: b, kind: uet_incast, senders: [h2, h3], receiver: h5, messages: 1, tclass: uet}
""")
    msg = [line for line in lines if "UET NIC" in line]
    assert len(msg) == 1 and "workload.traffic[1]" in msg[0], lines
    assert ("the UET NIC of uet streams on h5 binds udp 4793, which the UET NIC of uet "
            "streams of entry 'a' binds there already") in msg[0]


@dataclass
class _Class:
    name: str
    tc: int
    ecn: bool = True
    lossless: bool = False
    trim: bool = False


def test_the_default_class_is_the_one_that_trims() -> None:
    one = {"uet": _Class("uet", 2, trim=True), "default": _Class("default", 0, ecn=False)}
    t = uet_kind.UetTraffic.model_validate({"name": "e", "kind": "uet_pairs",
                                            "pairs": [["h1", "h2"]], "messages": 1})
    c, why = resolve_class(t, one)
    assert c is not None and c.name == "uet" and why is None
    two = {**one, "u2": _Class("u2", 4, trim=True)}
    c, why = resolve_class(t, two)
    assert c is None and why is not None and "several classes trim (uet, u2)" in why


# -- the agent over a fake NIC ----------------------------------------------------------

class _Wall:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


class FakeNet:
    """In-memory UET NICs: a posted message reaches its target whole, in a random order
    among what is outstanding, then completes at the initiator."""

    def __init__(self, seed: int = 7) -> None:
        self.nics: dict[str, FakeNic] = {}
        self.pending: list[tuple] = []
        self.rng = random.Random(seed)
        self.wall = _Wall()
        self.corrupt: set[tuple[int, int]] = set()   # (memory key or match bits, offset)


class FakeNic:
    def __init__(self, net: FakeNet, ip: str) -> None:
        self.net, self.ip = net, ip
        net.nics[ip] = self
        self.regions: dict[int, np.ndarray] = {}
        self.on_message = None
        self.on_write = None
        self.next_id = 0
        self.sent = 0
        self.pdc: dict[str, dict] = {}

    def register(self, key, buf) -> None:
        self.regions[key] = buf

    def _post(self, kind, peer, a, offset, data, on_done) -> int:
        self.next_id += 1
        self.net.pending.append((kind, self.ip, peer, a, offset, bytes(data), on_done,
                                 self.next_id))
        p = self.pdc.setdefault(peer, {"tx_packets": 0, "sports": {}})
        n = -(-len(data) // 4096) or 1
        p["tx_packets"] += n
        for k in range(n):
            p["sports"][0xD000 + (p["tx_packets"] + k) % 4] = 1
        return self.next_id

    def write(self, peer, key, offset, data, *, on_done=None) -> int:
        return self._post("write", peer, key, offset, data, on_done)

    def send(self, peer, match_bits, data, *, on_done=None) -> int:
        return self._post("send", peer, match_bits, 0, data, on_done)

    def step(self) -> bool:
        net = self.net
        mine = [i for i, p in enumerate(net.pending) if p[2] == self.ip]
        net.wall.ns += 100
        if not mine:
            return False
        kind, src, _dst, a, offset, data, on_done, mid = net.pending.pop(net.rng.choice(mine))
        buf = bytearray(data)
        if (a, offset) in net.corrupt and buf:
            buf[len(buf) // 2] ^= 0xFF
        p = self.pdc.setdefault(src, {"rx_packets": 0})
        p["rx_packets"] = p.get("rx_packets", 0) + (-(-len(buf) // 4096) or 1)
        if kind == "write":
            self.regions[a][offset:offset + len(buf)] = np.frombuffer(bytes(buf), np.uint8)
            self.on_write(src, a, offset, len(buf))
        else:
            self.on_message(src, a, mid, memoryview(bytes(buf)))
        if on_done is not None:
            on_done(mid)
        return True

    def wait(self, max_wall_ns: int = 0) -> None:
        self.net.wall.ns += max(1, max_wall_ns)

    def idle(self) -> bool:
        return not any(p[1] == self.ip for p in self.net.pending)

    def counters(self) -> dict:
        totals = {"rx_packets": sum(p.get("rx_packets", 0) for p in self.pdc.values())}
        return {"local": {"ip": self.ip}, "pdcs": self.pdc, "totals": totals, "sockets": {}}

    def close(self) -> None:
        pass


def _hosts(specs, plan, net: FakeNet) -> dict[str, UetHost]:
    d = Dilation(1)
    hosts = {}
    for spec in specs:
        out, inc = parse_schedule(_schedule(spec))
        nic = FakeNic(net, host_address(plan, spec.node))
        hosts[spec.name] = UetHost(nic, out, inc, FabricClock(d, wall_ns=net.wall), d,
                                   Lifecycle(watch_parent=False), rto_ns=1000)
    for h in hosts.values():
        h.start(None)
    return hosts


def _drive(hosts: dict[str, UetHost], limit: int = 200_000) -> None:
    for _ in range(limit):
        busy = [h.poll() for h in hosts.values()]
        if all(h.streams_done() for h in hosts.values()):
            return
        if not any(busy):
            next(iter(hosts.values())).nic.wait(1000)
    raise AssertionError("streams never finished")


def _outputs(hosts: dict[str, UetHost]) -> dict[str, dict]:
    res = {}
    for name, h in hosts.items():
        c = h.nic.counters()
        outs, ins = h.records(c["pdcs"])
        res[name] = {"role": "uet", "streams_out": outs, "streams_in": ins,
                     "verified": h.verified(), "nic": c, "stopped_by": "done", "error": None}
    return res


def test_write_and_send_streams_arrive_byte_exact_in_any_order_and_rows_say_so() -> None:
    loaded, plan = _load(PAIRS)
    specs = expand_workload(loaded.fabric, plan)
    net = FakeNet()
    hosts = _hosts(specs, plan, net)
    _drive(hosts)
    results = _outputs(hosts)
    assert all(h.verified() in (True, None) for h in hosts.values())
    # the duration streams learnt their count from the last SEND
    h6 = hosts["b-h6"]
    assert all(st.expected == st.received > 0 for st in h6.inc.values())
    rows = KIND.result_rows(specs, results, run_view(plan, Path("/nonexistent"), 0))
    assert [(r.traffic, r.fields["src"], r.fields["dst"]) for r in rows] == [
        ("a", "h1", "h5"), ("a", "h2", "h5"), ("a", "h5", "h1"), ("b", "h3", "h6"),
        ("b", "h4", "h6")]
    for r in rows:
        assert list(r.fields) == list(KIND.result_fields)
        assert r.fields["verified"] is True and r.fields["error"] is None, r.fields
        assert r.fields["gbps"] > 0 and r.fields["time_us"] > 0
        assert r.fields["end_us"] == pytest.approx(r.fields["start_us"] + r.fields["time_us"],
                                                   abs=0.002)
    a = rows[0].fields
    assert a["bytes"] == 4 * 1_000_000 and a["messages"] == 4 and a["test"] == "write_bw"
    assert a["cc"] == "nscc" and a["entropy"] == "spray" and a["entropies"] == 16
    assert a["sports"] == 4 and a["tx_packets"] == 4 * 245 + 1
    b = rows[3].fields
    assert b["test"] == "send_bw" and b["messages"] > 1 and b["start_us"] >= 10
    accounts = KIND.stream_accounts(specs, results, [], run_view(plan, Path("/x"), 0))
    assert [(x["src"], x["dst"], x["complete"]) for x in accounts][:1] == [("h1", "h5", True)]
    assert accounts[0]["sent"] == a["tx_packets"] and accounts[0]["reordered"] == 0


def test_a_corrupted_byte_is_caught_and_named() -> None:
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], size: 100KB, "
                         "messages: 3, tclass: uet}\n")
    specs = expand_workload(loaded.fabric, plan)
    net = FakeNet()
    net.corrupt.add((KEY_BASE + 0, 100_000))         # message 1, slot 1
    hosts = _hosts(specs, plan, net)
    _drive(hosts)
    target = hosts["a-h5"]
    assert target.verified() is False
    mismatch = target.inc[0].mismatch
    assert mismatch == {"message": 1, "offset": 50_000, "length": 100_000,
                        "expected_length": 100_000}
    results = _outputs(hosts)
    view = run_view(plan, Path("/nonexistent"), 0)
    rows = KIND.result_rows(specs, results, view)
    assert rows[0].fields["verified"] is False
    notes = KIND.fidelity_notes(specs, results, view)
    assert any("did not arrive byte-exact" in n and "'message': 1" in n for n in notes), notes


def test_slots_are_reused_only_after_their_message_was_checked() -> None:
    """More messages than slots, completing in random order: message k is always checked
    against its own pattern (its slot's n-th completion)."""
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], size: 4MiB, "
                         "messages: 9, tclass: uet, window: 4096}\n")
    specs = expand_workload(loaded.fabric, plan)
    doc = _schedule(next(s for s in specs if s.node == "h1"))
    assert doc["out"][0]["slots"] == 2 and doc["out"][0]["depth"] == 2
    hosts = _hosts(specs, plan, FakeNet(seed=3))
    _drive(hosts)
    st = hosts["a-h5"].inc[0]
    assert st.verified() is True and st.verified_ok == 9 and st.slot_count == [5, 4]


def test_the_last_send_carries_the_count_and_a_stranger_is_not_taken() -> None:
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], size: 4KB, "
                         "duration: 5us, tclass: uet, test: send_bw}\n")
    specs = expand_workload(loaded.fabric, plan)
    hosts = _hosts(specs, plan, FakeNet())
    target = hosts["a-h5"]
    target._on_message("198.18.9.9", 0 << 32 | 0, 1, memoryview(b"x"))  # a stranger
    assert target.inc[0].wrong_peer == 1 and target.inc[0].received == 0
    _drive(hosts)
    sent = hosts["a-h1"].out[0].posted
    assert target.inc[0].expected == sent == target.inc[0].verified_ok
    assert target.inc[0].spec.match_bits(DONE_INDEX) == 0xFFFFFFFF


def test_unfinished_streams_and_agents_that_left_nothing_are_noted() -> None:
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], size: 1MB, "
                         "messages: 4, tclass: uet}\n")
    specs = expand_workload(loaded.fabric, plan)
    hosts = _hosts(specs, plan, FakeNet())
    for _ in range(3):
        for h in hosts.values():
            h.poll()
    results = _outputs(hosts)
    view = run_view(plan, Path("/nonexistent"), 0)
    notes = KIND.fidelity_notes(specs, results, view)
    assert any("stream h1 -> h5 had not finished" in n for n in notes), notes
    row = KIND.result_rows(specs, results, view)[0].fields
    assert row["error"] == "unfinished" and row["verified"] is None
    notes = KIND.fidelity_notes(specs, {}, view)
    assert any("left no results" in n for n in notes)
    results["a-h1"]["streams_out"][0]["start_late_ns"] = 12_000
    results["a-h5"]["udp_rcvbuf_errors"] = 77
    notes = KIND.fidelity_notes(specs, results, view)
    assert any("posted its first message 12.0 us (fabric) after its start" in n
               for n in notes), notes
    assert any("77 datagrams to h5 were dropped by full UDP receive buffers" in n
               for n in notes), notes


def test_the_namespace_udp_receive_buffer_drops_are_read(tmp_path) -> None:
    from agents.uet.host import udp_rcvbuf_errors

    snmp = tmp_path / "snmp"
    snmp.write_text("Ip: Forwarding\nIp: 1\nUdp: InDatagrams NoPorts InErrors OutDatagrams "
                    "RcvbufErrors SndbufErrors\nUdp: 10 0 3 9 3 0\n")
    assert udp_rcvbuf_errors(str(snmp)) == 3
    assert udp_rcvbuf_errors(str(tmp_path / "none")) is None


def test_no_pause_anywhere_is_said_plainly_with_the_class() -> None:
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], size: 1MB, "
                         "messages: 2, tclass: uet}\n")
    specs = expand_workload(loaded.fabric, plan)
    hosts = _hosts(specs, plan, FakeNet())
    _drive(hosts)
    results = _outputs(hosts)
    notes = KIND.fidelity_notes(specs, results, run_view(plan, Path("/x"), 0))
    assert any("no PFC pause frame reached any port" in n and "class uet (TC2), lossy" in n
               for n in notes), notes
    paused = run_view(plan, Path("/x"), 0, paused_nodes=frozenset({"leaf1"}))
    assert not any("PFC" in n for n in KIND.fidelity_notes(specs, results, paused))


def test_the_kind_and_the_agent_number_keys_and_the_last_send_alike() -> None:
    assert uet_kind.UET_KEY_BASE == KEY_BASE and uet_kind.DONE_INDEX == DONE_INDEX


def test_pattern_is_a_function_of_seed_and_index() -> None:
    assert pattern(1, 0, 64) == pattern(1, 0, 64)
    assert pattern(1, 0, 64) != pattern(1, 1, 64) != pattern(2, 1, 64)


def test_docs_cover_every_field_and_result_column() -> None:
    text = (REPO / "docs" / "uet.md").read_text()
    for name, f in uet_kind.UetTraffic.model_fields.items():
        assert f"`{f.alias or name}`" in text, name
    for column in KIND.result_fields:
        assert f"`{column}`" in text, column
    for link in ("uet-wire.md", "uet-cc.md", "uet-transport.md", "datapath.md", "roce.md"):
        assert link in text


def _loopback_run(tmp_path, test: str, extra: list[str], size: int = 256 << 10,
                  messages: int = 8) -> tuple[dict, dict]:
    """Two agents over the real NIC on loopback (127.0.0.1 -> 127.0.0.2, D = 1, a 1 Gb/s
    NIC): the initiator's and the target's final JSON."""
    import subprocess
    import sys
    import time

    pytest.importorskip("agents.uet.nic")
    row = {"stream": 0, "test": test, "size": size, "messages": messages, "slots": 4,
           "seed": 5, "verify": True}
    docs = {"a": {"out": [{**row, "peer": "127.0.0.2", "peer_host": "b", "start_ns": 0,
                           "duration_ns": None, "depth": 4}], "in": []},
            "b": {"out": [], "in": [{**row, "peer": "127.0.0.1", "peer_host": "a"}]}}
    # D = 1 and a 20 ms RTO: a loaded machine must not make the RTO fire before an ACK
    common = ["--line-rate-bps", "1e9", "--dilation", "1", "--payload-bytes", "4096",
              "--rto-ns", "2e7",
              "--entropies", "4", *extra]
    procs = {}
    for name, ip in (("b", "127.0.0.2"), ("a", "127.0.0.1")):
        (tmp_path / f"{name}.json").write_text(json.dumps(docs[name]))
        argv = [sys.executable, "-m", "agents.uet", "--schedule", str(tmp_path / f"{name}.json"),
                "--bind", ip, "--out", str(tmp_path / f"{name}.out.json"),
                "--ready-file", str(tmp_path / f"{name}.ready"), *common]
        if name == "a":
            argv += ["--start-at-mono-ns", str(time.monotonic_ns() + 300_000_000)]
        procs[name] = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
        if name == "b":
            deadline = time.monotonic() + 20
            while not (tmp_path / "b.ready").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
    try:
        _out, err = procs["a"].communicate(timeout=60)
        assert procs["a"].returncode == 0, err
    finally:
        procs["b"].terminate()
        procs["b"].communicate(timeout=20)
    return (json.loads((tmp_path / "a.out.json").read_text()),
            json.loads((tmp_path / "b.out.json").read_text()))


@pytest.mark.parametrize("test", ["write_bw", "send_bw"])
def test_the_agent_moves_every_byte_over_the_real_nic_on_loopback(tmp_path, test) -> None:
    a, b = _loopback_run(tmp_path, test, ["--cc", "none"])
    (out,) = a["streams_out"]
    (inc,) = b["streams_in"]
    assert out["done"] and out["messages"] == 8 and out["bytes"] == 8 * (256 << 10), out
    assert inc["done"] and inc["verified"] is True and inc["verified_messages"] == 8, inc
    assert a["stopped_by"] == "done" and b["verified"] is True
    assert len(out["sports"]) == 4


def test_the_agent_recovers_injected_loss_on_loopback(tmp_path) -> None:
    a, b = _loopback_run(tmp_path, "write_bw", ["--cc", "none", "--drop-prob", "0.02"],
                         messages=16)
    (out,) = a["streams_out"]
    (inc,) = b["streams_in"]
    assert inc["verified"] is True and out["retransmissions"] > 0, (out, inc)


def test_drops_beyond_the_missing_data_are_the_control_packets_sharing_its_ports() -> None:
    """The port programs count drops by 5-tuple; a lost credit request shares the data's:
    the account leaves it out instead of finding more packets than were sent."""
    loaded, plan = _load("    - {name: a, kind: uet_pairs, pairs: [[h1, h5]], size: 1MB, "
                         "messages: 2, tclass: uet, cc: credit}\n")
    specs = expand_workload(loaded.fabric, plan)
    hosts = _hosts(specs, plan, FakeNet())
    _drive(hosts)
    results = _outputs(hosts)
    out = results["a-h1"]["streams_out"][0]
    inc = results["a-h5"]["streams_in"][0]
    out.update(tx_packets=500, control_sent=3)
    inc.update(rx_packets=490)
    view = run_view(plan, Path("/x"), 0)
    drop = {"saddr": host_address(plan, "h1"), "daddr": host_address(plan, "h5"),
            "dport": UET_UDP_PORT, "proto": 17, "sport": 49152, "phy": 11, "tail": 0,
            "mmu": 0, "desc": 0}
    (acct,) = KIND.stream_accounts(specs, results, [drop], view)
    assert acct["fabric_drops"] == 10 and acct["control_drops"] == 1
    assert acct["sent"] - acct["received"] - acct["fabric_drops"] == 0
    drop["phy"] = 20                      # more than control can explain: left for the check
    (acct,) = KIND.stream_accounts(specs, results, [drop], view)
    assert acct["control_drops"] == 3 and acct["fabric_drops"] == 17


def test_with_one_trimming_class_it_is_the_default_and_its_trim_dscp_is_passed() -> None:
    text = FABRIC.replace("{{tc: 2, name: uet, dscp: [18], ecn: true}}",
                          "{{tc: 2, name: uet, dscp: [18], ecn: true, trim: true}}")
    loaded = load_config_text(text.format(traffic="    - {name: a, kind: uet_pairs, "
                                                  "pairs: [[h1, h5]], messages: 1}\n"),
                              "uet.yaml")
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    assert _schedule(specs[0])["tclass"]["name"] == "uet"
    assert _schedule(specs[0])["tclass"]["trim"] is True
    args = uet_main.build_parser().parse_args([*specs[0].argv, "--schedule", "x"])
    assert args.dscp == 18 and args.trim_dscp == plan.trim_dscp(2) == 48
