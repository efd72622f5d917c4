"""`python -m agents.roce`: perftest-style RoCEv2 tests over the user-space RC transport.

Synopsis (rates and durations in FABRIC units; `--dilation D` converts them
through `agents.timebase.Dilation`)::

    python -m agents.roce server {write_bw,write_lat,send_bw} [--bind IP] [--port 18515]
        [--verify] [--peer-subnet CIDR] [common options]
    python -m agents.roce server --streams FILE [--bind IP] [--port 18515] [--dilation D]
        [--spin-ns NS] [--connect-timeout-s S] [--control-sock PATH] [--ready-file FILE]
        [--out FILE]
    python -m agents.roce client {write_bw,write_lat,send_bw} --server IP [--port 18515]
        [--bind IP] [--size BYTES] [--qps N] [--iters N | --duration-ns FABRIC_NS]
        [--tx-depth 128] [--buffer-bytes 67108864] [--seed 1] [--verify]
        [--start-at-mono-ns MONO_NS] [--stream NAME] [common options]
    common: [--mtu 4096] [--cc {dcqcn,dctcp,none}] [--cc-preset NAME] [--cc-params JSON]
        [--line-rate-bps FABRIC_BPS] [--dscp 26] [--cnp-dscp 48] [--cnp-interval-ns NS]
        [--window-packets 128] [--ack-every 16] [--ack-req-every 64] [--timeout-ns NS]
        [--retry-cnt 7] [--max-burst-bytes 16384] [--spin-ns 150000] [--dilation D]
        [--control-sock PATH]
        [--ready-file FILE] [--out FILE] [--wall] [--connect-timeout-s 10]

The server serves one test from one client and exits, as perftest does; the
client's size / iterations / QP count / MTU govern. With --streams it serves every
stream the file lists, in one process (`agents.roce.responder`: each stream with its
own QPs, verification and counters; each client names its stream with --stream), and
exits once all are done; its JSON holds each stream's counters under `streams`.
Output: a perftest-like table on stderr (fabric units; `--wall` adds wall units)
and ONE JSON line of counters on stdout at exit (also written to `--out`): per QP (keyed by QPN)
the requester's and responder's counters (packets and bytes sent and
received, retransmissions, NAKs sent / received, timeouts, out-of-order drops,
duplicates, CE-marked packets, CNPs sent / received, final rc_bps / rt_bps),
malformed datagrams per reason, and `verified` (true / false / null when not
asked) with the first mismatch.

SIGTERM / SIGINT stop either side cleanly (the client still tells the server,
which still verifies what was completed); both exit by themselves when their
parent process dies (agents.runtime.lifecycle). Exit codes: 0 done, 1 a QP error,
a failed verification or a socket error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from agents.rdma import options
from agents.rdma.transport import Stopped
from agents.roce.perftest import (
    DEFAULT_CONTROL_PORT,
    TESTS,
    Live,
    TestError,
    run_client,
)
from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import report_counters
from agents.runtime.start import add_start_arguments
from agents.wire.roce import ROCE_UDP_PORT

if TYPE_CHECKING:
    from agents.roce.responder import StreamSpec


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bind", metavar="IP", help="local address (default: the one the "
                        "route to the peer uses)")
    common.add_argument("--port", type=argtypes.port, default=DEFAULT_CONTROL_PORT,
                        help="TCP port of the set-up connection (default %(default)s; server: "
                             "0 picks a free one, named in the ready file)")
    options.add_arguments(common)
    common.add_argument("--buffer-bytes", type=argtypes.positive_int, default=64 << 20,
                        help="per QP: bytes of message slots (default %(default)s; at least "
                             "one message)")
    common.add_argument("--dilation", type=argtypes.positive_int, default=1,
                        help="time-dilation factor D: the fabric runs D times slower "
                             "(default 1)")
    common.add_argument("--control-sock", metavar="PATH",
                        help="serve a live counter snapshot (one JSON line) on this UNIX socket")
    common.add_argument("--ready-file", metavar="FILE",
                        help="create FILE when ready (server: listening, and FILE holds one JSON "
                             "line with its TCP and UDP ports; client: connected)")
    common.add_argument("--out", metavar="FILE", help="also write the final counters JSON here")
    common.add_argument("--wall", action="store_true",
                        help="also print wall-clock units in the table")
    common.add_argument("--connect-timeout-s", type=argtypes.positive_float, default=10.0,
                        help="wall seconds to wait for the set-up connection (default "
                             "%(default)s)")

    parser = argparse.ArgumentParser(
        prog="python -m agents.roce",
        description="perftest-style tests over the user-space RoCEv2 RC transport. Rates and "
                    "durations are in fabric units; --dilation converts them.")
    sub = parser.add_subparsers(dest="role", required=True)

    p = sub.add_parser("server", parents=[common],
                       help="serve one test (or, with --streams, every stream of a file) "
                            "and exit")
    p.add_argument("test", choices=TESTS, nargs="?",
                   help="the perftest-style test to serve (without --streams)")
    p.add_argument("--streams", metavar="FILE",
                   help="serve every stream FILE lists, in this one process: JSON "
                        '{"streams": [{"name": NAME, "argv": [TEST, server options...]}]} '
                        "(docs/roce.md, 'One responder per host'); a client names its "
                        "stream with --stream")
    p.add_argument("--verify", action="store_true",
                   help="check the received data against the client's pattern (the client "
                        "can ask for it too)")
    p.add_argument("--peer-subnet", type=argtypes.ip_network, action="append", default=None,
                   metavar="CIDR", help="accept set-up connections only from these subnets "
                   "(once per subnet; default: from anywhere); others are refused and "
                   "counted (setup_refused.peer)")
    # a second server in one namespace (tests): another UDP port, told to the client
    p.add_argument("--roce-port", type=argtypes.port, default=ROCE_UDP_PORT, help=argparse.SUPPRESS)

    p = sub.add_parser("client", parents=[common], help="run a test against a server")
    p.add_argument("test", choices=TESTS, help="the perftest-style test to run")
    p.add_argument("--stream", metavar="NAME",
                   help="the stream this client is, to a server of several (--streams)")
    p.add_argument("--server", required=True, metavar="IP")
    p.add_argument("--size", type=argtypes.nonneg_int, default=65536, metavar="BYTES",
                   help="message size (default %(default)s)")
    p.add_argument("--qps", type=argtypes.positive_int, default=1, help="QPs (default 1)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--iters", type=argtypes.positive_int, default=None,
                      help="messages per QP (default 1000 unless --duration-ns)")
    stop.add_argument("--duration-ns", type=argtypes.positive_int, metavar="FABRIC_NS",
                      help="post messages for this long, then drain")
    p.add_argument("--tx-depth", type=argtypes.positive_int, default=128,
                   help="messages outstanding per QP (default %(default)s)")
    p.add_argument("--seed", type=argtypes.nonneg_int, default=1, help="data pattern seed")
    p.add_argument("--verify", action="store_true",
                   help="ask the server to check the written data byte for byte")
    add_start_arguments(p)
    p.add_argument("--start-at-mono-ns", type=argtypes.nonneg_int, default=0, metavar="MONO_NS",
                   help="after set-up, wait until CLOCK_MONOTONIC reaches this (wall ns)")
    p.add_argument("--sport", type=argtypes.port, action="append", default=None,
                   metavar="PORT", help="the UDP source port of a QP, once per QP in order "
                   "(default: rxe's 0xC000 | hash(QPN)); `testbed run` gives the ports that "
                   "pin a QP to a path (docs/roce.md, 'Pinning a QP to a path')")
    p.add_argument("--qpn-base", type=int, default=None, help=argparse.SUPPRESS)
    # test-only loss injection at the client's sender (the kernel here has no netem)
    p.add_argument("--drop-every", type=argtypes.nonneg_int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--drop-prob", type=argtypes.probability, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--drop-seed", type=int, default=1, help=argparse.SUPPRESS)
    return parser


def _server_streams(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> list[StreamSpec] | None:
    """The --streams file's streams, checked (exit 2 naming the file and stream); None
    for a server of the command line's one test."""
    from agents.roce.responder import StreamsError, load_streams, stream_parser
    if args.streams and args.test:
        parser.error("with --streams, each stream names its test in the file; give no "
                     "test on the command line")
    if not args.streams:
        if not args.test:
            parser.error("server: name the test (write_bw, write_lat, send_bw), or give "
                         "--streams FILE")
        return None
    try:
        streams = load_streams(args.streams, stream_parser(parser), args)
    except StreamsError as e:
        parser.error(str(e))
    for spec in streams:
        try:
            options.check(spec.args)
        except options.OptionError as e:
            parser.error(f"{args.streams}: stream {spec.name}: {e}")
    return streams


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role == "client":
        if args.size >= 1 << 31:
            parser.error("--size must be below 2^31")
        if args.iters is None and args.duration_ns is None:
            args.iters = 1000
        if args.sport is not None and len(args.sport) != args.qps:
            parser.error(f"--sport is given {len(args.sport)} times for {args.qps} QP(s); give "
                         "it once per QP, or not at all")
        if args.sport is not None and len(set(args.sport)) != len(args.sport):
            parser.error("--sport: every QP needs its own source port")
    streams = _server_streams(parser, args) if args.role == "server" else None
    try:
        options.check(args)
    except options.OptionError as e:
        parser.error(str(e))

    life = Lifecycle()
    life.install_signal_handlers()
    live = Live(args.role, args.test)
    server = serve_snapshots(args.control_sock, live.snapshot)
    try:
        if args.role == "client":
            counters, rc = run_client(args, life, live)
        else:
            # the server's module only where it runs: a client never holds it
            from agents.roce.responder import run_server
            counters, rc = run_server(args, life, live, streams)
    except (TestError, OSError) as e:
        print(f"agents.roce {args.role}: {e}", file=sys.stderr)
        counters, rc = {"role": args.role, "test": args.test, "error": str(e),
                        "stopped_by": "error", **live.refusals()}, 1
    except Stopped:
        counters, rc = {"role": args.role, "test": args.test,
                        "stopped_by": life.stop_reason or "stopped", **live.refusals()}, 0
    finally:
        if server is not None:
            server.close()
    report_counters(counters, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
