"""The compiled fast path (agents.fast) against the pure-Python reference path.

Send side: two requesters, one driven by `poll_send` (the reference), one by
`fast_send_round` (runs built in C), take the same posts, feedback and clock; every
round must put the same bytes on the wire, packet by packet, and leave both with the
same state (PSNs, window, pacer, timers, counters, completions, rate controller).
Receive side: `RxBatch.parse` must give what `parse_packet` gives for any datagram,
a Parsed packet with the same fields or the same MalformedReason. Then both paths
over real sockets, and the fallback when the extension cannot be used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents import fast
from agents.rdma.cc import DcqcnRp, NoCc, make_cc, preset
from agents.rdma.qp import MemoryRegion, QpAttrs, RcQp, RcRequester
from agents.rdma.transport import SEND_BATCH, Endpoint, Engine, fast_send_round
from agents.timebase import Dilation, FabricClock
from agents.wire.roce import (
    PSN_MASK,
    Aeth,
    Bth,
    MalformedPacket,
    Opcode,
    Parsed,
    Reth,
    encode_packet,
    icrc_context,
    parse_packet,
)
from tests.conftest import REPO

FP = fast.extension()
needs_fast = pytest.mark.skipif(FP is None, reason=f"fast path unavailable: {fast.status()}")

SRC, DST = "10.0.0.1", "10.0.0.2"
SPORT, DPORT = 0xC123, 4791


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(n))


# --------------------------------------------------------------------------- send side

def _cc(kind: str, now: float = 0.0):
    if kind == "none":
        return NoCc(8e9, now)
    if kind == "dctcp":
        # short windows, so they close (and the rate grows) mid-stream
        return make_cc("dctcp", "rfc8257", 8e9, now, {"window_ns": 20_000})
    # DCQCN with a small byte counter and short timers, so rate changes come mid-stream
    params = dataclasses.replace(preset("paper", 8e9), byte_counter_bytes=3000)
    return DcqcnRp(params, 8e9, now)


class _Twins:
    """A reference requester and a fast one, fed the same events."""

    def __init__(self, *, cc: str = "none", psn: int = 0, window: int = 16, mtu: int = 256,
                 ack_req_every: int = 4, burst: int = 1024) -> None:
        attrs = QpAttrs(mtu=mtu, window_packets=window, ack_req_every=ack_req_every,
                        timeout_ns=50_000, max_burst_bytes=burst, retry_cnt=7)
        ctx = icrc_context(SRC, DST, SPORT, DPORT)
        self.ref = RcRequester(0x10, 0x20, ctx, attrs, _cc(cc), psn=psn)
        self.fast = RcRequester(0x10, 0x20, ctx, attrs, _cc(cc), psn=psn)
        self.batch = FP.TxBatch()
        self.now = 0.0
        self.sent = 0

    def post(self, kind: str, n: int, k: int) -> None:
        data = pattern(n, seed=k)
        for r in (self.ref, self.fast):
            if kind == "write":
                r.post_write(k, data, 0x1000 + k * 0x10000, 7)
            elif kind == "write_imm":
                r.post_write_imm(k, data, 0x1000 + k * 0x10000, 7, 0xA0000000 + k)
            else:
                r.post_send(k, data)

    def step(self, dt: float, limit: int = SEND_BATCH) -> None:
        self.now += dt
        now = self.now
        ref_pkts: list[bytes] = []
        for r in (self.ref, self.fast):       # what the engine does first: due timers
            t = r.next_timer_ns()
            if t is not None and t <= now:
                r.on_timer(now)
        for _ in range(limit):
            view = self.ref.poll_send(now)
            if view is None:
                break
            ref_pkts.append(bytes(view))
        fast_pkts: list[bytes] = []
        n = fast_send_round(self.fast, self.batch, now, limit,
                            lambda b: fast_pkts.extend(b.packet(i) for i in range(b.pending))
                            or b.clear(),
                            lambda view: fast_pkts.append(bytes(view)))
        assert n == len(fast_pkts)
        assert len(fast_pkts) == len(ref_pkts), (len(fast_pkts), len(ref_pkts))
        for i, (a, b) in enumerate(zip(ref_pkts, fast_pkts, strict=True)):
            assert a == b, f"packet {i} of the round differs"
        self.sent += len(ref_pkts)
        self.check()

    def ack(self, offset: int, kind: str = "ack") -> None:
        r = self.ref
        span = (r._hi - r.una_psn) & PSN_MASK
        # an offset past what was sent acknowledges all of it (an ACK) or the next PSN;
        # a negative one is stale
        psn = (r.una_psn + min(offset, span) - (1 if kind == "ack" else 0)) & PSN_MASK
        syndrome = {"ack": 0x1F, "nak": 0x60, "rnr": 0x21}[kind]
        for q in (self.ref, self.fast):
            q.on_ack(Bth(Opcode.RC_ACKNOWLEDGE, dest_qp=0x10, psn=psn), Aeth(syndrome, 0),
                     self.now)
        self.check()

    def cnp(self) -> None:
        for q in (self.ref, self.fast):
            q.on_cnp(self.now)
        self.check()

    def check(self) -> None:
        a, b = self.ref, self.fast
        assert b.counters() == a.counters()
        assert b.cc.snapshot() == a.cc.snapshot()
        for name in ("_snd", "_una", "_hi", "_cur", "_cur_idx", "_rto_deadline", "_rnr_until",
                     "_head", "last_was_retransmission"):
            assert getattr(b, name) == getattr(a, name), name
        assert b._pacer._due == a._pacer._due
        assert list(b.completions) == list(a.completions)


@needs_fast
def test_multi_packet_write_imm_and_send_same_bytes_and_state():
    t = _Twins(window=64)
    t.post("write", 256 * 5 + 3, 1)          # FIRST, 4 MIDDLE, LAST with a pad of 1
    t.post("write_imm", 256 * 3, 2)          # FIRST, MIDDLE, LAST WITH IMMEDIATE
    t.post("write_imm", 10, 3)               # ONLY WITH IMMEDIATE, padded
    t.post("send", 256 * 2 + 1, 4)           # SEND FIRST, MIDDLE, LAST
    t.post("send", 0, 5)                     # SEND ONLY, empty
    t.post("write", 0, 6)                    # WRITE ONLY, empty
    while t.sent < 6 + 3 + 1 + 3 + 1 + 1:
        t.step(10_000)
    t.ack(10_000)                            # everything
    assert t.fast.idle and len(t.fast.completions) == 6


@needs_fast
def test_psn_wrap_window_full_and_go_back_n_after_a_nak():
    t = _Twins(psn=PSN_MASK - 5, window=8, burst=1 << 20)
    t.post("write", 256 * 30, 1)
    t.step(10_000)
    assert t.fast.outstanding_packets == 8      # the window is full
    t.step(10_000)
    assert t.sent == 8
    t.ack(3)                                    # acks 3 packets, across the wrap
    t.step(10_000)
    assert t.fast.next_psn < 10                 # wrapped
    t.ack(2, "nak")                             # NAK: resend from una + 2
    t.step(10_000)
    assert t.fast.retransmissions > 0
    t.step(1e6)                                 # the local ACK timeout: go back to una
    assert t.fast.timeouts == 1
    t.ack(100)
    while not t.fast.idle:
        t.step(1e6)
        t.ack(100)


@needs_fast
@pytest.mark.parametrize("cc", ["dcqcn", "dctcp", "none"])
def test_pacing_at_a_finite_rate_with_rate_changes_mid_stream(cc):
    t = _Twins(cc=cc, window=1 << 12, burst=600)
    t.post("write", 256 * 400, 1)
    for i in range(300):
        if i % 37 == 5:
            t.cnp()                         # DCQCN: a cut, then timers and byte events
        t.step(700 + (i * 7919) % 1500)
        if i % 11 == 0:
            t.ack(1 << 20)
    if cc == "dcqcn":
        snap = t.fast.cc.snapshot()
        assert snap["counters"]["byte_events"] > 0 and snap["counters"]["rate_decreases"] > 0


_events = st.lists(st.one_of(
    st.tuples(st.just("step"), st.integers(0, 20_000), st.integers(1, SEND_BATCH)),
    st.tuples(st.just("ack"), st.integers(-3, 40), st.sampled_from(["ack", "nak", "rnr"])),
    st.tuples(st.just("cnp"), st.just(0), st.just(0)),
    st.tuples(st.just("post"), st.integers(0, 256 * 6), st.sampled_from(
        ["write", "write_imm", "send"])),
), min_size=1, max_size=60)


@needs_fast
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=_events, cc=st.sampled_from(["dcqcn", "dctcp", "none"]),
       psn=st.sampled_from([0, PSN_MASK - 3, 12345]), window=st.sampled_from([3, 16, 200]),
       burst=st.sampled_from([0, 300, 16384]))
def test_random_sequences_same_bytes_and_state(events, cc, psn, window, burst):
    t = _Twins(cc=cc, psn=psn, window=window, burst=burst)
    k = 0
    for what, a, b in events:
        if what == "step":
            t.step(a, b)
        elif what == "ack":
            t.ack(a, b)
        elif what == "cnp":
            t.cnp()
        else:
            k += 1
            t.post(b, a, k)


@needs_fast
def test_bulk_budget_is_what_the_byte_counter_allows():
    rp = _cc("dcqcn")
    assert rp.bulk_bytes_budget(0.0) == float("inf")       # no cut yet: no counter
    rp.on_cnp(1.0)
    left = rp.bulk_bytes_budget(2.0)
    assert 0 < left <= 3000
    rate = rp.rate_bps
    rp.on_bytes_sent(int(left) - 1 if left == int(left) else int(left), 2.0)
    assert rp.rate_bps == rate                              # under the budget: no event
    assert rp.bulk_bytes_budget(rp.next_event_ns()) == 0    # a timer due: no promise


@needs_fast
@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=0, max_size=9000), seed=st.integers(0, 0xFFFFFFFF))
def test_the_icrcs_crc32_is_zlibs(data, seed):
    import zlib

    assert FP.crc32(data, seed) == zlib.crc32(data, seed)           # PCLMULQDQ folding
    assert FP.crc32(data, seed, False) == zlib.crc32(data, seed)    # zlib's own


# --------------------------------------------------------------------------- receive side

def _rx():
    return FP.RxBatch(4, DST, DPORT, Parsed, Bth, Reth, Aeth)


def _same(rx, data: bytes) -> None:
    try:
        ref: Parsed | int = parse_packet(data, icrc_context(SRC, DST, SPORT, DPORT))
    except MalformedPacket as e:
        ref = int(e.reason)
    got = rx.parse(data, SRC, SPORT)
    if isinstance(ref, int):
        assert got == ref
        return
    assert not isinstance(got, int), f"C says reason {got}, Python parsed it"
    assert got.bth == ref.bth and type(got.bth) is Bth
    assert got.reth == ref.reth and got.aeth == ref.aeth and got.imm == ref.imm
    assert got.icrc == ref.icrc and bytes(got.payload) == bytes(ref.payload)


def _valid_packets() -> list[bytes]:
    ctx = icrc_context(SRC, DST, SPORT, DPORT)
    out = []
    for op in Opcode:
        for n in (0, 1, 4, 7, 256):
            try:
                out.append(encode_packet(
                    ctx, Bth(int(op), dest_qp=0x20, psn=0xFFFFFE, ack_req=n == 7,
                             becn=op == Opcode.CNP, fecn=n == 1),
                    Reth(0x1234, 7, n) if op in (6, 10, 11, 0x26, 0x2A, 0x2B) else None,
                    Aeth(0x60 if n == 1 else 0x1F, 99) if op == 0x11 else None,
                    pattern(n), imm=0xDEADBEEF if op in (9, 11, 0x29, 0x2B) else None))
            except ValueError:
                continue            # a payload this opcode cannot carry
    return out


@needs_fast
def test_every_opcode_parses_as_the_python_parser_does():
    rx = _rx()
    packets = _valid_packets()
    assert len(packets) > 40
    for data in packets:
        _same(rx, data)
        assert not isinstance(rx.parse(data, SRC, SPORT), int)


@needs_fast
def test_a_payload_outlives_its_receiver_and_is_read_only():
    # The payload is a view of the receiver's slots: kept after the receiver is gone it
    # must still hold memory (a view of freed memory would read garbage or crash).
    import gc
    data = next(d for d in _valid_packets() if len(d) > 200)
    rx = _rx()
    got = rx.parse(data, SRC, SPORT)
    assert not isinstance(got, int)
    want = bytes(got.payload)
    del rx
    gc.collect()
    junk = [bytearray(b"\xa5" * (4 * 65536)) for _ in range(8)]   # reuse freed memory
    assert bytes(got.payload) == want and len(junk) == 8
    assert got.payload.readonly


@needs_fast
def test_each_malformed_reason_as_the_python_parser_counts_it():
    rx = _rx()
    ctx = icrc_context(SRC, DST, SPORT, DPORT)
    good = encode_packet(ctx, Bth(Opcode.RC_RDMA_WRITE_ONLY, dest_qp=0x20), Reth(0, 7, 4),
                         None, b"abcd")
    assert rx.parse(b"short", SRC, SPORT) == 1                      # TOO_SHORT
    bad = bytearray(good)
    bad[20] ^= 1
    assert rx.parse(bytes(bad), SRC, SPORT) == 2                    # BAD_ICRC
    assert rx.parse(good, SRC, SPORT + 1) == 2                      # other sender: other ICRC
    for data in (bytes(bad), b"short", good[:-1], good + b"\0" * 4):
        _same(rx, data)
    # reasons behind a valid ICRC: re-seal mutated packets with the right ICRC
    for mutate, reason in ((lambda b: b.__setitem__(1, 0x01), 3),    # TVer
                           (lambda b: b.__setitem__(0, 0x05), 4),    # unknown opcode
                           (lambda b: b.__setitem__(1, 0x30), 6)):   # PadCnt 3 > payload... ok
        b = bytearray(good[:-4])
        mutate(b)
        sealed = bytes(b) + ctx.icrc(bytes(b)).to_bytes(4, "little")
        _same(rx, sealed)
        if reason != 6:
            assert rx.parse(sealed, SRC, SPORT) == reason
    ack = bytearray(encode_packet(ctx, Bth(Opcode.RC_ACKNOWLEDGE, dest_qp=0x20), None,
                                  Aeth(0x1F, 1))[:-4])
    for syndrome in (0x80, 0x40, 0x5F):                              # reserved syndromes
        ack[12] = syndrome
        sealed = bytes(ack) + ctx.icrc(bytes(ack)).to_bytes(4, "little")
        assert rx.parse(sealed, SRC, SPORT) == 7
        _same(rx, sealed)


def _reseal(data: bytes) -> bytes:
    body = data[:-4]
    if len(body) <= 4:
        return data
    return body + icrc_context(SRC, DST, SPORT, DPORT).icrc(body).to_bytes(4, "little")


@needs_fast
@settings(max_examples=400, deadline=None)
@given(base=st.sampled_from(range(60)), flips=st.lists(
    st.tuples(st.integers(0, 300), st.integers(0, 255)), max_size=4),
    cut=st.integers(-8, 8), reseal=st.booleans())
def test_random_datagrams_parse_the_same(base, flips, cut, reseal):
    packets = _valid_packets()
    data = bytearray(packets[base % len(packets)])
    for pos, val in flips:
        if pos < len(data):
            data[pos] = val
    if cut < 0:
        del data[cut:]
    else:
        data += bytes(cut)
    out = bytes(data)
    _same(_rx(), _reseal(out) if reseal else out)


# --------------------------------------------------------------------------- sockets

class _Pair:
    """Two endpoints on 127.0.0.1 with one QP each, in this process, on one path."""

    def __init__(self, fast_path: bool) -> None:
        self.dilation = Dilation(1)
        self.clock = FabricClock(self.dilation)
        self.a = Endpoint("127.0.0.1", 0, fast_path=fast_path)
        self.b = Endpoint("127.0.0.1", 0, fast_path=fast_path)
        self.mem = bytearray(1 << 20)
        attrs = QpAttrs(timeout_ns=1e9, mtu=1024)
        self.qa = RcQp(0x11, 0x22, icrc_context("127.0.0.1", "127.0.0.1", self.a.port,
                                                self.b.port), attrs, NoCc(1e9),
                       clock=self.clock)
        self.qb = RcQp(0x22, 0x11, icrc_context("127.0.0.1", "127.0.0.1", self.b.port,
                                                self.a.port), attrs, NoCc(1e9),
                       mrs={5: MemoryRegion(self.mem, 0x1000, 5)}, clock=self.clock)
        self.a.attach(self.qa, ("127.0.0.1", self.b.port))
        self.b.attach(self.qb, ("127.0.0.1", self.a.port))
        self.engine = Engine(self.clock, self.dilation)
        self.engine.add(self.a)
        self.engine.add(self.b)

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.mark.parametrize("fast_path", [pytest.param(True, marks=needs_fast), False])
def test_both_paths_move_a_paced_write_over_sockets_with_the_same_counters(fast_path):
    pair = _Pair(fast_path)
    try:
        assert pair.a.fast_path["on"] is fast_path
        assert all(isinstance(v, (int, dict, str)) and not isinstance(v, bool)
                   for v in pair.a.counters().values())     # callers sum these
        data = pattern(300_000)
        pair.qa.requester.post_write(1, data, 0x1000, 5)
        pair.qa.requester.post_send(2, b"")
        pair.qb.responder.post_recv(9, bytearray(16))
        deadline = time.monotonic() + 30
        pair.engine.run(lambda: pair.qa.requester.idle or time.monotonic() > deadline)
        assert bytes(pair.mem[:len(data)]) == data
        rq, rs = pair.qa.requester.counters(), pair.qb.responder.counters()
        assert rq["packets_sent"] == 293 + 1 and rq["retransmissions"] == 0
        assert rs["packets_received"] == 294 and rs["write_messages"] == 1
        assert rs["send_messages"] == 1
        assert sum(pair.b.malformed.values()) == 0 and pair.b.datagrams_received == 294
    finally:
        pair.close()


@needs_fast
def test_fast_receive_counts_malformed_unknown_and_wrong_peer():
    import socket

    pair = _Pair(True)
    try:
        junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        junk.bind(("127.0.0.1", 0))
        jport = junk.getsockname()[1]
        ctx = icrc_context("127.0.0.1", "127.0.0.1", jport, pair.b.port)
        good = encode_packet(ctx, Bth(Opcode.RC_RDMA_WRITE_ONLY, dest_qp=0x22),
                             Reth(0x1000, 5, 4), None, b"abcd")
        corrupt = bytearray(good)
        corrupt[-6] ^= 0xFF
        unknown = encode_packet(ctx, Bth(Opcode.RC_SEND_ONLY, dest_qp=0x999))
        for d in (b"x", bytes(corrupt), b"\x55" + good[1:], good, unknown):
            junk.sendto(d, ("127.0.0.1", pair.b.port))
        deadline = time.monotonic() + 5
        while pair.b.datagrams_received < 5 and time.monotonic() < deadline:
            pair.engine.step()
        m = pair.b.malformed
        assert (m["TOO_SHORT"], m["BAD_ICRC"], pair.b.unknown_qp, pair.b.wrong_peer) == \
            (1, 2, 1, 1)
        junk.close()
    finally:
        pair.close()


# --------------------------------------------------------------------------- fallback

def _status_in_subprocess(prelude: str, env: dict[str, str]) -> dict:
    code = (f"{prelude}\nimport json\nfrom agents.rdma.transport import Endpoint\n"
            "ep = Endpoint('127.0.0.1', 0)\n"
            "print(json.dumps(ep.fast_path))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_turned_off_by_the_environment_is_reported():
    got = _status_in_subprocess("", {"TESTBED_FASTPATH": "0"})
    assert got["on"] is False and "TESTBED_FASTPATH=0" in got["reason"]


def test_an_extension_that_cannot_be_imported_falls_back_and_says_so():
    # None in sys.modules makes `import agents.fast._fastpath` raise ImportError
    got = _status_in_subprocess("import sys; sys.modules['agents.fast._fastpath'] = None",
                                {"TESTBED_FASTPATH": "1"})
    assert got["on"] is False and "make setup" in got["reason"]


def test_a_stale_extension_is_refused(monkeypatch):
    from agents.fast import build

    monkeypatch.setenv("TESTBED_FASTPATH", "1")
    monkeypatch.setattr(build, "is_current", lambda: False)
    monkeypatch.setattr(build, "extension_path", lambda: build.SOURCE)   # "exists"
    mod, reason = fast._load()
    assert mod is None and reason is not None and "stale" in reason


@needs_fast
def test_the_default_is_on_when_the_extension_imports(monkeypatch):
    monkeypatch.delenv("TESTBED_FASTPATH", raising=False)
    mod, reason = fast._load()
    assert mod is not None and reason is None


# --------------------------------------------------------------------------- receive, whole

MTU_RX = 256


def _stream(sizes: list[int]) -> list[tuple[int, int, Reth | None, bytes, bool]]:
    """The data packets of WRITEs of `sizes` packets (the last one full when the count is
    even, short when odd), PSN 0 up: (opcode, psn, reth, payload, last)."""
    out = []
    va = 0x1000
    for k, npk in enumerate(sizes):
        length = (npk - 1) * MTU_RX + (MTU_RX if npk % 2 == 0 else 100)
        data = pattern(length, seed=k)
        for i in range(npk):
            last = i == npk - 1
            op = (Opcode.RC_RDMA_WRITE_ONLY if last else Opcode.RC_RDMA_WRITE_FIRST) if i == 0 \
                else (Opcode.RC_RDMA_WRITE_LAST if last else Opcode.RC_RDMA_WRITE_MIDDLE)
            out.append((int(op), len(out), Reth(va, 5, length) if i == 0 else None,
                        data[i * MTU_RX:(i + 1) * MTU_RX], last))
        va += length
    return out


class _Receiver:
    """One endpoint with one responder QP, on a given path; what it sent back, kept."""

    def __init__(self, fast_path: bool, sender_port: int) -> None:
        from agents.rdma.cc import DcqcnNp

        self.ep = Endpoint("127.0.0.1", 0, fast_path=fast_path)
        self.mem = bytearray(1 << 16)
        attrs = QpAttrs(mtu=MTU_RX, ack_every=4)
        self.qp = RcQp(0x22, 0x11, icrc_context("127.0.0.1", "127.0.0.1", self.ep.port,
                                                sender_port), attrs, NoCc(1e9),
                       np=DcqcnNp(0), mrs={5: MemoryRegion(self.mem, 0x1000, 5)})
        self.ep.attach(self.qp, ("127.0.0.1", sender_port))
        self.sent: list[tuple[bytes, int]] = []
        self.qp.tx = lambda view, kind: self.sent.append((bytes(view), kind))

    def drain(self, expected: int) -> None:
        deadline = time.monotonic() + 10
        while self.ep.datagrams_received < expected and time.monotonic() < deadline:
            self.ep.receive(1000.0)
        assert self.ep.datagrams_received == expected

    def state(self) -> dict:
        r = self.qp.responder
        ep = {k: v for k, v in self.ep.counters().items() if k != "local"}
        return {"qp": self.qp.counters(), "np": self.qp.responder.np.snapshot(),
                # the ACKs, CNPs and NAKs sent, less their ICRC (it covers this endpoint's port)
                "ep": ep, "mem": bytes(self.mem), "sent": [(d[:-4], k) for d, k in self.sent],
                "wr": (r._wr_off, r._wr_left, r._since_ack, r._nak_sent, r._dup_run)}


_rx_events = st.lists(st.one_of(
    st.tuples(st.just("next"), st.booleans(), st.booleans()),      # ack_req, CE
    # the next packet claims to be a MIDDLE (a LAST that does: an invalid request)
    st.tuples(st.just("lie"), st.just(False), st.just(False)),
    st.tuples(st.just("skip"), st.just(False), st.just(False)),
    st.tuples(st.just("dup"), st.integers(1, 5), st.just(False)),
    st.tuples(st.just("rewind"), st.integers(0, 8), st.just(False)),
    st.tuples(st.just("junk"), st.just(False), st.just(False)),
    # receive what was sent so far: the QP that took the last packet is then the one C may
    # place packets for in the next batch
    st.tuples(st.just("drain"), st.just(False), st.just(False)),
), min_size=1, max_size=80)


@needs_fast
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 24), min_size=1, max_size=6), events=_rx_events)
def test_fast_receive_leaves_the_same_responder_state_as_the_python_one(sizes, events):
    import socket

    stream = _stream(sizes)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    sport = tx.getsockname()[1]
    sides = [_Receiver(True, sport), _Receiver(False, sport)]
    try:
        cursor = 0
        sent = 0
        for what, a, b in events:
            if what == "next" and cursor < len(stream):
                op, psn, reth, payload, _ = stream[cursor]
                cursor += 1
                item: tuple | None = (op, psn, reth, payload, a, b)
            elif what == "lie" and cursor < len(stream):
                _op, psn, reth, payload, _ = stream[cursor]
                cursor += 1
                item = (int(Opcode.RC_RDMA_WRITE_MIDDLE), psn, None, payload, False, False)
            elif what == "dup" and cursor:
                op, psn, reth, payload, _ = stream[min(len(stream) - 1, max(0, cursor - a))]
                item = (op, psn, reth, payload, False, False)
            elif what == "skip":
                cursor += 1
                item = None
            elif what == "rewind":
                cursor = max(0, min(cursor, sides[1].qp.responder.expected_psn) - a)
                item = None
            elif what == "junk":
                item = ("junk",)
            elif what == "drain":
                for side in sides:
                    side.drain(sent)
                item = None
            else:
                item = None
            if item is None:
                continue
            for side in sides:
                port = side.ep.port
                if item[0] == "junk":
                    data = b"\x00" * 20
                else:
                    op, psn, reth, payload, ack_req, ce = item
                    data = encode_packet(icrc_context("127.0.0.1", "127.0.0.1", sport, port),
                                         Bth(op, dest_qp=0x22, psn=psn, ack_req=ack_req),
                                         reth, None, payload)
                    tx.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 3 if ce else 0)
                tx.sendto(data, ("127.0.0.1", port))
            sent += 1
        for side in sides:
            side.drain(sent)
        fast_state, ref_state = (s.state() for s in sides)
        assert fast_state == ref_state
    finally:
        tx.close()
        for s in sides:
            s.ep.close()


@needs_fast
def test_an_in_order_write_is_placed_by_c_in_runs():
    """The receive fast path does take runs (the equivalence above would pass without)."""
    import socket

    stream = _stream([40])
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    side = _Receiver(True, tx.getsockname()[1])
    runs: list[int] = []
    orig = side.qp.on_fast_run
    side.qp.on_fast_run = lambda c, u, p, a: (runs.append(c), orig(c, u, p, a))  # type: ignore
    try:
        for op, psn, reth, payload, _ in stream:
            tx.sendto(encode_packet(icrc_context("127.0.0.1", "127.0.0.1",
                                                 tx.getsockname()[1], side.ep.port),
                                    Bth(op, dest_qp=0x22, psn=psn), reth, None, payload),
                      ("127.0.0.1", side.ep.port))
        side.drain(40)
        # the first 16 (one recvmmsg) go to Python: the WRITE began in that batch; then
        # every MIDDLE, ACK due or not, is placed by C
        assert sum(runs) == 40 - 16 - 1
        assert side.qp.responder.counters()["write_messages"] == 1
    finally:
        tx.close()
        side.ep.close()


@needs_fast
@pytest.mark.parametrize("ack_req_every", [0, 3])
def test_runs_across_acks_leave_the_same_state(ack_req_every):
    """A long WRITE arriving while C has the QP: its runs cross several ACKs."""
    import socket

    stream = _stream([60, 3])
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    sport = tx.getsockname()[1]
    sides = [_Receiver(True, sport), _Receiver(False, sport)]
    try:
        for i, (op, psn, reth, payload, _) in enumerate(stream):
            for side in sides:
                ack_req = bool(ack_req_every) and i % ack_req_every == 0
                tx.sendto(encode_packet(icrc_context("127.0.0.1", "127.0.0.1", sport,
                                                     side.ep.port),
                                        Bth(op, dest_qp=0x22, psn=psn, ack_req=ack_req),
                                        reth, None, payload), ("127.0.0.1", side.ep.port))
            if i == 1:
                for side in sides:
                    side.drain(2)
        for side in sides:
            side.drain(len(stream))
        fast_state, ref_state = (s.state() for s in sides)
        assert fast_state == ref_state
        assert fast_state["qp"]["responder"]["acks_sent"] > 10
    finally:
        tx.close()
        for s in sides:
            s.ep.close()


def test_an_extension_never_built_is_reported(monkeypatch, tmp_path):
    from agents.fast import build

    monkeypatch.setenv("TESTBED_FASTPATH", "1")
    monkeypatch.setattr(build, "extension_path", lambda: tmp_path / "absent.so")
    mod, reason = fast._load()
    assert mod is None and reason is not None and "not built" in reason


def test_send_batch_accounts_and_retries_each_failure_as_send_does():
    import errno

    from agents.rdma.transport import Stopped

    class _Batch:
        """Answers send() from a script: (went, errno) per call."""

        def __init__(self, script):
            self.script = list(script)
            self.cleared = False

        def send(self, fd, addr):
            return self.script.pop(0)

        def clear(self):
            self.cleared = True

    stop = [False]
    ep = Endpoint("127.0.0.1", 0, fast_path=False, should_stop=lambda: stop[0])
    try:
        b = _Batch([(2, errno.EAGAIN), (0, errno.ENOBUFS), (1, errno.ECONNREFUSED), (3, 0)])
        ep.send_batch(b, ("127.0.0.1", 9))
        assert not b.script and not b.cleared
        e = ep.send_errors
        assert (e.eagain, e.enobufs, e.icmp_errors) == (1, 1, 1)
        with pytest.raises(OSError):                    # what a retry cannot fix
            ep.send_batch(_Batch([(0, errno.EMSGSIZE)]), ("127.0.0.1", 9))
        stop[0] = True                                  # a stop ends a blocked send
        b = _Batch([(0, errno.EAGAIN)])
        with pytest.raises(Stopped):
            ep.send_batch(b, ("127.0.0.1", 9))
        # what did not go stays for the caller to take back (fast_send_round) and clear
        assert not b.cleared
    finally:
        ep.close()


_SEND_COUNTERS = ("packets_sent", "bytes_sent", "wire_bytes_sent", "payload_bytes_sent")


@needs_fast
def test_a_stop_during_a_blocked_batch_takes_its_unsent_packets_back():
    from agents.rdma.transport import Stopped

    t = _Twins(mtu=256)
    t.post("write", 256 * 6, 1)
    r, batch = t.fast, t.batch
    before = r.counters()
    went: list[bytes] = []

    def blocked(b) -> None:      # the NIC queue stays full until the stop
        went.extend(b.packet(i) for i in range(b.pending))
        raise Stopped()

    with pytest.raises(Stopped):
        fast_send_round(r, batch, 1.0, SEND_BATCH, blocked, lambda v: None)
    after = r.counters()
    assert len(went) >= 2                           # a whole run was built, none went
    assert after["unsent_at_stop"] == len(went)
    for name in _SEND_COUNTERS:
        assert after[name] == before[name], name
    assert batch.pending == 0                       # cleared: no message buffer held


@needs_fast
def test_unsend_takes_back_exactly_what_poll_send_counted():
    t = _Twins(mtu=256)
    t.post("write_imm", 256 * 3 + 100, 1)
    r = t.ref
    def one(k: int) -> bytes:
        view = r.poll_send(1e6 * k)       # far apart: the pacer always has the budget
        assert view is not None
        return bytes(view)
    views = [one(k) for k in range(1, 3)]
    mid = r.counters()
    views += [one(k) for k in range(3, 5)]
    r.unsend(views[2:])
    after = r.counters()
    assert after["unsent_at_stop"] == 2
    for name in _SEND_COUNTERS:
        assert after[name] == mid[name], name
