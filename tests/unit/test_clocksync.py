"""Clock offsets between scale-out VMs: the NTP arithmetic, the choice of exchange, and the
server and client over real UDP sockets on loopback (no root)."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from testbed.run import clocksync
from testbed.run.clocksync import (
    ClockOffset,
    ClockServer,
    Exchange,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    estimate,
    measure,
)

SECOND = 1_000_000_000
MS = 1_000_000
T0 = 1_750_000_000 * SECOND  # a realistic CLOCK_REALTIME, so no arithmetic hides in floats


def _exchange(*, server_ahead: int, up: int, down: int, processing: int,
              t1: int = T0) -> Exchange:
    # Timestamps as the two clocks would read them: the server's is `server_ahead` ns ahead.
    t2 = t1 + up + server_ahead
    t3 = t2 + processing
    t4 = t1 + up + processing + down
    return Exchange(t1_ns=t1, t2_ns=t2, t3_ns=t3, t4_ns=t4)


def _udp(bind: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if bind:
        sock.bind(("127.0.0.1", 0))
    return sock


def _stop(server: ClockServer, within_s: float = 1.0) -> None:
    # stop() from a helper thread, so that a server that cannot stop fails the test, not hangs it
    stopper = threading.Thread(target=server.stop, daemon=True)
    start = time.monotonic()
    stopper.start()
    stopper.join(timeout=within_s)
    assert not stopper.is_alive(), f"stop() still running after {within_s} s"
    assert time.monotonic() - start < within_s


def _nothing_arrives(sock: socket.socket, wait_s: float = 0.1) -> bool:
    ready, _, _ = select.select([sock], [], [], wait_s)
    return not ready


@pytest.fixture
def server_sock() -> Iterator[socket.socket]:
    sock = _udp()
    yield sock
    sock.close()


@pytest.fixture
def client_sock() -> Iterator[socket.socket]:
    sock = _udp(bind=False)  # measure() must work on a socket it binds implicitly
    yield sock
    sock.close()


# --- the arithmetic ------------------------------------------------------------------------

@pytest.mark.parametrize("ahead", [0, 5 * SECOND, -5 * SECOND, 1, -1, 123_456_789])
def test_symmetric_delays_give_the_exact_offset_client_minus_server(ahead):
    e = _exchange(server_ahead=ahead, up=300_000, down=300_000, processing=40_000)
    assert e.offset_ns == -ahead  # the server is ahead, so the client is behind
    assert e.rtt_ns == 600_000  # the server's 40 us of processing is not on the wire


def test_rtt_excludes_the_servers_processing_time():
    fast = _exchange(server_ahead=7 * MS, up=100, down=100, processing=0)
    slow = _exchange(server_ahead=7 * MS, up=100, down=100, processing=50 * MS)
    assert fast.rtt_ns == slow.rtt_ns == 200
    assert fast.offset_ns == slow.offset_ns == -7 * MS


@pytest.mark.parametrize(("up", "down"), [
    (1_000_000, 0), (0, 1_000_000), (900_000, 100_000), (123, 4_567), (5, 6)])
def test_asymmetric_delays_bias_the_offset_by_at_most_half_the_rtt(up, down):
    ahead = 3 * SECOND
    e = _exchange(server_ahead=ahead, up=up, down=down, processing=25_000)
    assert e.rtt_ns == up + down
    bias = e.offset_ns - (-ahead)
    assert abs(bias) <= e.rtt_ns / 2
    # The bias is half the difference: a slower request makes the server look further ahead.
    assert abs(bias - (down - up) / 2) <= 0.5


def test_estimate_picks_the_exchange_with_the_smallest_round_trip():
    ahead = 2 * SECOND
    exchanges = [
        _exchange(server_ahead=ahead, up=5 * MS, down=1 * MS, processing=0),
        _exchange(server_ahead=ahead, up=30_001, down=20_000, processing=9 * MS),
        _exchange(server_ahead=ahead, up=2 * MS, down=2 * MS, processing=0),
    ]
    best = exchanges[1]
    result = estimate(exchanges, "vm1")
    assert result == ClockOffset(reference="vm1", offset_ns=best.offset_ns, rtt_ns=50_001,
                                 uncertainty_ns=25_001, exchanges=3)
    assert abs(result.offset_ns + ahead) <= result.uncertainty_ns
    assert result.to_dict() == {"reference": "vm1", "offset_ns": best.offset_ns,
                                "rtt_ns": 50_001, "uncertainty_ns": 25_001, "exchanges": 3}


def test_estimate_of_no_exchanges_is_an_error():
    with pytest.raises(ValueError):
        estimate([], "vm1")


def test_the_wire_format_is_as_documented():
    request = encode_request(0x0102030405060708, T0)
    assert request == (b"TBCK\x01\x00\x00\x00" + bytes.fromhex("0102030405060708")
                       + struct.pack(">q", T0))
    assert decode_request(request) == (0x0102030405060708, T0)
    reply = encode_reply(9, T0, T0 + 1, T0 + 2)
    assert len(reply) == 40 and reply[:8] == b"TBCK\x01\x01\x00\x00"
    assert decode_reply(reply) == (9, T0, T0 + 1, T0 + 2)
    assert decode_request(reply) is None and decode_reply(request) is None


# --- server and client over loopback -------------------------------------------------------

def test_measure_against_a_server_five_seconds_ahead(server_sock, client_sock):
    server = ClockServer(server_sock, clock=lambda: time.time_ns() + 5 * SECOND)
    server.start()
    try:
        result = measure(client_sock, server_sock.getsockname(), "ref", count=16,
                         timeout_s=0.2)
    finally:
        _stop(server)
    assert result is not None
    assert result.reference == "ref"
    assert abs(result.offset_ns - (-5 * SECOND)) <= 2 * MS  # the client is behind
    assert result.exchanges == 16
    assert 0 <= result.rtt_ns < 50 * MS
    assert result.uncertainty_ns == -(-result.rtt_ns // 2)
    assert server.requests == 16 and server.malformed == 0


MALFORMED = {
    "wrong magic": b"XBCK" + encode_request(1, T0)[4:],
    "short": encode_request(1, T0)[:20],
    "empty": b"",
    "wrong version": encode_request(1, T0)[:4] + b"\x02" + encode_request(1, T0)[5:],
    "a reply": encode_reply(1, T0, T0, T0),
    "unknown type": encode_request(1, T0)[:5] + b"\x07" + encode_request(1, T0)[6:],
    "padding not zero": encode_request(1, T0)[:6] + b"\x00\x01" + encode_request(1, T0)[8:],
    "trailing bytes": encode_request(1, T0) + b"\x00",
}


def test_malformed_datagrams_are_counted_and_unanswered(server_sock, client_sock):
    server = ClockServer(server_sock)
    server.start()
    sender = _udp()
    try:
        for data in MALFORMED.values():
            sender.sendto(data, server_sock.getsockname())
        # Queued behind the malformed ones, so once it is answered they have all been seen.
        result = measure(client_sock, server_sock.getsockname(), "ref", count=2)
        assert _nothing_arrives(sender)
    finally:
        _stop(server)
        sender.close()
    assert result is not None and result.exchanges == 2
    assert server.malformed == len(MALFORMED)
    assert server.requests == 2


def _fake_server(sock: socket.socket, other: socket.socket, offset_ns: int) -> None:
    # Answers one request with everything measure() must ignore, then with the real reply.
    data, peer = sock.recvfrom(512)
    request = decode_request(data)
    assert request is not None
    sequence, t1 = request
    bogus = T0 - 777 * SECOND
    other.sendto(encode_reply(sequence, t1, bogus, bogus), peer)  # another sender
    sock.sendto(encode_reply((sequence - 1) % 2**64, t1, bogus, bogus), peer)  # stale sequence
    sock.sendto(encode_reply(sequence, t1 - 1, bogus, bogus), peer)  # t1 not ours
    sock.sendto(b"garbage", peer)
    now = time.time_ns() + offset_ns
    sock.sendto(encode_reply(sequence, t1, now, now), peer)


def test_stale_and_foreign_replies_are_ignored(server_sock, client_sock):
    other = _udp()
    thread = threading.Thread(target=_fake_server, args=(server_sock, other, 3 * SECOND))
    thread.start()
    try:
        result = measure(client_sock, server_sock.getsockname(), "ref", count=1,
                         timeout_s=1.0)
    finally:
        thread.join(timeout=2)
        other.close()
    assert result is not None and result.exchanges == 1
    assert abs(result.offset_ns - (-3 * SECOND)) <= 2 * MS


def test_a_stale_reply_alone_is_no_reply(server_sock, client_sock):
    def answer_late() -> None:
        data, peer = server_sock.recvfrom(512)
        request = decode_request(data)
        assert request is not None
        sequence, t1 = request
        server_sock.sendto(encode_reply((sequence + 1) % 2**64, t1, T0, T0), peer)

    thread = threading.Thread(target=answer_late)
    thread.start()
    result = measure(client_sock, server_sock.getsockname(), "ref", count=1, timeout_s=0.2)
    thread.join(timeout=2)
    assert result is None


def test_no_server_listening_gives_none_after_the_timeouts(client_sock):
    silent = _udp()  # bound but never read: no ICMP, no reply
    closed = _udp()
    closed_address = closed.getsockname()
    closed.close()  # nothing bound at all: loopback's port unreachable must not matter
    try:
        for address in (silent.getsockname(), closed_address):
            start = time.monotonic()
            assert measure(client_sock, address, "ref", count=3, timeout_s=0.05) is None
            assert 0.14 <= time.monotonic() - start < 0.5
    finally:
        silent.close()


def test_measure_refuses_a_pointless_request(client_sock):
    with pytest.raises(ValueError):
        measure(client_sock, ("127.0.0.1", clocksync.CLOCK_PORT), "ref", count=0)
    with pytest.raises(ValueError):
        measure(client_sock, ("127.0.0.1", clocksync.CLOCK_PORT), "ref", timeout_s=0)


def test_stop_returns_promptly_without_traffic(server_sock):
    server = ClockServer(server_sock)
    server.start()
    time.sleep(0.05)
    _stop(server, within_s=1.0)
    assert server.requests == 0 and server.malformed == 0
    server.stop()  # a second stop, like one without start, is harmless
    ClockServer(server_sock).stop()
