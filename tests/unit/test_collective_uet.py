"""The collectives' UET transport (agents.collectives.uet) over fake NICs, without root.

`FakeNic` has the surface of `agents.uet.nic.UetNic` the transport uses (send with match
bits and on_done, on_message, step, wait, idle, counters, close). A send lands in the
target's inbox; the target's step() delivers what is there in a random order (not even
the message-id order per (peer, match bits) the real NIC keeps), reading the sender's
buffer only then, as a zero-copy NIC would; each delivery puts an acknowledgement in the
sender's queue, which the sender's step() turns into on_done. Ranks run in threads, each
driving its own NIC, as ranks in processes do.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from agents.collectives import algorithms, data
from agents.collectives.__main__ import build_parser, check_args
from agents.collectives.links import PeerLinks, connect_links
from agents.collectives.roce import HEADER, HEADER_BYTES, PeerAddress, SetupError, Stopped
from agents.collectives.sync import barrier, finish
from agents.collectives.uet import (
    MATCH_SPACE,
    TransportError,
    UetTransport,
    match_bits,
)
from agents.timebase import Dilation, FabricClock

# --------------------------------------------------------------------------- the fakes


class FakeWire:
    """The fabric between fake NICs: who is where, one lock, a seeded shuffle."""

    def __init__(self, seed: int = 1) -> None:
        self.nics: dict[str, FakeNic] = {}
        self.lock = threading.Lock()
        self.rng = random.Random(seed)


class FakeNic:
    def __init__(self, wire: FakeWire, ip: str, *, batch: int = 3) -> None:
        self.wire, self.ip, self.batch = wire, ip, batch
        wire.nics[ip] = self
        self.on_message: Callable[[str, int, int, memoryview], None] | None = None
        self.on_error: Callable[[str, str], None] | None = None
        self.inbox: list[tuple[str, int, int, memoryview, FakeNic, Callable | None]] = []
        self.acks: list[tuple[int, Callable | None]] = []
        self.next_id: dict[str, int] = {}
        self.sent: list[tuple[str, int, int]] = []     # (peer, match bits, bytes)
        self.fail_step: Exception | None = None
        self.fail_send: Exception | None = None
        self.closed = False
        self.rx = 0

    def send(self, peer_ip: str, match_bits: int, data, *, on_done=None) -> int:
        if self.fail_send is not None:
            raise self.fail_send
        mid = self.next_id.get(peer_ip, 0)          # message ids are per PDC, as UetNic's
        self.next_id[peer_ip] = (mid + 1) & 0xFFFF
        view = memoryview(data).cast("B")
        self.sent.append((peer_ip, match_bits, view.nbytes))
        with self.wire.lock:
            self.wire.nics[peer_ip].inbox.append((self.ip, match_bits, mid, view, self,
                                                  on_done))
        return mid

    def step(self) -> bool:
        if self.fail_step is not None:
            raise self.fail_step
        with self.wire.lock:
            self.wire.rng.shuffle(self.inbox)
            todo, self.inbox = self.inbox[:self.batch], self.inbox[self.batch:]
            acks, self.acks = self.acks, []
        for src, bits, mid, view, sender, on_done in todo:
            payload = bytes(view)          # read now, as a zero-copy NIC would
            self.rx += 1
            assert self.on_message is not None
            self.on_message(src, bits, mid, memoryview(payload))
            with self.wire.lock:
                sender.acks.append((mid, on_done))
        for mid, on_done in acks:
            if on_done is not None:
                on_done(mid)
        return bool(todo or acks)

    def wait(self, max_wall_ns: int = 1_000_000) -> None:
        time.sleep(min(max_wall_ns, 200_000) / 1e9)

    def idle(self) -> bool:
        return not self.acks

    def counters(self) -> dict:
        return {"local": {}, "pdcs": {}, "sockets": {},
                "totals": {"tx_packets": len(self.sent),
                           "tx_bytes": sum(n for _, _, n in self.sent), "rx_packets": self.rx,
                           "retransmissions": 0, "sports": {"53248": len(self.sent)}}}

    def close(self) -> None:
        self.closed = True


def world(n: int, *, seed: int = 1, chunk_bytes: int = 4096 + HEADER_BYTES,
          batch: int = 3) -> tuple[list[UetTransport], list[FakeNic]]:
    wire = FakeWire(seed)
    ips = [f"10.0.0.{i + 1}" for i in range(n)]
    nics = [FakeNic(wire, ip, batch=batch) for ip in ips]
    clock = FabricClock(Dilation(1))
    ts = [UetTransport(r, ips, nics[r], clock, chunk_bytes=chunk_bytes) for r in range(n)]
    return ts, nics


def in_threads(ts: list[UetTransport], fn: Callable[[UetTransport], object],
               timeout: float = 60.0) -> list[object]:
    results: list[object] = [None] * len(ts)
    errors: list[BaseException] = []

    def run(t: UetTransport) -> None:
        try:
            results[t.rank] = fn(t)
        except BaseException as e:   # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


# --------------------------------------------------------------------------- messages


def test_match_bits_carry_the_collective_space_and_the_tag():
    assert match_bits(0) == MATCH_SPACE << 32
    assert match_bits(0xFFFFFF01) & 0xFFFFFFFF == 0xFFFFFF01
    with pytest.raises(ValueError):
        match_bits(1 << 32)


def test_messages_of_different_tags_in_any_order_and_same_tag_messages_in_order():
    ts, nics = world(2, seed=7)
    sizes = {(5, 0): 3, (3, 0): 10_000, (3, 1): 1, (7, 0): 0, (3, 2): 2500}

    def rank(t: UetTransport) -> list[np.ndarray]:
        other = 1 - t.rank
        for (tag, i), n in sizes.items():       # three messages with tag 3, in order 0, 1, 2
            t.send(other, tag, np.arange(n, dtype=np.int32) * 10 + i + 100 * t.rank)
        got = []
        for tag, i in ((7, 0), (3, 0), (5, 0), (3, 1), (3, 2)):
            out = np.full(sizes[(tag, i)], -1, dtype=np.int32)
            t.recv(other, tag, out)
            got.append(out)
        t.wait_sends()
        return got

    results = in_threads(ts, rank)
    for r, got in enumerate(results):
        other = 1 - r
        assert isinstance(got, list)
        for out, (tag, i) in zip(got, ((7, 0), (3, 0), (5, 0), (3, 1), (3, 2)), strict=True):
            assert np.array_equal(out, np.arange(sizes[(tag, i)], dtype=np.int32) * 10 + i
                                  + 100 * other), (tag, i)
    # every chunk went as a SEND with the collective match bits of its tag
    assert {bits >> 32 for _, bits, _ in nics[0].sent} == {MATCH_SPACE}
    assert {bits & 0xFFFFFFFF for _, bits, _ in nics[0].sent} == {3, 5, 7}
    c0, c1 = ts[0].counters(), ts[1].counters()
    assert c0["messages_sent"] == 5 and c1["messages_received"] == 5
    assert c0["bytes_sent"] == c1["bytes_received"] == 4 * sum(sizes.values())


def test_a_big_buffer_is_chunked_into_sends_and_lands_byte_exact_from_any_order():
    chunk = 4096 + HEADER_BYTES
    ts, nics = world(2, seed=3, chunk_bytes=chunk, batch=50)
    n = (1 << 20) + 123                            # bytes, not a chunk multiple
    src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)

    def rank(t: UetTransport) -> np.ndarray | None:
        if t.rank == 0:
            t.send(1, 9, src)
            t.wait_sends()
            return None
        out = np.zeros(n, dtype=np.uint8)
        t.recv(0, 9, out)
        return out

    out = in_threads(ts, rank)[1]
    assert isinstance(out, np.ndarray) and np.array_equal(out, src)
    chunks = -(-n // 4096)
    assert len(nics[0].sent) == chunks
    assert all(nbytes <= chunk for _, _, nbytes in nics[0].sent)
    c1 = ts[1].counters()
    assert c1["chunks_received"] == chunks
    # most chunks came before the receive was bound, or after: both are placed
    assert c1["bytes_received"] == n
    c0 = ts[0].counters()
    assert c0["wire_bytes_sent"] == c0["tx_bytes"] + 66 * c0["tx_packets"]


def test_the_senders_buffer_is_free_once_send_returns():
    ts, nics = world(2)
    buf = np.arange(1000, dtype=np.float32)
    ts[0].send(1, 1, buf)
    buf[:] = -1                                     # reused before anything was delivered
    out = np.empty(1000, dtype=np.float32)
    ts[1].recv(0, 1, out)
    assert np.array_equal(out, np.arange(1000, dtype=np.float32))


def test_wait_sends_returns_only_once_every_send_is_acknowledged():
    ts, nics = world(2, batch=1)
    for tag in range(3):
        ts[0].send(1, tag, np.ones(10, dtype=np.int32))
    assert not ts[0].sends_done()
    got = threading.Event()

    def receiver() -> None:
        for tag in range(3):
            ts[1].recv(0, tag, np.empty(10, dtype=np.int32))
        got.set()

    th = threading.Thread(target=receiver, daemon=True)
    th.start()
    ts[0].wait_sends()
    th.join(10)
    assert got.is_set() and ts[0].sends_done()
    c0 = ts[0].counters()
    assert c0["chunks_sent"] == c0["chunks_posted"] == 3 and c0["bytes_sent"] == 120


def test_wait_sends_waits_for_each_peers_sends_though_their_message_ids_coincide():
    ts, nics = world(3, batch=1)
    ts[0].send(1, 0, np.ones(5, dtype=np.int8))      # message id 0 on the PDC to rank 1
    ts[0].send(2, 0, np.ones(6, dtype=np.int8))      # message id 0 on the PDC to rank 2
    ts[1].recv(0, 0, np.empty(5, dtype=np.int8))    # rank 1 acknowledges its one
    for _ in range(3):
        nics[0].step()
    assert not ts[0].sends_done()                    # rank 2's is not acknowledged yet
    assert ts[0].counters()["per_peer"]["1"]["bytes_sent"] == 5
    ts[2].recv(0, 0, np.empty(6, dtype=np.int8))
    ts[0].wait_sends()
    assert ts[0].counters()["bytes_sent"] == 11


def test_an_on_done_before_send_returns_its_id_is_counted_not_lost():
    ts, nics = world(2)
    real_send = nics[0].send

    def eager(peer_ip, bits, data, *, on_done=None):
        mid = real_send(peer_ip, bits, data, on_done=None)
        if on_done is not None:
            on_done(mid)                        # the NIC finished inside send()
        return mid

    nics[0].send = eager  # type: ignore[method-assign]
    ts[0].send(1, 0, np.ones(4, dtype=np.int8))
    assert ts[0].sends_done() and ts[0].counters()["chunks_sent"] == 1


def test_a_ring_all_reduce_over_four_fake_nics_is_exact():
    n, count = 4, 100_003
    ts, _ = world(n, seed=11, chunk_bytes=32768 + HEADER_BYTES, batch=8)

    def rank(t: UetTransport) -> int:
        send = data.make_sendbuf("allreduce", t.rank, n, count, "float32", 1)
        recv = data.make_recvbuf("allreduce", n, count, "float32")
        algorithms.run("allreduce", "ring", t, send, recv, chunks=2, dtype="float32")
        return int(data.count_wrong(recv, "allreduce", "sum", n, count, "float32", "ring",
                                    rank=t.rank, seed=1))

    assert in_threads(ts, rank) == [0] * n


# --------------------------------------------------------------------------- errors


def test_a_send_with_foreign_match_bits_fails_the_receive():
    ts, nics = world(2)
    nics[0].send("10.0.0.2", 0x1234 << 32 | 1, np.zeros(HEADER_BYTES + 4, dtype=np.uint8))
    with pytest.raises(TransportError, match="not a collective chunk"):
        ts[1].recv(0, 1, np.empty(4, dtype=np.uint8))
    assert ts[1].counters()["stray_messages"] == 1


def test_a_send_from_an_address_that_is_no_rank_fails_the_receive():
    ts, nics = world(2)
    stranger = FakeNic(nics[0].wire, "10.0.0.99")
    stranger.send("10.0.0.2", match_bits(1), np.zeros(HEADER_BYTES, dtype=np.uint8))
    with pytest.raises(TransportError, match="10.0.0.99, which is no rank"):
        ts[1].recv(0, 1, np.empty(0, dtype=np.uint8))


def test_a_chunk_whose_header_tag_differs_from_its_match_bits_is_an_error():
    ts, nics = world(2)
    chunk = np.zeros(HEADER_BYTES, dtype=np.uint8)
    HEADER.pack_into(chunk.data, 0, 2, 0, 0, 0)
    nics[0].send("10.0.0.2", match_bits(1), chunk)
    with pytest.raises(TransportError, match="says tag 2"):
        ts[1].recv(0, 1, np.empty(0, dtype=np.uint8))


def test_a_length_mismatch_is_a_transport_error():
    ts, _ = world(2)
    ts[0].send(1, 4, np.zeros(8, dtype=np.uint8))
    with pytest.raises(TransportError, match="8-byte message"):
        ts[1].recv(0, 4, np.empty(16, dtype=np.uint8))


def test_nic_failures_surface_as_transport_errors():
    ts, nics = world(2)
    nics[1].fail_step = RuntimeError("PDC to 10.0.0.1 gave up after 7 retries")
    with pytest.raises(TransportError, match="gave up after 7 retries"):
        ts[1].recv(0, 0, np.empty(1, dtype=np.uint8))
    nics[0].fail_send = OSError(105, "No buffer space available")
    with pytest.raises(TransportError, match="refused a 17-byte SEND to rank 1"):
        ts[0].send(1, 0, np.zeros(1, dtype=np.uint8))


def test_a_failed_pdc_fails_the_wait_with_its_reason():
    ts, nics = world(2)
    ts[0].send(1, 0, np.zeros(8, dtype=np.uint8))
    assert nics[0].on_error is not None
    nics[0].on_error("10.0.0.2", "PDC 10.0.0.1 -> 10.0.0.2 failed: PSN 7 unacknowledged "
                                 "after 7 retries")
    with pytest.raises(TransportError, match="PDC to rank 1 failed: .*after 7 retries"):
        ts[0].wait_sends()


def test_the_nics_stop_is_the_transports_stop():
    from agents.uet.nic import Stopped as NicStopped

    ts, nics = world(2)
    nics[0].fail_step = NicStopped()
    with pytest.raises(Stopped):
        ts[0].recv(1, 0, np.empty(1, dtype=np.uint8))


def test_bad_peers_and_tags_are_refused():
    ts, _ = world(2)
    with pytest.raises(ValueError):
        ts[0].send(0, 0, np.zeros(1))
    with pytest.raises(ValueError):
        ts[0].send(1, 1 << 32, np.zeros(1))
    with pytest.raises(ValueError):
        ts[0].recv(2, 0, np.zeros(1))
    with pytest.raises(ValueError, match="one UET NIC"):
        UetTransport(0, ["10.0.0.1", "10.0.0.1"], nics_stub(), FabricClock(Dilation(1)))


def nics_stub() -> FakeNic:
    return FakeNic(FakeWire(), "10.0.0.1")


def test_a_stop_request_ends_a_wait_with_stopped():
    wire = FakeWire()
    nic = FakeNic(wire, "10.0.0.1")
    FakeNic(wire, "10.0.0.2")
    stop = threading.Event()
    t = UetTransport(0, ["10.0.0.1", "10.0.0.2"], nic, FabricClock(Dilation(1)),
                     should_stop=stop.is_set)
    threading.Timer(0.05, stop.set).start()
    with pytest.raises(Stopped):
        t.recv(1, 0, np.empty(1, dtype=np.uint8))


# --------------------------------------------------------------------------- set-up


def _free_tcp_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _links(n: int, settings: Callable[[int], dict]) -> list[PeerLinks | BaseException]:
    peers = [PeerAddress("127.0.0.1", p, 4793) for p in _free_tcp_ports(n)]
    out: list[PeerLinks | BaseException] = [RuntimeError("not run")] * n

    def run(r: int) -> None:
        try:
            out[r] = connect_links(r, peers, settings(r), timeout_s=10)
        except BaseException as e:   # noqa: BLE001 - looked at by the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    return out


def test_ranks_with_other_uet_settings_refuse_each_other_at_set_up():
    out = _links(2, lambda r: {"version": 1, "transport": "uet",
                               "chunk_bytes": 4112 if r == 0 else 8208})
    assert all(isinstance(o, SetupError) for o in out), out
    assert any("chunk_bytes" in str(o) for o in out)


def test_the_ranks_finish_together_over_fake_nics_and_real_set_up_links():
    links = _links(3, lambda r: {"version": 1, "transport": "uet"})
    assert all(isinstance(lk, PeerLinks) for lk in links), links
    wire = FakeWire(5)
    ips = [f"10.0.0.{i + 1}" for i in range(3)]
    nics = [FakeNic(wire, ip) for ip in ips]
    clock = FabricClock(Dilation(1))
    ts = [UetTransport(r, ips, nics[r], clock, links=links[r])  # type: ignore[arg-type]
          for r in range(3)]

    def rank(t: UetTransport) -> bool:
        barrier(t, (0, 0))
        finish(t)
        return t.peers_done()

    try:
        assert in_threads(ts, rank) == [True] * 3
    finally:
        for t in ts:
            t.close()
    assert all(nic.closed for nic in nics)


def test_a_peer_that_leaves_with_an_error_fails_a_waiting_rank():
    links = _links(2, lambda r: {"version": 1})
    assert all(isinstance(lk, PeerLinks) for lk in links), links
    ts, _ = world(2)
    ts = [UetTransport(r, ts[r].peers, ts[r].nic, ts[r].clock,  # type: ignore[arg-type]
                       links=links[r]) for r in range(2)]
    try:
        ts[1].leave("error")
        with pytest.raises(TransportError, match=r"rank 1 left \(error\)"):
            ts[0].recv(1, 0, np.empty(1, dtype=np.uint8))
    finally:
        for t in ts:
            t.close()


# --------------------------------------------------------------------------- the worker


def _worker_args(*extra: str):
    args = build_parser().parse_args(
        ["--rank", "0", "--peers", "10.0.0.1:12000:4793,10.0.0.2:12000:4793", *extra])
    return args, check_args(args)


def test_worker_takes_the_uet_transport_and_its_flags():
    args, problem = _worker_args("--transport", "uet", "--uet-cc", "credit",
                                 "--uet-entropy", "reps", "--uet-entropies", "32",
                                 "--uet-trim-dscp", "46", "--no-uet-ecn")
    assert problem is None
    assert (args.transport, args.uet_cc, args.uet_entropy, args.uet_entropies,
            args.uet_trim_dscp, args.uet_ecn) == ("uet", "credit", "reps", 32, 46, False)
    args, problem = _worker_args()
    assert problem is None and args.transport == "roce"


@pytest.mark.parametrize(("peers", "extra", "message"), [
    ("10.0.0.1:12000:4793,10.0.0.2:12001:4794", (), "one for all"),
    ("10.0.0.1:12000:4793,10.0.0.1:12001:4793", (), "share an IP"),
    ("10.0.0.1:12000:4793,10.0.0.2:12000:4793", ("--algorithm", "ina",
                                                  "--aggregator", "10.0.0.9:11000"),
     "RoCE transport only"),
])
def test_worker_refuses_what_uet_cannot_do(peers, extra, message):
    args = build_parser().parse_args(["--rank", "0", "--peers", peers, "--transport", "uet",
                                      *extra])
    problem = check_args(args)
    assert problem is not None and message in problem


# --------------------------------------------------------------------------- the config

FABRIC = """\
name: colluet
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
traffic_classes:
  - {{tc: 3, name: roce, dscp: [26], lossless: true, ecn: true, weight: 1}}
  - {{tc: 2, name: lossy, dscp: [10], ecn: true, weight: 1}}
  - {{tc: 1, name: plain, dscp: [8], weight: 1}}
  - {{tc: 6, name: cnp, dscp: [48], strict: true}}
  - {{tc: 0, name: default, dscp: [], weight: 1, default: true}}
workload:
  traffic:
{traffic}
"""
UET_AR = ("    - {name: ar, kind: allreduce, ranks: [h1, h2, h3, h4], transport: uet, "
          "tclass: lossy, sizes: {min: 64KiB, max: 64KiB}, chunk: 256KiB%s}")


def _load(traffic: str):
    from testbed.config import load_config_text
    from testbed.plan import compile_plan

    loaded = load_config_text(FABRIC.format(traffic=traffic), "colluet.yaml")
    return loaded, compile_plan(loaded)


def _problems(traffic: str) -> str:
    from testbed.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _load(traffic)
    return str(err.value)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_transport_uet_expands_to_the_uet_ranks_flags():
    from testbed.run.workload import expand_workload

    loaded, plan = _load(UET_AR % ", cc: credit, entropy: reps, entropies: 8")
    specs = expand_workload(loaded.fabric, plan)
    assert [s.name for s in specs] == ["ar-r0", "ar-r1", "ar-r2", "ar-r3"]
    argv = specs[0].argv
    assert _flag(argv, "--transport") == "uet"
    assert (_flag(argv, "--uet-cc"), _flag(argv, "--uet-entropy"),
            _flag(argv, "--uet-entropies")) == ("credit", "reps", "8")
    assert _flag(argv, "--dscp") == "10" and _flag(argv, "--chunk-bytes") == str(256 << 10)
    assert _flag(argv, "--uet-payload-bytes") == "4096"
    assert int(_flag(argv, "--line-rate-bps")) == 100_000_000_000
    assert int(_flag(argv, "--uet-base-rtt-ns")) > 1000       # h1 to h3/h4 over a spine
    # every rank on UDP 4793, its set-up port numbered as for RoCE
    assert all(p.endswith(":12000:4793") for p in _flag(argv, "--peers").split(","))
    for roce_only in ("--qps", "--cc", "--window-packets", "--mtu", "--cnp-dscp"):
        assert roce_only not in argv
    # the worker takes what the kind writes
    args = build_parser().parse_args(argv)
    assert check_args(args) is None and args.uet_cc == "credit"


def test_transport_uet_defaults_to_nscc_sprayed_over_16_entropies():
    from testbed.run.workload import expand_workload

    loaded, plan = _load(UET_AR % "")
    argv = expand_workload(loaded.fabric, plan)[1].argv
    assert (_flag(argv, "--uet-cc"), _flag(argv, "--uet-entropy"),
            _flag(argv, "--uet-entropies")) == ("nscc", "spray", "16")


def test_a_trimming_class_tells_the_ranks_the_trimmed_packets_dscp():
    from testbed.run.workload import expand_workload

    loaded, plan = _load(UET_AR % "")
    assert "--uet-trim-dscp" not in expand_workload(loaded.fabric, plan)[0].argv
    text = FABRIC.format(traffic=UET_AR % "").replace(
        "name: lossy, dscp: [10], ecn: true,", "name: lossy, dscp: [10], ecn: true, trim: true,")
    from testbed.config import load_config_text
    from testbed.plan import compile_plan

    loaded = load_config_text(text, "colluet.yaml")
    argv = expand_workload(loaded.fabric, compile_plan(loaded))[0].argv
    assert _flag(argv, "--uet-trim-dscp") == "48"        # the strict cnp class's DSCP


def test_transport_roce_stays_the_default_with_its_flags():
    from testbed.run.workload import expand_workload

    loaded, plan = _load("    - {name: ar, kind: allreduce, ranks: [h1, h2], "
                         "sizes: {min: 64KiB, max: 64KiB}}")
    argv = expand_workload(loaded.fabric, plan)[0].argv
    assert "--transport" not in argv and _flag(argv, "--cc") == "dcqcn"
    assert _flag(argv, "--peers").split(",")[0].endswith(":12000:10000")


def test_uet_config_problems_are_clear():
    text = _problems(UET_AR % ", qps: 4, cc_preset: rfc8257, window: 64")
    for field in ("qps", "cc_preset", "window"):
        assert f"traffic[0].{field}: {field} sets up RoCE queue pairs; transport: uet" in text
    text = _problems(UET_AR % ", cc: dctcp")
    assert "traffic[0].cc: cc dctcp is RoCE's; with transport: uet use nscc, credit, none" \
        in text
    text = _problems(UET_AR.replace("tclass: lossy", "tclass: plain") % "")
    assert "traffic[0].tclass: class 'plain' (TC1) does not mark ECN, so NSCC" in text
    _load(UET_AR.replace("tclass: lossy", "tclass: plain") % ", cc: credit")   # fine
    text = _problems(UET_AR.replace("tclass: lossy, ", "") % "")
    assert "traffic[0].tclass: transport: uet needs its traffic class named" in text
    text = _problems("    - {name: ar, kind: allreduce, ranks: [h1, h2], entropies: 4, "
                     "sizes: {min: 64KiB, max: 64KiB}}")
    assert "traffic[0].entropies: entropies is for transport: uet" in text
    text = _problems("    - {name: ar, kind: allreduce, ranks: [h1, h2], cc: credit, "
                     "sizes: {min: 64KiB, max: 64KiB}}")
    assert "traffic[0].cc: cc credit is Ultra Ethernet's; with transport: roce" in text
    text = _problems(UET_AR % ", algorithm: ina")
    assert "traffic[0].transport: the in-network all-reduce runs" in text


def test_a_host_runs_one_uet_nic():
    two = (UET_AR % "") + "\n" + (
        "    - {name: br, kind: broadcast, ranks: [h4, h1], transport: uet, tclass: lossy, "
        "sizes: {min: 64KiB, max: 64KiB}}")
    text = _problems(two)
    assert ("traffic[1]: the UET NIC of rank 0 on h4 binds udp 4793, which the UET NIC of "
            "rank 3 of entry 'ar' binds there already") in text
    assert "the UET NIC of rank 1 on h1 binds udp 4793" in text
    # a UET flows entry on a rank's host too
    text = _problems((UET_AR % "") + "\n    - {name: f, kind: flows, transport: uet, "
                     "tclass: lossy, flows: [{src: h5, dst: h2, size: 64KiB}]}")
    assert "on h2 binds udp 4793, which the UET NIC of rank 1 of entry 'ar'" in text
    # a RoCE entry beside it is fine: other ports
    _load((UET_AR % "") + "\n    - {name: br, kind: broadcast, ranks: [h4, h1], "
          "sizes: {min: 64KiB, max: 64KiB}}")


def test_the_training_step_refuses_uet_clearly():
    text = _problems("    - {name: step, kind: training, ranks: [h1, h2], transport: uet, "
                     "buckets: [64KiB]}")
    assert "traffic[0].transport: the training step runs over RoCE only" in text


# --------------------------------------------------------------------------- the real NIC


def test_two_ranks_over_real_uet_nics_on_loopback():
    """Two ranks on 127.0.0.1 and 127.0.0.2 (one UET NIC each, the same UDP port), set up
    by agents.collectives.uet.connect: tagged messages both ways and a ring all-reduce."""
    nic_module = pytest.importorskip("agents.uet.nic")
    from agents.collectives.uet import UetConfig, connect

    tcp = _free_tcp_ports(2)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        udp = s.getsockname()[1]
    peers = [PeerAddress("127.0.0.1", tcp[0], udp), PeerAddress("127.0.0.2", tcp[1], udp)]
    options = nic_module.UetOptions(dscp=10, line_rate_bps=2e9, base_rtt_ns=50_000)
    config = UetConfig(options=options, chunk_bytes=65536 + HEADER_BYTES, udp_port=udp,
                       connect_timeout_s=20)
    ts: list[UetTransport | None] = [None, None]
    errors: list[BaseException] = []
    got: dict[int, list[np.ndarray]] = {}

    def rank(r: int) -> None:
        try:
            t = connect(r, peers, config)
            ts[r] = t
            other = 1 - r
            msgs = [np.arange(n, dtype=np.float32) + r for n in (0, 1, 1023, 300_000)]
            for i, m in enumerate(msgs):
                t.send(other, i % 2, m)
            out = []
            for i in (1, 3, 0, 2):
                buf = np.empty(msgs[i].size, dtype=np.float32)
                t.recv(other, i % 2, buf)
                out.append(buf)
            t.wait_sends()
            send = np.full(100_001, r + 1, dtype=np.int32)
            recv = np.empty_like(send)
            algorithms.run("allreduce", "ring", t, send, recv)
            out.append(recv)
            finish(t)
            got[r] = out
        except BaseException as e:   # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        for t in ts:
            if t is not None:
                t.close()
    assert not errors, errors
    for r in (0, 1):
        for buf, n in zip(got[r][:4], (1, 300_000, 0, 1023), strict=True):
            assert np.array_equal(buf, np.arange(n, dtype=np.float32) + 1 - r)
        assert np.array_equal(got[r][4], np.full(100_001, 3, dtype=np.int32))
    t0, t1 = ts
    assert t0 is not None and t1 is not None
    c0, c1 = t0.counters(), t1.counters()
    assert c0["bytes_sent"] == c1["bytes_received"] and c1["bytes_sent"] == c0["bytes_received"]
    assert c0["tx_packets"] > 0 and c0["transport"] == "uet"
    assert c0["wire_bytes_sent"] > c0["bytes_sent"]


def test_uet_rank_accounts_count_every_datagram_between_two_nics():
    from testbed.workloads.base import AgentSpec
    from testbed.workloads.collective_accounts import uet_accounts

    peers = "10.0.0.1:12000:4793,10.0.0.2:12000:4793"
    ranks = [AgentSpec(name=f"ar-r{r}", node=f"h{r + 1}", role="sender", traffic="ar",
                       kind="allreduce", argv=["--rank", str(r), "--peers", peers,
                                               "--transport", "uet"],
                       module="agents.collectives") for r in (0, 1)]

    def res(pdc: dict) -> dict:
        return {"counters": {"uet": {"pdcs": pdc}}}

    results = {
        # rank 0 sent rank 1 10 requests, 3 ACKs, 1 NACK, 1 CREDIT_REQ
        "ar-r0": res({"10.0.0.2": {"tx_packets": 10, "acks_sent": 3, "nacks_sent": 1,
                                   "credit_reqs_sent": 1, "rx_packets": 4,
                                   "acks_received": 2}}),
        # rank 1 took 8 of the requests, the 3 ACKs and the NACK; sent 4 requests, 3 ACKs
        "ar-r1": res({"10.0.0.1": {"rx_packets": 8, "acks_received": 3,
                                   "nacks_received": 1, "tx_packets": 4, "acks_sent": 3}}),
    }
    drops = [{"saddr": "10.0.0.1", "daddr": "10.0.0.2", "dport": 4793, "proto": 17,
              "sport": 53249, "phy": 2, "tail": 0, "mmu": 0, "desc": 0},
             {"saddr": "10.0.0.2", "daddr": "10.0.0.1", "dport": 4793, "proto": 17,
              "sport": 53250, "phy": 1, "tail": 0, "mmu": 0, "desc": 0}]
    a01, a10 = uet_accounts("ar", "allreduce", ranks, results, drops)
    assert (a01["name"], a01["sent"], a01["received"], a01["fabric_drops"]) == (
        "ar r0->r1", 15, 13, 2)
    assert (a10["sent"], a10["received"], a10["fabric_drops"]) == (7, 6, 1)
    assert a01["reordered"] == 0 and a01["complete"] and a01["socket_drops"] == 0
    # two requests short, no fabric drop: rank 1's receive socket overflowed on them
    results["ar-r1"]["counters"]["uet"]["sockets"] = {"overflow_drops": 2, "malformed": {}}
    drops[0]["phy"] = 0
    a01, _ = uet_accounts("ar", "allreduce", ranks, results, drops)
    assert (a01["fabric_drops"], a01["socket_drops"]) == (0, 2)


def test_a_uet_ranks_dropped_datagrams_are_a_fidelity_note():
    from testbed.workloads.base import AgentSpec
    from testbed.workloads.collective import KIND

    spec = AgentSpec(name="ar-r1", node="h2", role="sender", traffic="ar", kind="allreduce",
                     argv=["--rank", "1", "--transport", "uet"], module="agents.collectives")
    res = {"counters": {"transport": "uet", "uet": {"totals": {"malformed": 3,
                                                               "bad_pdcid": 0}}}}
    notes = KIND.fidelity_notes([spec], {"ar-r1": res}, None)  # type: ignore[arg-type]
    assert notes == ["collective rank ar-r1 on h2: its UET NIC dropped 3 datagrams malformed "
                     "(counters.uet.sockets.malformed has the reasons)"]
    res["counters"]["uet"]["totals"]["malformed"] = 0
    assert KIND.fidelity_notes([spec], {"ar-r1": res}, None) == []  # type: ignore[arg-type]


def test_three_worker_processes_all_reduce_over_uet_on_loopback(tmp_path):
    """`python -m agents.collectives --transport uet`, three ranks on 127.0.0.1..3 (one UET
    NIC each, one UDP port): the real algorithms and data, every size checked."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    pytest.importorskip("agents.uet.nic")
    tcp = _free_tcp_ports(3)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        udp = s.getsockname()[1]
    peers = ",".join(f"127.0.0.{r + 1}:{tcp[r]}:{udp}" for r in range(3))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "agents.collectives", "--rank", str(r), "--peers", peers,
         "--transport", "uet", "--uet-cc", "none", "--uet-entropies", "4",
         "--line-rate-bps", "10e9", "--uet-base-rtt-ns", "50000", "--dscp", "10",
         "--dilation", "100",        # the NIC's 1 ms RTO is 100 ms wall: above a busy CPU's lag
         "--op", "allreduce", "--dtype", "float32", "--min-bytes", "4096",
         "--max-bytes", "262144", "--factor", "64", "--warmup", "1", "--iterations", "2",
         "--chunk-bytes", "65552", "--ready-file", str(tmp_path / f"ready{r}"),
         "--out", str(tmp_path / f"r{r}.json")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(3)]
    outs, errs = [], []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            outs.append(json.loads(out.strip().splitlines()[-1]))
            errs.append(err if p.returncode else "")
        assert not any(errs), errs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, o in enumerate(outs):
        assert o["rank"] == r and o["error"] is None and o["transport"] == "uet"
        assert [x["bytes"] for x in o["results"]] == [4096, 262144]
        assert all(x["wrong"] == 0 and isinstance(x["retransmissions"], int)
                   for x in o["results"])
        c = o["counters"]
        assert c["transport"] == "uet" and c["settings"]["options"]["cc"] == "none"
        assert c["bytes_sent"] == c["bytes_posted"] and len(c["uet"]["totals"]["sports"]) > 1
        assert json.loads((tmp_path / f"ready{r}").read_text())["udp_port"] == udp
    assert sum(o["counters"]["bytes_sent"] for o in outs) == sum(
        o["counters"]["bytes_received"] for o in outs)
