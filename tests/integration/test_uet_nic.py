"""Two UetNics in two namespaces joined by a veth pair: WRITE and SEND of 8 MiB arrive
byte-exact under injected loss with every congestion control, spraying uses every
entropy (source port) and oblivious mode one, and a trimmed packet is NACKed at once;
and a 2:1 incast through a real trimming switch port recovers by NACKs alone.

Both NICs live in this process: each one's sockets are made inside its namespace
(pyroute2's pushns/popns), then one loop steps both."""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from pyroute2 import IPRoute, netns

from agents.timebase import Dilation, FabricClock
from agents.uet.nic import UetNic, UetOptions, initial_psn, pdc_id
from agents.wire.uet import UET_UDP_PORT, Request, SesOpcode, SesRequest, pack_request, parse
from tests.conftest import REPO

pytestmark = pytest.mark.root

A_IP, B_IP = "198.18.253.0", "198.18.253.1"
MTU_BYTES = 9000
SIZE = 8 << 20
DSCP = 10
TRIM_DSCP = 46
D1 = Dilation(1)
# At D = 1 a Python engine's round trip is hundreds of us: give NSCC a base RTT and line
# rate it can live with, and an RTO well above the engine's latency.
BASE = dict(dscp=DSCP, line_rate_bps=10e9, base_rtt_ns=500_000.0, rto_ns=20e6, entropies=8,
            spin_ns=0)


@pytest.fixture
def pair() -> Iterator[tuple[str, str]]:
    """Namespaces tb-uet<pid>-a / -b joined by veth u0 (A_IP) <-> u1 (B_IP); removed."""
    stem = f"tb-uet{os.getpid()}-"
    a, b = stem + "a", stem + "b"
    made: list[str] = []
    try:
        for name in (a, b):
            netns.create(name)
            made.append(name)
        with IPRoute(netns=a) as ipr:
            ipr.link("add", ifname="u0", kind="veth", peer={"ifname": "u1", "net_ns_fd": b})
        for name, ifname, address in ((a, "u0", A_IP), (b, "u1", B_IP)):
            with IPRoute(netns=name) as ipr:
                idx = ipr.link_lookup(ifname=ifname)[0]
                ipr.link("set", index=idx, mtu=MTU_BYTES)
                ipr.addr("add", index=idx, address=address, prefixlen=31)
                ipr.link("set", index=idx, state="up")
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        yield a, b
    finally:
        for name in made:
            netns.remove(name)
        left = [n for n in netns.listnetns() if n.startswith(stem)]
        assert not left, f"namespaces left behind: {left}"


def _nic(ns: str, ip: str, clock: FabricClock, **opts) -> UetNic:
    netns.pushns(ns)
    try:
        return UetNic(ip, clock, D1, UetOptions(**{**BASE, **opts}))
    finally:
        netns.popns()


def _drive(nics: list[UetNic], done, timeout_s: float = 25.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not done in {timeout_s} s: "
                                 f"{[n.counters()['totals'] for n in nics]}")
        busy = False
        for n in nics:
            busy = n.step() or busy
        if not busy:
            select.select([n.rx_sock for n in nics], [], [], 0.0005)
        for n in nics:
            assert not n.errors, n.errors


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("cc", ["nscc", "credit", "none"])
def test_8_mib_by_write_lands_byte_exact_under_injected_loss(pair, cc):
    clock = FabricClock(D1)
    a = _nic(pair[0], A_IP, clock, cc=cc, drop_prob=0.01)
    b = _nic(pair[1], B_IP, clock, cc=cc, drop_prob=0.01)
    try:
        region = np.zeros(SIZE + 100, dtype=np.uint8)
        b.register(5, region)
        writes, done = [], []
        b.on_write = lambda peer, key, off, n: writes.append((peer, key, off, n))
        data = _pattern(SIZE, 1)
        half = SIZE // 2
        a.write(B_IP, 5, 100, data[:half], on_done=done.append)
        a.write(B_IP, 5, 100 + half, data[half:], on_done=done.append)
        _drive([a, b], lambda: len(done) == 2 and a.idle())
        assert np.array_equal(region[100:], data) and not region[:100].any()
        assert sorted(writes) == [(A_IP, 5, 100, half), (A_IP, 5, 100 + half, half)]
        ta, tb = a.counters()["totals"], b.counters()["totals"]
        assert ta["injected_drops"] > 0
        assert ta["retransmissions"] >= ta["injected_drops"]
        assert tb["duplicates"] <= ta["retransmissions"]
        assert tb["malformed"] == 0 and ta["malformed"] == 0
        if cc == "credit":
            assert tb["credits_granted"] > 0 and ta["credits_received"] > 0
        if cc == "nscc":
            assert ta["cwnd_bytes"] > 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("cc", ["nscc", "credit", "none"])
def test_8_mib_by_send_arrives_whole_in_order_per_tag_under_injected_loss(pair, cc):
    clock = FabricClock(D1)
    a = _nic(pair[0], A_IP, clock, cc=cc, drop_prob=0.01)
    b = _nic(pair[1], B_IP, clock, cc=cc, drop_prob=0.01)
    try:
        got: list[tuple[str, int, int, bytes]] = []
        b.on_message = lambda peer, tag, mid, data: got.append((peer, tag, mid, bytes(data)))
        chunks = [_pattern(SIZE // 8, k) for k in range(8)]
        done: list[int] = []
        for k, c in enumerate(chunks):
            a.send(B_IP, 7 if k % 2 else 9, c, on_done=done.append)
        _drive([a, b], lambda: len(got) == 8 and a.idle())
        for tag in (7, 9):
            mine = [x for x in got if x[1] == tag]
            assert [x[3] for x in mine] == [chunks[k].tobytes() for k in range(8)
                                            if (7 if k % 2 else 9) == tag]
            assert [x[2] for x in mine] == sorted(x[2] for x in mine)
        assert sorted(done) == list(range(8))
        assert a.counters()["totals"]["injected_drops"] > 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode,ports", [("spray", 8), ("oblivious", 1), ("reps", None)])
def test_spray_uses_every_entropy_and_oblivious_one(pair, mode, ports):
    clock = FabricClock(D1)
    a = _nic(pair[0], A_IP, clock, cc="none", entropy=mode)
    b = _nic(pair[1], B_IP, clock, cc="none")
    try:
        region = bytearray(1 << 20)
        b.register(1, region)
        done: list[int] = []
        a.write(B_IP, 1, 0, bytes(range(256)) * 4096, on_done=done.append)
        _drive([a, b], lambda: bool(done) and a.idle())
        sports = a.counters()["totals"]["sports"]
        if ports is not None:
            assert len(sports) == ports
        else:       # reps: clean ACKs recycle the entropies it explored first
            ent = a.counters()["pdcs"][B_IP]["entropy"]
            assert ent["reused"] > ent["explored"]
        assert set(sports) <= set(a.sports) and len(a.sports) == 8
        assert sum(sports.values()) == a.counters()["totals"]["tx_packets"]
        assert region == bytes(range(256)) * 4096
    finally:
        a.close()
        b.close()


def test_a_taken_entropy_port_is_skipped(pair):
    clock = FabricClock(D1)
    netns.pushns(pair[0])
    try:
        squat = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        squat.bind((A_IP, 0xD001))
    finally:
        netns.popns()
    try:
        a = _nic(pair[0], A_IP, clock, entropies=4)
        try:
            assert a.sports == [0xD000, 0xD002, 0xD003, 0xD004]
            assert a.skipped_ports == [0xD001]
        finally:
            a.close()
    finally:
        squat.close()


def test_a_trimmed_packet_is_nacked_at_once_and_not_delivered(pair):
    clock = FabricClock(D1)
    b = _nic(pair[1], B_IP, clock, cc="none", trim_dscp=TRIM_DSCP)
    netns.pushns(pair[0])
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((A_IP, UET_UDP_PORT))
    finally:
        netns.popns()
    try:
        psn0 = initial_psn(A_IP, B_IP)
        ses = SesRequest(int(SesOpcode.SEND), True, False, 0, 8192, memory_key=3,
                         payload_length=4096)
        full = pack_request(Request(psn0, pdc_id(B_IP), pdc_id(A_IP)), ses, bytes(4096))
        s.sendto(full[:100], (B_IP, UET_UDP_PORT))          # cut short: trimmed
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, TRIM_DSCP << 2)
        s.sendto(full, (B_IP, UET_UDP_PORT))                 # whole, but in the trim DSCP
        s.settimeout(5)
        nacks = []
        deadline = time.monotonic() + 5
        while len(nacks) < 2 and time.monotonic() < deadline:
            b.step()
            try:
                nacks.append(parse(s.recv(2048)).pds)
            except (TimeoutError, BlockingIOError):
                pass
            s.settimeout(0.01)
        assert [(n.nack_code, n.nack_psn) for n in nacks] == [(1, psn0), (1, psn0)]
        t = b.counters()["totals"]
        assert t["trims_received"] == 2 and t["nacks_sent"] == 2 and t["acks_sent"] == 0
        assert b.pdcs[A_IP].rx.cack == psn0 - 1          # nothing was received
    finally:
        s.close()
        b.close()


def test_a_peer_that_never_answers_fails_the_pdc_after_the_retry_limit(pair):
    clock = FabricClock(D1)
    a = _nic(pair[0], A_IP, clock, cc="none", rto_ns=2e6, max_retries=2)
    try:
        failed: list[tuple[str, str]] = []
        a.on_error = lambda peer, why: failed.append((peer, why))
        done: list[int] = []
        a.write(B_IP, 1, 0, bytes(10_000), on_done=done.append)   # nobody on B:4793
        deadline = time.monotonic() + 10
        while not failed and time.monotonic() < deadline:
            if not a.step():
                a.wait()
        assert failed and failed[0][0] == B_IP
        assert "after 2 retransmissions on timeout" in failed[0][1]
        assert a.errors == [failed[0][1]] and a.idle() and not done
        c = a.counters()
        assert c["pdcs"][B_IP]["error"] == failed[0][1] and c["totals"]["errors"] == 1
        # 3 packets, each timed out twice and resent, then the third timeout of the first
        assert c["pdcs"][B_IP]["timeouts"] == 3 * 2 + 1
        assert c["pdcs"][B_IP]["rto_retransmissions"] == 3 * 2
    finally:
        a.close()


def test_every_counter_is_documented(pair):
    doc = (REPO / "docs" / "uet-transport.md").read_text()
    clock = FabricClock(D1)
    a = _nic(pair[0], A_IP, clock, cc="credit")
    b = _nic(pair[1], B_IP, clock, cc="credit")
    try:
        b.register(1, bytearray(1 << 16))
        done: list[int] = []
        a.write(B_IP, 1, 0, bytes(1 << 16), on_done=done.append)
        _drive([a, b], lambda: bool(done))
        for nic in (a, b):
            c = nic.counters()
            keys = set(c) | set(c["totals"]) | set(c["sockets"])
            for pdc in c["pdcs"].values():
                keys |= set(pdc)
            missing = sorted(k for k in keys if f"`{k}`" not in doc)
            assert not missing, f"counters not in docs/uet-transport.md: {missing}"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("cc", ["nscc", "credit", "none"])
def test_both_directions_at_30_percent_loss_finish_and_resend_only_what_was_lost(pair, cc):
    # Credit lost with lost packets must be written off at the target, or a sender that
    # needs credit waits for ever (a CREDIT_REQ runs the write-off).
    clock = FabricClock(D1)
    a = _nic(pair[0], A_IP, clock, cc=cc, drop_prob=0.3, rto_ns=5e6, max_retries=20)
    b = _nic(pair[1], B_IP, clock, cc=cc, drop_prob=0.3, rto_ns=5e6, max_retries=20, seed=2)
    try:
        there, back = np.zeros(2 << 20, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
        b.register(5, there)
        a.register(9, back)
        got: list[bytes] = []
        b.on_message = lambda peer, tag, mid, data: got.append(bytes(data))
        data = _pattern(2 << 20, 3)
        msgs = [_pattern(50_000, k).tobytes() for k in range(10)]
        done_a: list[int] = []
        done_b: list[int] = []
        a.write(B_IP, 5, 0, data, on_done=done_a.append)
        for m in msgs:
            a.send(B_IP, 1, m, on_done=done_a.append)
        b.write(A_IP, 9, 0, data[:1 << 20], on_done=done_b.append)
        _drive([a, b], lambda: len(done_a) == 11 and bool(done_b) and a.idle() and b.idle())
        assert np.array_equal(there, data) and np.array_equal(back, data[:1 << 20])
        assert got == msgs
        for nic in (a, b):
            t = nic.counters()["totals"]
            assert t["injected_drops"] > 0
            # a retransmission that answers no loss can only come from a timeout that
            # fired while the packet (or its ACK) was still on its way
            assert t["injected_drops"] <= t["retransmissions"] \
                <= t["injected_drops"] + t["rto_retransmissions"]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("cc", ["nscc", "credit", "none"])
def test_trimmed_packets_are_nacked_and_resent_once_each(pair, cc):
    clock = FabricClock(D1)
    a = _nic(pair[0], A_IP, clock, cc=cc, trim_prob=0.05)
    b = _nic(pair[1], B_IP, clock, cc=cc)
    try:
        region = np.zeros(4 << 20, dtype=np.uint8)
        b.register(2, region)
        data = _pattern(4 << 20, 11)
        done: list[int] = []
        a.write(B_IP, 2, 0, data, on_done=done.append)
        _drive([a, b], lambda: bool(done) and a.idle())
        assert np.array_equal(region, data)
        ta, tb = a.counters()["totals"], b.counters()["totals"]
        assert ta["injected_trims"] > 0
        assert tb["trims_received"] == tb["nacks_sent"] == ta["injected_trims"]
        assert ta["nacks_received"] == ta["injected_trims"]
        # a NACK resends exactly the trimmed PSN, at once, unless another copy of it (a
        # retransmission after a timeout on the loaded machine) was acknowledged first
        stale = a.counters()["pdcs"][B_IP]["sender"]["stale_nacks"]
        assert ta["nack_retransmissions"] + stale == ta["injected_trims"]
        assert stale <= ta["rto_retransmissions"] + ta["sack_retransmissions"]
        assert ta["retransmissions"] == ta["injected_trims"] + ta["rto_retransmissions"] \
            + ta["sack_retransmissions"]
        assert tb["duplicates"] <= ta["rto_retransmissions"] + ta["sack_retransmissions"]
    finally:
        a.close()
        b.close()


def test_packets_left_without_an_ackreq_are_acked_once_the_peer_goes_quiet(pair):
    clock = FabricClock(D1)
    b = _nic(pair[1], B_IP, clock, cc="none", ack_every=4, ack_delay_ns=2e6)
    netns.pushns(pair[0])
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((A_IP, UET_UDP_PORT))
    finally:
        netns.popns()
    try:
        psn0 = initial_psn(A_IP, B_IP)
        for k in range(2):        # 2 of a 4-packet WRITE: no EOM, no ackreq, < ack_every
            ses = SesRequest(int(SesOpcode.WRITE), k == 0, False, 0, 4 * 1024,
                             message_offset=k * 1024, payload_length=1024)
            s.sendto(pack_request(Request(psn0 + k, pdc_id(B_IP), pdc_id(A_IP)), ses,
                                  bytes(1024)), (B_IP, UET_UDP_PORT))
        b.register(0, bytearray(4096))
        s.settimeout(0.001)
        t0 = time.monotonic()
        ack = None
        while ack is None and time.monotonic() < t0 + 5:
            b.step()
            try:
                ack = parse(s.recv(2048)).pds
            except (TimeoutError, BlockingIOError):
                pass
        waited = time.monotonic() - t0
        assert ack is not None and ack.cack_psn == psn0 + 1
        assert waited >= 2e-3                  # not before the ack delay (D = 1: 2 ms)
        c = b.counters()["pdcs"][A_IP]
        assert c["delayed_acks"] == 1 and c["acks_sent"] == 1
    finally:
        s.close()
        b.close()


TRIM_FABRIC = """\
name: {name}
dilation: 1000
topology: {{kind: single_switch, hosts: 3, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
traffic_classes:
  - {{tc: 2, name: uet, dscp: [10], trim: true}}
  - {{tc: 6, name: ctl, dscp: [48], strict: true}}
  - {{tc: 0, name: default, default: true}}
qos:
  default:
    buffer: {{2: 64KB}}
    trim: {{threshold: 32KB}}
"""


def test_a_2_to_1_incast_through_a_trimming_switch_is_recovered_by_nacks_alone():
    # Two senders at line rate into one 100G port (D = 1000: 100 Mb/s of wall rate each)
    # overflow its 32 KB trim threshold; the switch trims instead of dropping, the
    # target NACKs each trimmed packet at once and the senders resend exactly those.
    from testbed.plan.paths import host_address
    from tests.integration.conftest import built_lab

    d = Dilation(1000)
    with built_lab(TRIM_FABRIC, "uettr") as plan:
        clock = FabricClock(d)
        nics = {}
        for h in ("h1", "h2", "h3"):
            netns.pushns(plan.node(h).netns)
            try:
                nics[h] = UetNic(host_address(plan, h), clock, d, UetOptions(
                    dscp=10, cc="none", trim_dscp=48, rto_ns=1e6, spin_ns=0))
            finally:
                netns.popns()
        try:
            dst = host_address(plan, "h3")
            region = np.zeros(2 << 20, dtype=np.uint8)
            nics["h3"].register(1, region)
            data = _pattern(2 << 20, 5)
            done: list[int] = []
            nics["h1"].write(dst, 1, 0, data[:1 << 20], on_done=done.append)
            nics["h2"].write(dst, 1, 1 << 20, data[1 << 20:], on_done=done.append)
            _drive(list(nics.values()), lambda: len(done) == 2, timeout_s=25)
            assert np.array_equal(region, data)
            t = nics["h3"].counters()["totals"]
            senders = [nics[h].counters()["totals"] for h in ("h1", "h2")]
            assert t["trims_received"] > 0 and t["nacks_sent"] == t["trims_received"]
            assert sum(s["nack_retransmissions"] for s in senders) == t["trims_received"]
            assert sum(s["retransmissions"] for s in senders) == t["trims_received"]
            assert t["duplicates"] == 0
        finally:
            for n in nics.values():
                n.close()
