"""`python -m agents.uet`: one host's UET streams over one user-space UET NIC (UDP 4793).

Synopsis (times and rates in FABRIC units; `--dilation D` converts them)::

    python -m agents.uet --schedule FILE --bind IP [--dscp 0] [--cc nscc|credit|none]
        [--entropy spray|oblivious|reps] [--entropies 16] [--entropy-base 53248]
        [--sport PORT ...] [--window-packets N] [--payload-bytes 4096] [--line-rate-bps BPS]
        [--base-rtt-ns NS] [--rto-ns NS] [--ack-every N] [--trim-dscp DSCP] [--no-ecn]
        [--sndbuf-bytes N] [--seed 1] [--dilation D] [--start-at-mono-ns MONO_NS]
        [--ready-file FILE] [--out FILE] [--control-sock PATH]

The schedule is JSON (testbed/workloads/uet.py writes it; agents/uet/host.py reads it):
{"out": [stream, ...], "in": [stream, ...]}, each stream {"stream", "peer" (IP),
"peer_host", "test" (write_bw | send_bw), "size", "messages" (or null), "slots",
"seed", "verify", and for "out" also "start_ns", "duration_ns" (or null), "depth"}.
The agent binds UDP 4793, registers a region per targeted WRITE stream, creates the
ready file, waits for the common start, then posts each initiated stream's messages
from its start and checks every byte of each targeted stream. It exits once its
initiated streams are acknowledged and its targeted streams complete (and
LINGER_RTOS retransmission timeouts more, to answer a retransmission of a lost last
ACK); a host that only receives runs until SIGTERM / SIGINT. Output: ONE JSON line on
stdout (also to --out): `streams_out` and `streams_in` (one record per stream),
`verified`, `nic` (the NIC's counters), `udp_rcvbuf_errors` (the namespace's UDP
datagrams dropped by full receive buffers while it ran), `stopped_by`, `error`; a table
per stream
on stderr. Exit codes: 0 done (or stopped), 1 a byte mismatch, a socket or NIC error,
2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.runtime.start import add_start_arguments, await_start
from agents.timebase import Dilation, FabricClock
from agents.uet.host import UetHost, parse_schedule, udp_rcvbuf_errors
from agents.uet.nic import Stopped, UetNic, UetOptions

# argparse dest -> UetOptions field, for the options given on the command line (the
# NIC's own defaults hold for the rest).
OPTION_FIELDS = {"dscp": "dscp", "cc": "cc", "entropy": "entropy",
                 "entropies": "entropies", "entropy_base": "entropy_base",
                 "payload_bytes": "payload_bytes", "window_packets": "window_packets",
                 "rto_ns": "rto_ns", "line_rate_bps": "line_rate_bps",
                 "base_rtt_ns": "base_rtt_ns", "trim_dscp": "trim_dscp",
                 "ack_every": "ack_every", "drop_prob": "drop_prob", "seed": "seed",
                 "sndbuf_bytes": "sndbuf_bytes"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.uet",
                                description="one host's streams over the UET transport")
    p.add_argument("--schedule", required=True, metavar="FILE",
                   help="JSON: the streams this host initiates and targets")
    p.add_argument("--bind", required=True, metavar="IP", help="this host's address")
    p.add_argument("--dscp", type=argtypes.dscp, default=0, help="DSCP of data and ACKs")
    p.add_argument("--no-ecn", dest="ecn", action="store_false",
                   help="send Not-ECT (default: ECT(0), so switches can mark CE)")
    p.add_argument("--cc", choices=("nscc", "credit", "none"), default="nscc")
    p.add_argument("--entropy", choices=("spray", "oblivious", "reps"), default="spray")
    p.add_argument("--entropies", type=argtypes.positive_int, default=16,
                   help="UDP source ports a stream sprays over (default %(default)s)")
    p.add_argument("--entropy-base", type=argtypes.port, default=None,
                   help="the first of them (default: the NIC's, 0xD000)")
    p.add_argument("--sport", type=argtypes.port, action="append", default=None,
                   metavar="PORT", help="a source port to spray over, once per port, in "
                   "place of --entropy-base's consecutive ones (testbed run gives them, "
                   "balanced over the paths)")
    p.add_argument("--window-packets", type=argtypes.positive_int, default=None)
    p.add_argument("--payload-bytes", type=argtypes.positive_int, default=None,
                   help="payload bytes per packet (default: the NIC's, 4096)")
    p.add_argument("--line-rate-bps", type=argtypes.positive_float, default=None,
                   help="the NIC's rate, fabric bit/s")
    p.add_argument("--base-rtt-ns", type=argtypes.positive_float, default=None)
    p.add_argument("--rto-ns", type=argtypes.positive_float, default=None,
                   help="retransmission timeout, fabric ns")
    p.add_argument("--ack-every", type=argtypes.positive_int, default=None)
    p.add_argument("--trim-dscp", type=argtypes.dscp, default=None,
                   help="DSCP a switch writes into a packet it trimmed")
    p.add_argument("--sndbuf-bytes", type=argtypes.nonneg_int, default=None)
    p.add_argument("--seed", type=argtypes.nonneg_int, default=None,
                   help="seed of the NIC's random choices (entropy, injected loss)")
    p.add_argument("--drop-prob", type=argtypes.probability, default=None,
                   help=argparse.SUPPRESS)     # tests: lose sent packets, counted
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


def nic_options(args: argparse.Namespace) -> dict[str, Any]:
    """The UetOptions fields the command line set."""
    opts: dict[str, Any] = {"ecn": args.ecn}
    for dest, name in OPTION_FIELDS.items():
        value = getattr(args, dest)
        if value is not None:
            opts[name] = value
    if args.sport:
        opts["sports"] = tuple(args.sport)
        opts["entropies"] = len(args.sport)
    return opts


def make_nic(args: argparse.Namespace, clock: FabricClock, dilation: Dilation,
             life: Lifecycle) -> UetNic:
    """The host's UetNic; with --sport, one whose send sockets are exactly those ports."""

    opts = nic_options(args)
    sports = opts.pop("sports", None)
    known = {f.name for f in dataclasses.fields(UetOptions)}
    if sports is not None and "sports" in known:
        opts["sports"] = sports
        sports = None
    options = UetOptions(**opts)
    if sports is None:
        return UetNic(args.bind, clock, dilation, options, should_stop=life.should_stop)

    class GivenPortsNic(UetNic):
        """A UetNic that binds its send sockets on the given ports, each exactly: the
        NIC itself binds consecutive ports from entropy_base, so each given port is bound
        as a range of one (a taken port is an error, not moved: another port would take
        another path)."""

        def _tx_sockets(self) -> None:
            final = self.opts
            try:
                for port in sports:
                    self.opts = dataclasses.replace(final, entropy_base=port,
                                                    entropies=len(self.socks) + 1)
                    super()._tx_sockets()
                    if self.sports[-1] != port:
                        raise OSError(f"source port {port} is taken on this host")
            finally:
                self.opts = final

    return GivenPortsNic(args.bind, clock, dilation, options, should_stop=life.should_stop)


def _totals(nic: Any) -> dict:
    try:
        return dict((nic.counters() or {}).get("totals") or {})
    except RuntimeError:          # a dict the engine was changing; the next read is fine
        return {}


def table(outs: list[dict]) -> str:
    """The per-stream table on stderr, fabric units."""
    lines = [" stream  dst        bytes          msgs   time_us      Gb/s   retrans  "
             "nacks  timeouts  sports"]
    for r in outs:
        t = ((r["last_done_ns"] or 0) - (r["first_post_ns"] or 0))
        gbps = r["bytes"] * 8 / t if t > 0 else 0.0
        lines.append(f" {r['stream']:<7} {r['dst']:<10} {r['bytes']:<14} {r['messages']:<6} "
                     f"{t / 1e3:<10.1f} {gbps:<7.2f} {r['retransmissions']:<8} "
                     f"{r['nacks']:<6} {r['timeouts']:<9} {len(r['sports'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with open(args.schedule) as f:
            out, inc = parse_schedule(json.load(f))
    except (OSError, ValueError) as e:
        parser.error(f"--schedule {args.schedule}: {e}")
    life = Lifecycle()
    life.install_signal_handlers()
    dilation = Dilation(args.dilation)
    clock = FabricClock(dilation)
    nic = None
    host: UetHost | None = None
    server = None
    rc = 0
    error: str | None = None
    rcvbuf_errors_at_start = udp_rcvbuf_errors()
    try:
        nic = make_nic(args, clock, dilation, life)
        rto_ns = float(nic.opts.rto_ns)
        host = UetHost(nic, out, inc, clock, dilation, life, rto_ns=rto_ns)
        server = serve_snapshots(args.control_sock,
                                 lambda: host.snapshot(lambda: _totals(nic)) if host else {})
        mark_ready(args.ready_file)
        await_start(args, life)
        host.start(args.start_at_mono_ns)
        host.run()
    except Stopped:
        pass
    except (OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
        print(f"agents.uet: {error}", file=sys.stderr)
        rc = 1
    finally:
        if server is not None:
            server.close()
    counters: dict[str, Any] = {"role": "uet", "local_ip": args.bind,
                                "dilation": dilation.factor, "options": nic_options(args),
                                "error": error}
    if host is not None and nic is not None:
        nic_counters = nic.counters()
        outs, ins = host.records(nic_counters.get("pdcs") or {})
        counters.update(streams_out=outs, streams_in=ins, verified=host.verified(),
                        unexpected_messages=host.unexpected, nic=nic_counters)
        if host.verified() is False:
            rc = 1
        if outs:
            print(table(outs), file=sys.stderr)
    at_end = udp_rcvbuf_errors()
    counters["udp_rcvbuf_errors"] = (None if at_end is None or rcvbuf_errors_at_start is None
                                     else at_end - rcvbuf_errors_at_start)
    counters["stopped_by"] = life.stop_reason or (
        "done" if host is not None and host.streams_done() else "error" if rc else "stopped")
    if nic is not None:
        nic.close()
    report_counters(counters, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
