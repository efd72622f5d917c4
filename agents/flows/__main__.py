"""`python -m agents.flows`: one host's sized flows over the user-space RoCEv2 transport,
or over the Ultra Ethernet transport with `--transport uet` (agents/flows/uet_host.py).

Synopsis (times and rates in FABRIC units; `--dilation D` converts them)::

    python -m agents.flows --schedule FILE --bind IP [--port 6400]
        [--start-at-mono-ns MONO_NS] [--ready-file FILE] [--out FILE]
        [--control-sock PATH] [--dilation D] [RDMA options: --mtu --cc --cc-preset
        --cc-params --line-rate-bps --dscp --cnp-dscp --cnp-interval-ns --window-packets
        --ack-every --ack-req-every --timeout-ns --retry-cnt --max-burst-bytes
        --sndbuf-bytes --spin-ns]
        [--transport uet --uet-cc nscc|credit|none --entropy spray|oblivious|reps
        --entropies N --payload-bytes B --base-rtt-ns NS --trim-dscp DSCP --seed N]

The schedule file is JSON: {"out": [[flow id, destination IP, destination UDP port,
size bytes, start fabric ns after t0, DSCP], ...], "in": [[flow id, source IP, size
bytes], ...]} (agents/flows/host.py). The agent binds its receive port, creates the
ready file, waits for the common start, then starts each outgoing flow at its time
(one RDMA WRITE with immediate on a QP and UDP source port of its own) and receives
the incoming ones. It exits when all its flows are done both ways, or on SIGTERM /
SIGINT (flows in progress are recorded unfinished). Output: ONE JSON line of counters
on stdout (also to --out): totals, and per flow in the order they finished `sent`
(flow_id, sport, posted_ns, done_ns, packets, retransmissions, timeouts,
cnps_received, error) and `received` (flow_id, first_ns, done_ns, packets,
ce_packets, cnps_sent, ooo_drops, duplicates), columns of equal length; `rx_endpoint`,
the receive socket's counters, and `tx_sockets`, the flows' own sockets' summed
(send_eagain: sends that waited out the send timeout on a full NIC queue). Exit codes:
0 done (or stopped), 1 a flow failed or a socket error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from agents.flows.host import FlowHost, parse_schedule
from agents.flows.uet_host import UetFlowHost
from agents.rdma import options
from agents.rdma.transport import Stopped
from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.runtime.start import add_start_arguments, await_start
from agents.timebase import Dilation
from agents.uet.nic import Stopped as UetStopped

DEFAULT_PORT = 6400


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.flows",
                                description="one host's sized flows over RoCEv2")
    p.add_argument("--schedule", required=True, metavar="FILE",
                   help="JSON: this host's outgoing and incoming flows")
    p.add_argument("--bind", required=True, metavar="IP", help="this host's address")
    p.add_argument("--port", type=argtypes.port, default=DEFAULT_PORT,
                   help="UDP port flows to this host arrive on (default %(default)s)")
    options.add_arguments(p)
    uet = p.add_argument_group("Ultra Ethernet (--transport uet; the RDMA options that "
                               "apply: --dscp, --line-rate-bps, --timeout-ns, "
                               "--window-packets, --spin-ns)")
    uet.add_argument("--transport", choices=("roce", "uet"), default="roce",
                     help="RoCEv2 RC QPs (default) or one UET NIC on UDP 4793")
    uet.add_argument("--uet-cc", choices=("nscc", "credit", "none"), default="nscc",
                     help="UET congestion control (default %(default)s)")
    uet.add_argument("--entropy", choices=("spray", "oblivious", "reps"), default="spray",
                     help="how UET picks each packet's UDP source port (default %(default)s)")
    uet.add_argument("--entropies", type=argtypes.positive_int, default=16,
                     help="UDP source ports a UET NIC sprays over (default %(default)s)")
    uet.add_argument("--payload-bytes", type=argtypes.positive_int, default=4096,
                     help="UET payload per packet (default %(default)s)")
    uet.add_argument("--base-rtt-ns", type=argtypes.positive_float, default=10_000.0,
                     help="UET CC's base round trip, fabric ns (default %(default)s)")
    uet.add_argument("--trim-dscp", type=argtypes.dscp, default=None,
                     help="DSCP the switches write into a trimmed packet")
    uet.add_argument("--seed", type=argtypes.nonneg_int, default=1,
                     help="seed of the UET NIC's entropy choices (default %(default)s)")
    p.add_argument("--dilation", type=argtypes.positive_int, default=1,
                   help="time-dilation factor D (default 1)")
    add_start_arguments(p)
    p.add_argument("--start-at-mono-ns", type=int, default=None, metavar="MONO_NS",
                   help="the common start t0, CLOCK_MONOTONIC ns")
    p.add_argument("--control-sock", metavar="PATH",
                   help="serve a live counter snapshot on this UNIX socket")
    p.add_argument("--ready-file", metavar="FILE", help="create FILE once the port is bound")
    p.add_argument("--out", metavar="FILE", help="also write the final counters JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options.check(args)
    except options.OptionError as e:
        parser.error(str(e))
    try:
        with open(args.schedule) as f:
            out, inc = parse_schedule(json.load(f))
    except (OSError, ValueError) as e:
        parser.error(f"--schedule {args.schedule}: {e}")
    life = Lifecycle()
    life.install_signal_handlers()
    dilation = Dilation(args.dilation)
    host: FlowHost | UetFlowHost | None = None
    server = None
    rc = 0
    try:
        host = (UetFlowHost if args.transport == "uet" else FlowHost)(args, out, inc, life)
        server = serve_snapshots(args.control_sock, host.snapshot)
        mark_ready(args.ready_file)
        await_start(args, life)
        host.start(args.start_at_mono_ns)
        host.run()
    except (Stopped, UetStopped):
        pass
    except OSError as e:
        print(f"agents.flows: {e}", file=sys.stderr)
        rc = 1
    finally:
        if server is not None:
            server.close()
    if host is None:
        report_counters({"role": "flows", "error": "could not bind its port",
                         "stopped_by": "error"}, args.out)
        return 1
    host.finish()
    if isinstance(host, FlowHost):
        roce = host
        counters = host.counters(dilation,
                                 lambda: options.cc_record(args, roce.cc, roce.params))
    else:
        counters = host.counters(dilation, lambda: {
            "cc": args.uet_cc, "cc_preset": None, "entropy": args.entropy,
            "entropies": args.entropies})
    counters["stopped_by"] = life.stop_reason or ("done" if host.done() else "stopped")
    if rc == 0 and host.totals.failed:
        rc = 1
    report_counters(counters, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
