"""The in-network aggregator: a UDP server in a switch's namespace standing in for the
switch's ALU (SwitchML / ATP style; the model is agents/aggregator/logic.py).

Synopsis::

    python -m agents.aggregator --bind IP --port P --jobs JSON [--dilation D]
        [--control-sock PATH] [--ready-file PATH] [--out PATH] [--parent IP:PORT]
        [--dscp 26] [--ecn ect0] [--rcvbuf-bytes 8388608]

`--jobs` is a JSON list (or `@FILE` holding one)::

    [{"id": 1, "members": [[worker_id, "ip", port], ...], "children": [[id, "ip", port]],
      "slots": 64, "slot_elements": 1024, "uplink_id": 0}]

`members` are workers (they send REQUESTs, from exactly that address), `children` leaf
aggregators (they send PARTIALs), both optional but not both empty; `uplink_id` is this
aggregator's id among its parent's children, needed for every job when `--parent` is
given. The aggregator runs until SIGTERM / SIGINT or its parent process dies
(agents.runtime.lifecycle); it keeps no timer of its own, so `--dilation` only turns
the chunks' open times into fabric ns in the counters.

Packets it sends carry DSCP `--dscp` (default 26, the lossless RoCE data class) and ECN
ECT(0), so they ride the lossless class and may be CE-marked rather than dropped. Sends
block with a bounded SO_SNDTIMEO (a paused port pushes back) and are retried.

Counters (live on --control-sock, final on stdout as one JSON line and in --out): those
of `Aggregator.counters()` (packets / bytes received and sent, aggregated, duplicates,
shadow_answers, results_sent, partials_forwarded, partials_resent, completed,
overflow_elements, slots_in_use(_max), drops by reason, malformed by reason, per job;
per configured address `peers` {"ip:port": {received, discarded, sent}} and
received_from_others), plus bind, port, dscp, dilation, send errors (eagain, enobufs,
icmp_errors) and stopped_by. The live snapshot adds, flat for the run's collector (`mode`
aggregator), `logic.sampled_counters`: drops_<reason>, malformed_<reason>, slots and per
job job<id>_slots_in_use and job<id>_slots. The ready file holds {"bind": IP, "port": P}
(the port actually bound).

Exit codes: 0 stopped cleanly, 1 a socket error (the JSON then has 'error'), 2 bad
arguments (including a bad --jobs).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

from agents.aggregator.logic import (
    Addr,
    Aggregator,
    JobConfig,
    jobs_from_json,
    sampled_counters,
)
from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import PARENT_CHECK_NS, Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.runtime.sockets import (
    ECN_CODEPOINTS,
    ICMP_SEND_ERRNOS,
    SendErrors,
    set_recv_buffer,
    set_recv_timeout,
    set_send_timeout,
    tos_byte,
)
from agents.timebase import Dilation, FabricClock
from agents.wire.ina import INA_UDP_PORT


def _addr(text: str) -> Addr:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected IP:PORT, got {text!r}")
    try:
        socket.inet_aton(host)
        return host, argtypes.port(port)
    except (OSError, ValueError):
        raise argparse.ArgumentTypeError(f"expected IP:PORT, got {text!r}") from None


def _jobs_text(text: str) -> list[JobConfig]:
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    try:
        return jobs_from_json(json.loads(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agents.aggregator",
        description="In-network aggregator: sums workers' int32 chunks per job and slot, "
                    "as a switch ALU would (docs/ina.md).")
    p.add_argument("--bind", required=True, metavar="IP", help="address to listen on")
    p.add_argument("--port", type=argtypes.port, default=INA_UDP_PORT,
                   help="UDP port (default %(default)s; 0: the kernel picks)")
    p.add_argument("--jobs", required=True, type=_jobs_text, metavar="JSON",
                   help='[{"id", "members": [[id, "ip", port], ...], "children": [...], '
                        '"slots", "slot_elements", "uplink_id"}], or @FILE')
    p.add_argument("--dilation", type=argtypes.positive_int, default=1,
                   help="time-dilation factor D (default 1)")
    p.add_argument("--parent", type=_addr, metavar="IP:PORT",
                   help="the parent aggregator: completed chunks go up as PARTIALs")
    p.add_argument("--dscp", type=argtypes.dscp, default=26,
                   help="DSCP of sent packets (default 26: the lossless RoCE class)")
    p.add_argument("--ecn", choices=sorted(ECN_CODEPOINTS), default="ect0",
                   help="ECN codepoint of sent packets (default ect0)")
    p.add_argument("--rcvbuf-bytes", type=argtypes.positive_int, default=8 << 20,
                   help="SO_RCVBUF: room for every worker's window at once")
    p.add_argument("--control-sock", metavar="PATH",
                   help="serve a live counter snapshot (one JSON line) on this UNIX socket")
    p.add_argument("--ready-file", metavar="PATH",
                   help="write {bind, port} here once the socket is bound")
    p.add_argument("--out", metavar="PATH", help="also write the final counters JSON here")
    return p


def _open(args: argparse.Namespace) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_byte(args.dscp, args.ecn))
        set_recv_buffer(sock, args.rcvbuf_bytes)
        set_recv_timeout(sock, PARENT_CHECK_NS)
        set_send_timeout(sock, PARENT_CHECK_NS)
        sock.bind((args.bind, args.port))
    except BaseException:
        sock.close()
        raise
    return sock


def _send(sock: socket.socket, data: bytes, addr: Addr, errs: SendErrors,
          life: Lifecycle) -> None:
    """Send until it is out (or a stop is requested): a full queue (a paused port)
    pushes back on the whole ALU, as a switch's pipeline would stall. EAGAIN, ENOBUFS
    and an earlier datagram's ICMP error are counted (SendErrors) and retried."""
    while True:
        try:
            sock.sendto(data, addr)
            return
        except OSError as e:
            errs.absorb(e)
        if life.should_stop():
            return


def serve(args: argparse.Namespace, life: Lifecycle) -> dict:
    dilation = Dilation(args.dilation)
    clock = FabricClock(dilation)
    agg = Aggregator(args.jobs, clock.now_ns, parent=args.parent)
    lock = threading.Lock()         # the snapshot thread reads what the loop writes
    errs = SendErrors()

    def snapshot() -> dict:
        with lock:
            counters = agg.counters()
        # mode: the collector stores these as aggregator.<key>
        return {**counters, **sampled_counters(counters), "mode": "aggregator",
                "eagain": errs.eagain, "enobufs": errs.enobufs}

    sock = _open(args)
    server = serve_snapshots(args.control_sock, snapshot)
    try:
        bind, port = sock.getsockname()
        mark_ready(args.ready_file, {"bind": bind, "port": port})
        buf = bytearray(65536)
        view = memoryview(buf)
        while not life.should_stop():
            try:
                n, src = sock.recvfrom_into(buf)
            except (BlockingIOError, TimeoutError, InterruptedError):
                continue
            except OSError as e:        # an ICMP error for an earlier send: count, go on
                if e.errno in ICMP_SEND_ERRNOS:
                    errs.icmp_errors += 1
                    continue
                raise
            with lock:
                out = agg.handle(view[:n], src)
            for data, to in out:
                _send(sock, data, to, errs, life)
        with lock:
            counters = agg.counters()
        return {**counters, "bind": bind, "port": port, "dscp": args.dscp, "ecn": args.ecn,
                "dilation": dilation.factor, "eagain": errs.eagain, "enobufs": errs.enobufs,
                "icmp_errors": errs.icmp_errors, "stopped_by": life.stop_reason or "done",
                "end_wall_ns": time.time_ns()}
    finally:
        if server is not None:
            server.close()
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.parent is not None:
        missing = [j.id for j in args.jobs if j.uplink_id is None]
        if missing:
            parser.error(f"--parent given: jobs {missing} need an uplink_id")
    life = Lifecycle()
    life.install_signal_handlers()
    try:
        counters, rc = serve(args, life), 0
    except OSError as e:
        print(f"agents.aggregator: {e}", file=sys.stderr)
        counters, rc = {"error": str(e), "stopped_by": "error"}, 1
    report_counters(counters, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
