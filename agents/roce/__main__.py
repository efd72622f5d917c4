"""`python -m agents.roce`: perftest-style RoCEv2 tests over the user-space RC transport.

Synopsis (rates and durations in FABRIC units; `--dilation D` converts them
through `agents.timebase.Dilation`)::

    python -m agents.roce server {write_bw,write_lat,send_bw} [--bind IP] [--port 18515]
        [--verify] [common options]
    python -m agents.roce client {write_bw,write_lat,send_bw} --server IP [--port 18515]
        [--bind IP] [--size BYTES] [--qps N] [--iters N | --duration-ns FABRIC_NS]
        [--tx-depth 128] [--buffer-bytes 67108864] [--seed 1] [--verify]
        [--start-at-mono-ns MONO_NS] [common options]
    common: [--mtu 4096] [--cc {dcqcn,dctcp,none}] [--cc-preset NAME] [--cc-params JSON]
        [--line-rate-bps FABRIC_BPS] [--dscp 26] [--cnp-dscp 48] [--cnp-interval-ns NS]
        [--window-packets 128] [--ack-every 16] [--ack-req-every 64] [--timeout-ns NS]
        [--retry-cnt 7] [--max-burst-bytes 16384] [--spin-ns 150000] [--dilation D]
        [--control-sock PATH]
        [--ready-file FILE] [--out FILE] [--wall] [--connect-timeout-s 10]

The server serves one test from one client and exits, as perftest does; the
client's size / iterations / QP count / MTU govern. Output: a perftest-like
table on stderr (fabric units; `--wall` adds wall units) and ONE JSON line of
counters on stdout at exit (also written to `--out`): per QP (keyed by QPN)
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

from agents.rdma.cc import (
    CC_KINDS,
    DCQCN_PRESET_NAMES,
    DCTCP_PRESET_NAMES,
    DEFAULT_DCQCN_PRESET,
    DEFAULT_DCTCP_PRESET,
)
from agents.rdma.qp import IB_MTUS, QpAttrs
from agents.rdma.transport import CNP_DSCP, DEFAULT_DSCP, NIC_SNDBUF_BYTES, SPIN_NS, Stopped
from agents.roce.perftest import (
    DEFAULT_CONTROL_PORT,
    TESTS,
    Live,
    TestError,
    cc_params,
    cc_settings,
    run_client,
    run_server,
)
from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import report_counters
from agents.wire.roce import ROCE_UDP_PORT

_DEFAULTS = QpAttrs()


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("test", choices=TESTS, help="the perftest-style test to run")
    common.add_argument("--bind", metavar="IP", help="local address (default: the one the "
                        "route to the peer uses)")
    common.add_argument("--port", type=argtypes.port, default=DEFAULT_CONTROL_PORT,
                        help="TCP port of the set-up connection (default %(default)s; server: "
                             "0 picks a free one, named in the ready file)")
    common.add_argument("--mtu", type=int, choices=IB_MTUS, default=_DEFAULTS.mtu,
                        help="path MTU: payload bytes per packet (default %(default)s)")
    common.add_argument("--cc", choices=CC_KINDS, default="dcqcn",
                        help="congestion control of the requester(s) and CNP policy of the "
                             "responder(s) (default %(default)s)")
    common.add_argument("--cc-preset", metavar="NAME",
                        help=f"DCQCN preset ({', '.join(DCQCN_PRESET_NAMES)}; default "
                             f"{DEFAULT_DCQCN_PRESET}) or DCTCP preset "
                             f"({', '.join(DCTCP_PRESET_NAMES)}; default {DEFAULT_DCTCP_PRESET})")
    common.add_argument("--cc-params", type=argtypes.json_object, default={}, metavar="JSON",
                        help="parameters in place of the preset's, by DcqcnParams / DctcpParams "
                             "field name (e.g. '{\"alpha_timer_ns\": 1000, \"g\": 0.0625}'): "
                             "absolute values for --line-rate-bps, applied after the preset is "
                             "scaled to it (docs/dcqcn.md)")
    common.add_argument("--line-rate-bps", type=argtypes.positive_float, default=100e9,
                        metavar="FABRIC_BPS",
                        help="NIC line rate in fabric bit/s: the pacing rate without CC and "
                             "the ceiling with it (default 100e9)")
    common.add_argument("--dscp", type=argtypes.dscp, default=DEFAULT_DSCP,
                        help="DSCP of data and ACK packets, sent ECT(0) (default %(default)s)")
    common.add_argument("--cnp-dscp", type=argtypes.dscp, default=CNP_DSCP,
                        help="DSCP of CNPs, sent Not-ECT (default %(default)s)")
    common.add_argument("--cnp-interval-ns", type=argtypes.nonneg_int, default=None,
                        metavar="FABRIC_NS",
                        help="responder: at most one CNP per QP per this interval (default: "
                             "the DCQCN preset's; DCTCP: every CE packet)")
    common.add_argument("--window-packets", type=argtypes.positive_int,
                        default=_DEFAULTS.window_packets,
                        help="most unacknowledged packets per QP, at most 2^22 (default "
                             "%(default)s, rxe's; `testbed run` sizes it to the fabric)")
    common.add_argument("--ack-every", type=argtypes.positive_int, default=_DEFAULTS.ack_every,
                        help="responder: one ACK per this many packets at most "
                             "(default %(default)s)")
    common.add_argument("--ack-req-every", type=argtypes.positive_int,
                        default=_DEFAULTS.ack_req_every,
                        help="requester: AckReq on PSNs that are multiples of this, and on "
                             "the last packet of each message (default %(default)s)")
    common.add_argument("--timeout-ns", type=argtypes.positive_float, default=_DEFAULTS.timeout_ns,
                        metavar="FABRIC_NS", help="local ACK timeout (default %(default)g)")
    common.add_argument("--retry-cnt", type=int, choices=range(8), default=_DEFAULTS.retry_cnt,
                        metavar="0..7", help="retries before the QP errors (default "
                                             "%(default)s)")
    common.add_argument("--max-burst-bytes", type=argtypes.nonneg_int,
                        default=_DEFAULTS.max_burst_bytes,
                        help="pacing: wire bytes a QP may send back to back to catch up "
                             "(default %(default)s)")
    common.add_argument("--sndbuf-bytes", type=argtypes.nonneg_int, default=NIC_SNDBUF_BYTES,
                        help="SO_SNDBUF of every RoCE socket (the kernel doubles it): how much "
                             "may wait in the host NIC's queue before a send blocks. Small, "
                             "like an RNIC's transmit FIFO: a PFC-paused NIC then holds the "
                             "QP's data back in memory, where a rate cut still applies, instead "
                             "of releasing a burst at line rate on resume; 0 keeps the kernel "
                             "default (default %(default)s: two 4 KB packets)")
    common.add_argument("--buffer-bytes", type=argtypes.positive_int, default=64 << 20,
                        help="per QP: bytes of message slots (default %(default)s; at least "
                             "one message)")
    common.add_argument("--spin-ns", type=argtypes.nonneg_int, default=SPIN_NS, metavar="WALL_NS",
                        help="busy-poll this close (wall ns) to the next send or timer instead "
                             "of sleeping; 0 never spins, which many agents on few cores want "
                             "(default %(default)s)")
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

    p = sub.add_parser("server", parents=[common], help="serve one test and exit")
    p.add_argument("--verify", action="store_true",
                   help="check the received data against the client's pattern (the client "
                        "can ask for it too)")
    # a second server in one namespace (tests): another UDP port, told to the client
    p.add_argument("--roce-port", type=argtypes.port, default=ROCE_UDP_PORT, help=argparse.SUPPRESS)

    p = sub.add_parser("client", parents=[common], help="run a test against a server")
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
    p.add_argument("--start-at-mono-ns", type=argtypes.nonneg_int, default=0, metavar="MONO_NS",
                   help="after set-up, wait until CLOCK_MONOTONIC reaches this (wall ns)")
    p.add_argument("--qpn-base", type=int, default=None, help=argparse.SUPPRESS)
    # test-only loss injection at the client's sender (the kernel here has no netem)
    p.add_argument("--drop-every", type=argtypes.nonneg_int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--drop-prob", type=argtypes.probability, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--drop-seed", type=int, default=1, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role == "client":
        if args.size >= 1 << 31:
            parser.error("--size must be below 2^31")
        if args.iters is None and args.duration_ns is None:
            args.iters = 1000
    try:
        QpAttrs(mtu=args.mtu, window_packets=args.window_packets,
                ack_req_every=args.ack_req_every, ack_every=args.ack_every,
                timeout_ns=args.timeout_ns, retry_cnt=args.retry_cnt,
                max_burst_bytes=args.max_burst_bytes)
    except ValueError as e:
        parser.error(str(e))
    try:
        cc_params(args, cc_settings(args))
    except TestError as e:
        parser.error(str(e))

    life = Lifecycle()
    life.install_signal_handlers()
    live = Live(args.role, args.test)
    server = serve_snapshots(args.control_sock, live.snapshot)
    try:
        if args.role == "client":
            counters, rc = run_client(args, life, live)
        else:
            counters, rc = run_server(args, life, live)
    except (TestError, OSError) as e:
        print(f"agents.roce {args.role}: {e}", file=sys.stderr)
        counters, rc = {"role": args.role, "test": args.test, "error": str(e),
                        "stopped_by": "error"}, 1
    except Stopped:
        counters, rc = {"role": args.role, "test": args.test,
                        "stopped_by": life.stop_reason or "stopped"}, 0
    finally:
        if server is not None:
            server.close()
    report_counters(counters, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
