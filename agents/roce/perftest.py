"""perftest-style tests over the user-space RoCEv2 transport: write_bw, write_lat, send_bw.

The command line lives in `agents.roce.__main__`; this module holds what it runs.

Connection set-up is out of band, as perftest does it: the client opens a TCP
connection to the server (default port 18515), sends one JSON line describing
the test and its QPs (QPN, first PSN, UDP source port, and for write_lat the
memory region the server writes back into), and the server answers with its
QPs (QPN, first PSN, R_Key, VA, length). Data then flows over UDP 4791. At the
end the client sends {"done": ...} with the number of messages each QP
completed; the server checks its buffers (with --verify), answers with the
result, and both print their counters and exit.

Data pattern: QP i of the client sends bytes from a buffer filled by
random.Random(seed + i), 64 KiB at a time (`pattern`); message k goes to slot k mod
`slots` (slots = min(iters, buffer_bytes // size), at least 1) of the remote buffer, so
the server can recompute what must be there byte for byte.

Memory: one agent runs per stream end, so its size is the fabric's (bench/agent_memory.py,
measured in bench/README.md). The buffers are plain bytes (anonymous mmaps for the
regions written into, whose pages become resident only when written, as calloc's did) and
the agent does not import numpy, which alone cost each process ~16 MB.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import json
import math
import mmap
import os
import random
import select
import socket
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from agents.rdma.options import (
    cc_params,
    cc_record,
    cc_settings,
    make_np,
    make_rate_controller,
    qp_attrs,
)
from agents.rdma.qp import MemoryRegion, RcQp, WcStatus
from agents.rdma.transport import CNP_DSCP, Binding, Endpoint, Engine, Stopped, rxe_sport
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.messages import MAX_MESSAGE_BYTES, BadMessage, decode_message
from agents.runtime.output import mark_ready
from agents.runtime.sockets import dial_tcp
from agents.runtime.start import await_start
from agents.timebase import Dilation, FabricClock
from agents.wire import BytesLike
from agents.wire.roce import PSN_MASK, ROCE_UDP_PORT, icrc_context

PROTOCOL_VERSION = 1
DEFAULT_CONTROL_PORT = 18515
TESTS = ("write_bw", "write_lat", "send_bw")
MAX_RECV_DEPTH = 512
CONTROL_CHECK_STEPS = 256


class TestError(Exception):
    """A test that cannot go on: the message goes to stderr and into the JSON."""


class ControlRefused(TestError):
    """A control message that is not a bounded JSON object; `reason` is its counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"bad control message: {detail}")
        self.reason = reason


# --- small helpers ----------------------------------------------------------------------


def slots_for(size: int, iters: int | None, buffer_bytes: int) -> int:
    """How many distinct message slots the buffers hold."""
    if size <= 0:
        return 1
    cap = max(1, buffer_bytes // size)
    return max(1, min(iters, cap) if iters else cap)


PATTERN_CHUNK = 1 << 16


def pattern(seed: int, nbytes: int) -> bytearray:
    """The bytes a client QP writes: random.Random(seed)'s bytes, drawn 64 KiB at a time
    into one buffer (so making it never holds more than the buffer and one chunk)."""
    rng = random.Random(seed)
    out = bytearray(nbytes)
    for off in range(0, nbytes, PATTERN_CHUNK):
        n = min(PATTERN_CHUNK, nbytes - off)
        out[off:off + n] = rng.randbytes(n)
    return out


def region(nbytes: int) -> mmap.mmap:
    """A zeroed writable buffer of at least one byte whose pages become resident only
    once written (an anonymous mapping)."""
    return mmap.mmap(-1, max(1, nbytes))


def address(buf: mmap.mmap | bytearray) -> int:
    """Where `buf`'s bytes are in this process (the VA a memory region is announced at)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def first_mismatch(got: BytesLike, want: BytesLike) -> int | None:
    """None if the two hold the same bytes, else the first offset where they differ (the
    shorter one's length if one is a prefix of the other)."""
    g, w = memoryview(got).cast("B"), memoryview(want).cast("B")
    n = min(g.nbytes, w.nbytes)
    for off in range(0, n, PATTERN_CHUNK):
        end = min(off + PATTERN_CHUNK, n)
        a, b = bytes(g[off:end]), bytes(w[off:end])
        if a != b:
            return off + next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return None if g.nbytes == w.nbytes else n


def latency_stats(samples_ns: list[float]) -> dict:
    """perftest's latency figures: min, max, typical (median), avg, stdev, 99 % and 99.9 %."""
    if not samples_ns:
        return {k: None for k in ("t_min", "t_max", "t_typical", "t_avg", "t_stdev", "p99",
                                  "p99_9")}
    s = sorted(samples_ns)
    n = len(s)
    avg = sum(s) / n
    var = sum((x - avg) ** 2 for x in s) / n

    def pct(q: float) -> float:
        return s[min(n - 1, max(0, math.ceil(q * n) - 1))]

    to_us = 1e-3
    return {"t_min": s[0] * to_us, "t_max": s[-1] * to_us, "t_typical": s[n // 2] * to_us,
            "t_avg": avg * to_us, "t_stdev": math.sqrt(var) * to_us, "p99": pct(0.99) * to_us,
            "p99_9": pct(0.999) * to_us}


class ControlChannel:
    """JSON lines over the TCP set-up connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, obj: dict) -> None:
        try:
            self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        except OSError:
            self.closed = True

    def poll(self) -> dict | None:
        """The next whole message if one is there (never blocks)."""
        if b"\n" not in self._buf and len(self._buf) > MAX_MESSAGE_BYTES:
            self._buf = b""
            self.closed = True
            raise ControlRefused("too_large", f"a line longer than {MAX_MESSAGE_BYTES} bytes")
        if b"\n" not in self._buf and not self.closed:
            try:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                self.closed = True
            elif data:
                self._buf += data
        if b"\n" in self._buf:
            line, _, self._buf = self._buf.partition(b"\n")
            try:
                return decode_message(line)
            except BadMessage as e:
                raise ControlRefused(e.reason, str(e)) from None
        return None

    def recv(self, life: Lifecycle, timeout_s: float, engine: Engine | None = None) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.poll()
            if msg is not None:
                return msg
            if self.closed:
                raise TestError("the peer closed the control connection")
            if life.should_stop():
                raise Stopped()
            if time.monotonic() > deadline:
                raise TestError(f"no answer on the control connection within {timeout_s} s")
            if engine is not None:
                if not engine.step():
                    select.select([self.sock], [], [], 0.002)
            else:
                select.select([self.sock], [], [], 0.05)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Live:
    """What --control-sock serves: per-QP counters and rates, now."""

    def __init__(self, role: str, test: str) -> None:
        self.role = role
        self.test = test
        self.bindings: list[Binding] = []
        self.endpoints: list[Endpoint] = []
        self.phase = "setup"
        #: set-up connections refused (server), per reason; docs/roce.md "The set-up channel"
        self.setup_refused: dict[str, int] = {}
        #: a server of several streams (--streams): each stream's name and its QPs, and
        #: where each stream is (agents.roce.responder); None: one stream, the flat form
        self.streams: list[tuple[str, list[Binding]]] | None = None
        self.stream_phase: Callable[[], dict[str, str]] = dict

    def refuse(self, reason: str, detail: str, peer: str) -> None:
        """Count and log one refused set-up connection; the server goes on serving."""
        self.setup_refused[reason] = self.setup_refused.get(reason, 0) + 1
        print(f"agents.roce server: refused set-up from {peer} ({reason}): {detail}",
              file=sys.stderr, flush=True)

    def refusals(self) -> dict:
        """The server's set-up refusal counters (a client has none)."""
        if self.role != "server":
            return {}
        return {"setup_refused": dict(self.setup_refused),
                "setup_refused_total": sum(self.setup_refused.values())}

    def snapshot(self) -> dict:
        if self.streams is not None:
            return self._streams_snapshot()
        qps = [b.counters() for b in list(self.bindings)]
        return {"role": self.role, "test": self.test, "phase": self.phase,
                **self.refusals(),
                "qps": {str(c["qpn"]): c for c in qps},
                "endpoints": [ep.counters() for ep in list(self.endpoints)],
                **flat_counters(self.role, qps)}


    def _streams_snapshot(self) -> dict:
        """A server of several streams: its own numbers (mode "responder") and, under
        `streams`, each stream's as a one-stream server's (mode "recv"), which the run's
        collector stores under the stream's name (testbed/run/collector.py)."""
        assert self.streams is not None
        phases = self.stream_phase()
        eps = list(self.endpoints)
        streams = []
        for name, bindings in list(self.streams):
            qps = [b.counters() for b in list(bindings)]
            streams.append({"name": name, "phase": phases.get(name), **flat_counters(
                "server", qps)})
        return {"role": self.role, "phase": self.phase, "mode": "responder",
                **self.refusals(), "streams": streams,
                "streams_running": sum(1 for p in phases.values() if p == "running"),
                "streams_done": sum(1 for p in phases.values() if p == "done"),
                "rx_socket_drops": sum(ep.overflow_drops for ep in eps),
                "endpoints": [ep.counters() for ep in eps]}


# Summed over a side's QPs into top-level numbers, which a run's collector stores as
# time series `<mode>.<field>` (mode "send" for a client, "recv" for a server).
_SEND_SUMS = {"packets": "packets_sent", "bytes": "bytes_sent",
              "wire_bytes": "wire_bytes_sent", "payload_bytes": "payload_bytes_sent",
              "bytes_completed": "bytes_completed", "messages": "messages_completed",
              "retransmissions": "retransmissions", "naks": "naks_received",
              "timeouts": "timeouts", "cnps": "cnps_received"}
_RECV_SUMS = {"packets": "packets_received", "bytes": "payload_bytes_received",
              "duplicates": "duplicates", "ooo_drops": "ooo_drops", "naks": "naks_sent",
              "ce_packets": "ce_packets_received", "cnps": "cnps_sent",
              "acks": "acks_sent"}


def flat_counters(role: str, qps: list[dict]) -> dict:
    """Numbers only, for time series: `mode` and per-side sums, plus Rc / Rt / alpha.

    client (mode "send"): packets, bytes (UDP payload), wire_bytes, payload_bytes,
    bytes_completed, messages, retransmissions, naks, timeouts, cnps (received),
    rc_bps / rt_bps (sums over the QPs), and per QP i (in QPN order) qp<i>.rc_bps,
    qp<i>.rt_bps, qp<i>.alpha, qp<i>.cnps. server (mode "recv"): packets, bytes (RDMA
    payload accepted in order), wire_bytes (UDP payload + 66 B per packet), duplicates,
    ooo_drops, naks (sent), ce_packets, cnps (sent), acks.
    """
    if role == "client":
        side, sums, mode = "requester", _SEND_SUMS, "send"
    else:
        side, sums, mode = "responder", _RECV_SUMS, "recv"
    out: dict = {"mode": mode}
    for name, key in sums.items():
        out[name] = sum(q[side].get(key, 0) for q in qps)
    if role == "client":
        out["rc_bps"] = sum(q.get("rc_bps") or 0 for q in qps)
        out["rt_bps"] = sum(q.get("rt_bps") or 0 for q in qps)
        for i, q in enumerate(sorted(qps, key=lambda c: c["qpn"])):
            out[f"qp{i}.rc_bps"] = q.get("rc_bps") or 0
            out[f"qp{i}.rt_bps"] = q.get("rt_bps") or 0
            if q.get("alpha") is not None:
                out[f"qp{i}.alpha"] = q["alpha"]
            out[f"qp{i}.cnps"] = q[side].get("cnps_received", 0)
    else:
        out["wire_bytes"] = sum(q.get("bytes_received", 0)
                                + WIRE_OVERHEAD_BYTES * q.get("packets_received", 0)
                                for q in qps)
    return out


def _header(args: Namespace, title: str, dilation: Dilation, cc: tuple[str, str | None], qps: int,
            mtu: int) -> str:
    line = "-" * 87
    kind, name = cc
    return "\n".join([
        line,
        f"{title:^87}",
        f" Number of qps   : {qps:<10}Transport type : RoCEv2 RC, user space over UDP "
        f"{ROCE_UDP_PORT}",
        f" Mtu             : {mtu}[B]    Dilation       : {dilation.factor} (fabric units; "
        f"wall = fabric x {dilation.factor})",
        f" CC              : {kind}{'/' + name if name else ''}"
        f"{f' + {len(args.cc_params)} overrides' if args.cc_params else ''}   line rate "
        f"{args.line_rate_bps / 1e9:.2f} Gb/s fabric",
        line,
    ])


def bw_table(args: Namespace, title: str, dilation: Dilation, cc: tuple[str, str | None],
             qps: int, mtu: int, size: int, iters: int, bw_fabric: float, rate_fabric: float,
             bw_wall: float, rate_wall: float) -> str:
    """perftest's bandwidth table: the header, then one row (fabric units, --wall adds
    wall units)."""
    cols = " #bytes     #iterations    BW average[Gb/sec]   MsgRate[Mpps]"
    row = f" {size:<10} {iters:<14} {bw_fabric / 1e9:<20.2f} {rate_fabric / 1e6:<.6f}"
    if args.wall:
        cols += "   wall BW[Gb/sec]   wall MsgRate[Mpps]"
        row += f"      {bw_wall / 1e9:<17.6f} {rate_wall / 1e6:.6f}"
    return "\n".join([_header(args, title, dilation, cc, qps, mtu), cols, row, "-" * 87])


def lat_table(args: Namespace, title: str, dilation: Dilation, cc: tuple[str, str | None],
              mtu: int, size: int, iters: int, fab: dict, wall: dict) -> str:
    """perftest's latency table: the header, then the fabric row (and the wall row)."""
    cols = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    "
            "t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]")

    def row(st: dict, tag: str) -> str:
        def f(v: float | None) -> str:
            return f"{v:.2f}" if v is not None else "-"
        return (f" {size:<6} {iters:<13} {f(st['t_min']):<14} {f(st['t_max']):<12} "
                f"{f(st['t_typical']):<18} {f(st['t_avg']):<14} {f(st['t_stdev']):<15} "
                f"{f(st['p99']):<22} {f(st['p99_9'])}{tag}")

    rows = [row(fab, "   (fabric)")]
    if args.wall:
        rows.append(row(wall, "   (wall)"))
    return "\n".join([_header(args, title, dilation, cc, 1, mtu), cols, *rows, "-" * 87])


TITLES = {"write_bw": "RDMA_Write BW Test", "write_lat": "RDMA_Write Latency Test",
          "send_bw": "Send BW Test"}


def _connect(server: str, port: int, bind: str | None, timeout_s: float,
             life: Lifecycle) -> socket.socket:
    try:
        s = dial_tcp((server, port), bind, time.monotonic() + timeout_s, life.should_stop,
                     attempt_s=2.0)
    except TimeoutError as e:
        raise TestError(f"cannot connect to {server}:{port}: {e}") from None
    if s is None:
        raise TestError(f"cannot connect to {server}:{port}: stopped")
    return s


# --- client -----------------------------------------------------------------------------


def _client_qps(local_ip: str, args: Namespace, life: Lifecycle) -> list[tuple[int, Endpoint]]:
    """(QPN, endpoint bound to rxe_sport(QPN)) for each QP; a taken port moves to the next QPN.
    With --sport, QP i's endpoint binds the i-th port given (a QP pinned to a path): a
    taken one is an error, since another port would take another path."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    qpn = args.qpn_base if args.qpn_base is not None else rng.randrange(0x100, 0xF00000)
    out: list[tuple[int, Endpoint]] = []
    if args.sport:
        for i, sport in enumerate(args.sport):
            try:
                ep = Endpoint(local_ip, sport, dscp=args.dscp, cnp_dscp=args.cnp_dscp,
                              should_stop=life.should_stop,
                              sndbuf_bytes=args.sndbuf_bytes or None)
            except OSError as e:
                for _, taken in out:
                    taken.close()
                raise TestError(f"QP {i}'s source port {sport} (--sport): {e.strerror}") from e
            out.append(((qpn + i) & 0xFFFFFF or 0x100, ep))
        return out
    used: set[int] = set()
    tries = 0
    while len(out) < args.qps:
        tries += 1
        if tries > 100_000:
            raise TestError("no free rxe source port for the QPs")
        sport = rxe_sport(qpn)
        if sport not in used:
            try:
                ep = Endpoint(local_ip, sport, dscp=args.dscp, cnp_dscp=args.cnp_dscp,
                              should_stop=life.should_stop,
                              sndbuf_bytes=args.sndbuf_bytes or None)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:   # taken: try the next QPN
                    raise
            else:
                used.add(sport)
                out.append((qpn, ep))
        qpn = (qpn + 1) & 0xFFFFFF or 0x100
    return out


def run_client(args: Namespace, life: Lifecycle, live: Live) -> tuple[dict, int]:
    dilation = Dilation(args.dilation)
    clock = FabricClock(dilation)
    cc = cc_settings(args)
    params = cc_params(args, cc)
    test = args.test
    size = args.size
    if test == "write_lat" and args.qps != 1:
        raise TestError("write_lat runs one QP (--qps 1)")
    iters = args.iters
    slots = 1 if test == "write_lat" else slots_for(size, iters, args.buffer_bytes)
    tcp = _connect(args.server, args.port, args.bind, args.connect_timeout_s, life)
    ctl = ControlChannel(tcp)
    endpoints: list[Endpoint] = []
    try:
        local_ip = args.bind or tcp.getsockname()[0]
        qp_eps = _client_qps(local_ip, args, life)
        endpoints = [ep for _, ep in qp_eps]
        live.endpoints = endpoints
        rng = random.Random()
        bufs = [pattern(args.seed + i, slots * size) for i in range(args.qps)]
        # write_lat: the server writes back into this region of ours
        back = [region(size) for _ in range(args.qps)]
        back_rkeys = [rng.randrange(1, 1 << 32) for _ in range(args.qps)]
        psns = [rng.randrange(0, PSN_MASK + 1) for _ in range(args.qps)]
        hello = {
            "version": PROTOCOL_VERSION, "test": test, "size": size, "iters": iters,
            "slots": slots, "seed": args.seed, "mtu": args.mtu, "verify": args.verify,
            **({"stream": args.stream} if args.stream else {}),
            "qps": [{"qpn": qpn, "psn": psns[i], "sport": ep.port,
                     "rkey": back_rkeys[i], "va": address(back[i]),
                     "length": len(back[i])} for i, (qpn, ep) in enumerate(qp_eps)],
        }
        ctl.send(hello)
        reply = ctl.recv(life, args.connect_timeout_s)
        if not reply.get("ok"):
            raise TestError(f"server refused the test: {reply.get('error')}")
        remote = reply["qps"]
        udp_port = int(reply.get("udp_port", ROCE_UDP_PORT))
        attrs = qp_attrs(args, args.mtu)
        engine = Engine(clock, dilation, spin_ns=args.spin_ns)
        bindings: list[Binding] = []
        for i, (qpn, ep) in enumerate(qp_eps):
            r = remote[i]
            ctx = icrc_context(local_ip, args.server, ep.port, udp_port)
            mr = MemoryRegion(memoryview(back[i]), hello["qps"][i]["va"], back_rkeys[i])
            qp = RcQp(qpn, r["qpn"], ctx, attrs,
                      make_rate_controller(args, cc, clock.now_ns()),
                      np=make_np(args, cc[0], params), mrs={mr.rkey: mr}, clock=clock,
                      sq_psn=psns[i], rq_psn=r["psn"])
            bindings.append(ep.attach(qp, (args.server, udp_port),
                                      drop_every=args.drop_every, drop_prob=args.drop_prob,
                                      drop_seed=args.drop_seed + i))
            engine.add(ep)
        live.bindings = bindings
        mark_ready(args.ready_file)
        await_start(args, life)
        live.phase = "running"
        if test == "write_lat":
            result = _client_lat(args, life, engine, bindings[0], bufs[0], remote[0], back[0])
        else:
            result = _client_bw(args, life, engine, bindings, bufs, remote, slots)
        live.phase = "done"
        verify: dict[str, object] = {"verified": None, "first_mismatch": None}
        if not ctl.closed:
            ctl.send({"done": True, "messages": result["per_qp_messages"],
                      "stopped_by": life.stop_reason})
            try:
                answer = ctl.recv(Lifecycle(), 60.0, engine)
                verify = {"verified": answer.get("verified"),
                          "first_mismatch": answer.get("first_mismatch")}
            except (TestError, Stopped) as e:
                verify["verify_error"] = str(e)
        error = next((b.qp.requester.error or b.qp.responder.error for b in bindings
                      if b.qp.requester.error or b.qp.responder.error), None)
        # how long after --start-at-mono-ns the first message was posted, fabric ns
        late = (round(dilation.to_fabric_ns(result["first_post_mono_ns"]
                                            - args.start_at_mono_ns))
                if args.start_at_mono_ns else None)
        counters = {
            "role": "client", "test": test, "server": args.server, "local_ip": local_ip,
            "start_late_fabric_ns": late,
            "size": size, "iters": iters, "duration_ns": args.duration_ns, "qp_count": args.qps,
            "mtu": args.mtu, "slots": slots, "seed": args.seed, "dilation": dilation.factor,
            **cc_record(args, cc, params), "line_rate_bps": args.line_rate_bps,
            "dscp": args.dscp, "cnp_dscp": args.cnp_dscp, **result, **verify,
            "qps": {str(b.qp.qpn): b.counters() for b in bindings},
            "malformed": _sum_malformed(endpoints),
            "endpoints": [ep.counters() for ep in endpoints],
            "fast_path": _fast_path(endpoints),
            "qp_attrs": attrs.to_dict(), "window_packets": attrs.window_packets,
            "engine": {"steps": engine.steps, "waits": engine.waits},
            "stopped_by": life.stop_reason or ("duration" if result["duration_ended"]
                                               else "done"),
            "error": error,
        }
        title = TITLES[test]
        if test == "write_lat":
            table = lat_table(args, title, dilation, cc, args.mtu, size,
                              result["messages"], result["latency_fabric_us"],
                              result["latency_wall_us"])
        else:
            table = bw_table(args, title, dilation, cc, args.qps, args.mtu, size,
                             result["messages"], result["bw_fabric_bps"],
                             result["msg_rate_fabric_pps"], result["bw_wall_bps"],
                             result["msg_rate_wall_pps"])
        print(table, file=sys.stderr)
        rc = 0 if error is None and verify["verified"] is not False else 1
        return counters, rc
    finally:
        ctl.close()
        for ep in endpoints:
            ep.close()


def _fast_path(endpoints: list[Endpoint]) -> dict:
    """Which packet path the endpoints ran (agents.fast): {"on", "reason"}; with none
    made, what the process would have run."""
    if endpoints:
        return dict(endpoints[0].fast_path)
    from agents import fast
    return fast.status()


def _sum_malformed(endpoints: list[Endpoint]) -> dict:
    out: dict[str, int] = {}
    for ep in endpoints:
        for k, v in ep.malformed.items():
            out[k] = out.get(k, 0) + v
    return out


def _rates(dilation: Dilation, nbytes: int, messages: int, packets: int, wall_ns: int) -> dict:
    fabric_ns = dilation.to_fabric_ns(wall_ns)
    wall_s = wall_ns / 1e9 if wall_ns > 0 else 0.0
    fabric_s = fabric_ns / 1e9
    return {
        "elapsed_wall_ns": wall_ns,
        "elapsed_fabric_ns": round(fabric_ns),
        "bw_fabric_bps": nbytes * 8 / fabric_s if fabric_s else 0.0,
        "bw_wall_bps": nbytes * 8 / wall_s if wall_s else 0.0,
        "msg_rate_fabric_pps": messages / fabric_s if fabric_s else 0.0,
        "msg_rate_wall_pps": messages / wall_s if wall_s else 0.0,
        "packet_rate_wall_pps": packets / wall_s if wall_s else 0.0,
    }


@dataclass
class _BwProgress:
    """Where a bandwidth test's client is: still posting, and what ended it."""

    posting: bool = True
    failed: str | None = None           # status of an error completion, if one came
    duration_ended: bool = False


def _client_bw(args: Namespace, life: Lifecycle, engine: Engine, bindings: list[Binding],
               bufs: list[bytearray], remote: list[dict], slots: int) -> dict:
    size = args.size
    iters = args.iters
    dilation = engine.dilation
    n = len(bindings)
    posted = [0] * n
    completed = [0] * n
    nbytes = [0] * n
    views = [memoryview(b) for b in bufs]      # of the patterns
    slot_views = [[views[i][k * size:(k + 1) * size] for k in range(slots)] for i in range(n)]
    reqs = [b.qp.requester for b in bindings]
    depth = args.tx_depth
    send = args.test == "send_bw"
    start = time.monotonic_ns()
    end = start + dilation.to_wall_ns(args.duration_ns) if args.duration_ns else None
    state = _BwProgress()

    def hook() -> None:
        if state.posting and end is not None and time.monotonic_ns() >= end:
            state.posting = False
            state.duration_ended = True
        for i in range(n):
            r = reqs[i]
            comps = r.completions
            while comps:
                c = comps.popleft()
                if c.status != WcStatus.SUCCESS:
                    state.failed = c.status
                    continue
                completed[i] += 1
                nbytes[i] += c.byte_len
            if state.posting:
                while r.outstanding_messages < depth and (iters is None or posted[i] < iters):
                    k = posted[i] % slots
                    if send:
                        r.post_send(posted[i], slot_views[i][k])
                    else:
                        r.post_write(posted[i], slot_views[i][k], remote[i]["va"] + k * size,
                                     remote[i]["rkey"])
                    posted[i] += 1

    def done() -> bool:
        if state.failed or any(r.state != "rts" for r in reqs):
            return True
        if state.posting and iters is not None and all(p >= iters for p in posted):
            state.posting = False
        return not state.posting and all(r.idle for r in reqs)

    hook()
    try:
        engine.run(done, stop=life.should_stop, hook=hook)
    except Stopped:
        pass
    hook()
    wall_ns = time.monotonic_ns() - start
    packets = sum(r.packets_sent for r in reqs)
    total = sum(nbytes)
    msgs = sum(completed)
    return {"messages": msgs, "bytes": total, "per_qp_messages": completed,
            "data_packets_sent": packets, "completion_error": state.failed,
            "duration_ended": state.duration_ended, "first_post_mono_ns": start,
            **_rates(dilation, total, msgs, packets, wall_ns)}


def _client_lat(args: Namespace, life: Lifecycle, engine: Engine, b: Binding, buf: bytearray,
                remote: dict, back: mmap.mmap) -> dict:
    size = args.size
    iters = args.iters
    dilation = engine.dilation
    qp = b.qp
    r, rs = qp.requester, qp.responder
    view = memoryview(buf)[:size]
    samples: list[int] = []
    start = time.monotonic_ns()
    end = start + dilation.to_wall_ns(args.duration_ns) if args.duration_ns else None
    i = 0
    ended = False
    try:
        while iters is None or i < iters:
            if end is not None and time.monotonic_ns() >= end:
                ended = True
                break

            def answered(seen: int = rs.write_messages) -> bool:
                """The server's WRITE back has landed (or the QP failed)."""
                return rs.write_messages > seen or r.state != "rts"

            t0 = time.monotonic_ns()
            r.post_write(i, view, remote["va"], remote["rkey"])
            engine.run(answered, stop=life.should_stop)
            if life.stop_reason is not None or r.state != "rts":
                break
            samples.append(time.monotonic_ns() - t0)
            r.completions.clear()
            i += 1
        # let the last ACKs settle
        engine.run(lambda: r.idle or r.state != "rts", stop=life.should_stop)
    except Stopped:
        pass
    wall_ns = time.monotonic_ns() - start
    half = [s / 2 for s in samples]           # perftest reports half the round trip
    msgs = len(samples)
    return {"messages": msgs, "bytes": msgs * size, "per_qp_messages": [msgs],
            "data_packets_sent": r.packets_sent, "duration_ended": ended,
            "first_post_mono_ns": start,
            "latency_fabric_us": latency_stats([dilation.to_fabric_ns(x) for x in half]),
            "latency_wall_us": latency_stats(half),
            **_rates(dilation, msgs * size, msgs, r.packets_sent, wall_ns)}


# --- server -----------------------------------------------------------------------------


def _listen(args: Namespace, backlog: int = 1) -> socket.socket:
    """The set-up socket, listening. The UDP port is bound per stream at its set-up (on
    the address its client reaches); port 0 (one stream alone) asks for a free one now,
    which the ready file then names."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((args.bind or "", args.port))
    lsock.listen(backlog)
    if args.roce_port == 0:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.bind((args.bind or "", 0))
        args.roce_port = probe.getsockname()[1]
        probe.close()
    return lsock


def peer_allowed(peer_ip: str, subnets: list[str] | None) -> bool:
    """Whether a set-up connection from `peer_ip` comes from one of `subnets`
    (--peer-subnet; None: from anywhere)."""
    if not subnets:
        return True
    try:
        ip = ipaddress.ip_address(peer_ip)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(n, strict=False) for n in subnets)


class _Serving:
    """What the server does for the client's QPs at every engine step of a running test.

    send_bw: take each received SEND's completion, check it against the client's pattern
    (with --verify) and post its buffer again; write_lat: answer each WRITE that arrived
    with a WRITE back (the ping-pong whose round trip the client measures); write_bw:
    nothing, the data lands in the memory regions by itself.
    """

    def __init__(self, test: str, bindings: list[Binding], client_qps: list[dict],
                 rq_bufs: list[list[memoryview]], slots: int, size: int, seed: int,
                 verify: bool, expected: list[bytearray] | None) -> None:
        self.bindings = bindings
        self.client_qps = client_qps
        self.rq_bufs = rq_bufs
        self.slots = slots
        self.size = size
        self.expected = expected            # the client's patterns, when verifying
        self.verified: bool | None = True if verify and test == "send_bw" else None
        self.first_mismatch: dict | None = None
        self.done_msg: dict | None = None
        self.recv_count = [0] * len(bindings)
        self.lat_seen = [0] * len(bindings)
        self.lat_view = (memoryview(pattern(seed ^ 0x5A5A, max(size, 1)))[:size]
                         if test == "write_lat" else memoryview(b""))
        per_qp: dict[str, Callable[[int, Binding], None]] = {
            "send_bw": self._take_sends, "write_lat": self._write_back}
        self._per_qp = per_qp.get(test)

    def step(self) -> None:
        if self._per_qp is not None:
            for i, b in enumerate(self.bindings):
                self._per_qp(i, b)

    def _take_sends(self, i: int, b: Binding) -> None:
        rs = b.qp.responder
        comps = rs.completions
        while comps:
            c = comps.popleft()
            buf = self.rq_bufs[i][c.wr_id]
            if self.verified and self.expected is not None:
                self._check(i, c.byte_len, buf, self.expected[i])
            self.recv_count[i] += 1
            rs.post_recv(c.wr_id, buf)

    def _check(self, i: int, byte_len: int, buf: memoryview, want: bytearray) -> None:
        """Received SEND number recv_count[i] of QP i must be slot (that mod slots) of
        the client's pattern, whole."""
        size = self.size
        k = self.recv_count[i] % self.slots
        bad = first_mismatch(buf[:byte_len], memoryview(want)[k * size:(k + 1) * size])
        if bad is not None or byte_len != size:
            self.verified = False
            self.first_mismatch = {"qp": i, "message": self.recv_count[i], "offset": bad}

    def _write_back(self, i: int, b: Binding) -> None:
        rs, r = b.qp.responder, b.qp.requester
        c = self.client_qps[i]
        while rs.write_messages > self.lat_seen[i]:
            self.lat_seen[i] += 1
            r.post_write(self.lat_seen[i], self.lat_view, int(c["va"]), int(c["rkey"]))
        r.completions.clear()

    def result(self, dilation: Dilation, wall_ns: int) -> dict:
        responders = [b.qp.responder for b in self.bindings]
        nbytes = sum(rs.payload_bytes_received for rs in responders)
        msgs = sum(rs.write_messages + rs.send_messages for rs in responders)
        pkts = sum(rs.packets_received for rs in responders)
        return {"done_msg": self.done_msg, "verified": self.verified,
                "first_mismatch": self.first_mismatch, "messages": msgs, "bytes": nbytes,
                "data_packets_received": pkts,
                **_rates(dilation, nbytes, msgs, pkts, wall_ns)}


def _verify_writes_steps(mems: list[mmap.mmap], messages: list[int], slots: int, size: int,
                        seed: int, out: dict,
                        expected: list[bytearray] | None = None) -> Iterator[None]:
    """Check that each QP's region holds the client's pattern in every slot it wrote,
    yielding after each 64 KiB (a responder serving other streams steps it between
    engine steps); the verdict goes into `out` ("verified", "first_mismatch"). Without
    `expected` the pattern is drawn as `pattern` draws it, 64 KiB at a time, and
    compared chunk by chunk: the same bytes, never the whole of it in memory at once."""
    for i, mem in enumerate(mems):
        n = min(int(messages[i]) if i < len(messages) else 0, slots) * size
        if n == 0:
            continue
        got = memoryview(mem)
        bad = None
        if expected is not None:
            bad = first_mismatch(got[:n], memoryview(expected[i])[:n])
        else:
            rng = random.Random(seed + i)
            for off in range(0, n, PATTERN_CHUNK):
                want = rng.randbytes(min(PATTERN_CHUNK, slots * size - off))[:n - off]
                at = first_mismatch(got[off:off + len(want)], want)
                if at is not None:
                    bad = off + at
                    break
                yield
        if bad is not None:
            out.update(verified=False, first_mismatch={"qp": i, "offset": bad})
            return
    out.update(verified=True, first_mismatch=None)


def _verify_writes(mems: list[mmap.mmap], messages: list[int], slots: int, size: int,
                   seed: int, expected: list[bytearray] | None = None) -> dict:
    """`_verify_writes_steps` at once: {"verified", "first_mismatch"}."""
    out: dict = {}
    for _ in _verify_writes_steps(mems, messages, slots, size, seed, out, expected):
        pass
    return out


__all__ = ["CNP_DSCP", "DEFAULT_CONTROL_PORT", "TESTS", "Live", "TestError", "latency_stats",
           "pattern", "run_client", "slots_for"]
