"""The RoCE flags every agent that runs RC QPs takes, and what they turn into.

`add_arguments(parser)` adds the transport's options (MTU, congestion control and
its preset and overrides, line rate, DSCPs, window, ACK policy, timeouts, pacing,
socket buffer, spin), so the perftest tool (`agents.roce`) and the collective
workers (`agents.collectives`) take the same argv and a workload passes them the
same way. From the parsed arguments:

- `check(args)`: the QP attributes and the congestion-control parameters they
  name are valid (`OptionError` otherwise; the agents turn it into exit code 2);
- `cc_settings`, `cc_params`, `make_np`, `make_rate_controller`, `qp_attrs`: the
  kind and preset, the parameters every QP runs with, a responder's notification
  point, a requester's rate controller, the QP attributes;
- `cc_record`: what a result records of the congestion control that ran.

Rates and times are fabric units, as everywhere in the transport.
"""

from __future__ import annotations

import argparse
from argparse import Namespace

from agents.rdma.cc import (
    CC_KINDS,
    DCQCN_PRESET_NAMES,
    DCTCP_PRESET_NAMES,
    DCTCP_PRESETS,
    DEFAULT_DCQCN_PRESET,
    DEFAULT_DCTCP_PRESET,
    PRESETS,
    DcqcnNp,
    DcqcnParams,
    DctcpParams,
    RateController,
    effective_params,
    make_cc,
)
from agents.rdma.qp import IB_MTUS, QpAttrs
from agents.rdma.transport import CNP_DSCP, DEFAULT_DSCP, NIC_SNDBUF_BYTES, SPIN_NS
from agents.runtime import argtypes

__all__ = ["OptionError", "add_arguments", "cc_params", "cc_record", "cc_settings", "check",
           "make_np", "make_rate_controller", "qp_attrs"]

_DEFAULTS = QpAttrs()


class OptionError(ValueError):
    """RoCE options that do not make a valid QP or congestion-control set-up."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The transport's flags (defaults: docs/roce.md)."""
    parser.add_argument("--mtu", type=int, choices=IB_MTUS, default=_DEFAULTS.mtu,
                        help="path MTU: payload bytes per packet (default %(default)s)")
    parser.add_argument("--cc", choices=CC_KINDS, default="dcqcn",
                        help="congestion control of the requester(s) and CNP policy of the "
                             "responder(s) (default %(default)s)")
    parser.add_argument("--cc-preset", metavar="NAME",
                        help=f"DCQCN preset ({', '.join(DCQCN_PRESET_NAMES)}; default "
                             f"{DEFAULT_DCQCN_PRESET}) or DCTCP preset "
                             f"({', '.join(DCTCP_PRESET_NAMES)}; default {DEFAULT_DCTCP_PRESET})")
    parser.add_argument("--cc-params", type=argtypes.json_object, default={}, metavar="JSON",
                        help="parameters in place of the preset's, by DcqcnParams / DctcpParams "
                             "field name (e.g. '{\"alpha_timer_ns\": 1000, \"g\": 0.0625}'): "
                             "absolute values for --line-rate-bps, applied after the preset is "
                             "scaled to it (docs/dcqcn.md)")
    parser.add_argument("--line-rate-bps", type=argtypes.positive_float, default=100e9,
                        metavar="FABRIC_BPS",
                        help="NIC line rate in fabric bit/s: the pacing rate without CC and "
                             "the ceiling with it (default 100e9)")
    parser.add_argument("--dscp", type=argtypes.dscp, default=DEFAULT_DSCP,
                        help="DSCP of data and ACK packets, sent ECT(0) (default %(default)s)")
    parser.add_argument("--cnp-dscp", type=argtypes.dscp, default=CNP_DSCP,
                        help="DSCP of CNPs, sent Not-ECT (default %(default)s)")
    parser.add_argument("--cnp-interval-ns", type=argtypes.nonneg_int, default=None,
                        metavar="FABRIC_NS",
                        help="responder: at most one CNP per QP per this interval (default: "
                             "the DCQCN preset's; DCTCP: every CE packet)")
    parser.add_argument("--window-packets", type=argtypes.positive_int,
                        default=_DEFAULTS.window_packets,
                        help="most unacknowledged packets per QP, at most 2^22 (default "
                             "%(default)s, rxe's; `testbed run` sizes it to the fabric)")
    parser.add_argument("--ack-every", type=argtypes.positive_int, default=_DEFAULTS.ack_every,
                        help="responder: one ACK per this many packets at most "
                             "(default %(default)s)")
    parser.add_argument("--ack-req-every", type=argtypes.positive_int,
                        default=_DEFAULTS.ack_req_every,
                        help="requester: AckReq on PSNs that are multiples of this, and on "
                             "the last packet of each message (default %(default)s)")
    parser.add_argument("--timeout-ns", type=argtypes.positive_float, default=_DEFAULTS.timeout_ns,
                        metavar="FABRIC_NS", help="local ACK timeout (default %(default)g)")
    parser.add_argument("--retry-cnt", type=int, choices=range(8), default=_DEFAULTS.retry_cnt,
                        metavar="0..7", help="retries before the QP errors (default "
                                             "%(default)s)")
    parser.add_argument("--max-burst-bytes", type=argtypes.nonneg_int,
                        default=_DEFAULTS.max_burst_bytes,
                        help="pacing: wire bytes a QP may send back to back to catch up "
                             "(default %(default)s)")
    parser.add_argument("--sndbuf-bytes", type=argtypes.nonneg_int, default=NIC_SNDBUF_BYTES,
                        help="SO_SNDBUF of every RoCE socket (the kernel doubles it): how much "
                             "may wait in the host NIC's queue before a send blocks. Small, "
                             "like an RNIC's transmit FIFO: a PFC-paused NIC then holds the "
                             "QP's data back in memory, where a rate cut still applies, instead "
                             "of releasing a burst at line rate on resume; 0 keeps the kernel "
                             "default (default %(default)s: two 4 KB packets)")
    parser.add_argument("--spin-ns", type=argtypes.nonneg_int, default=SPIN_NS, metavar="WALL_NS",
                        help="busy-poll this close (wall ns) to the next send or timer instead "
                             "of sleeping; 0 never spins, which many agents on few cores want "
                             "(default %(default)s)")


def qp_attrs(args: Namespace, mtu: int) -> QpAttrs:
    """The QP attributes the flags ask for, at path MTU `mtu` (ValueError if invalid)."""
    return QpAttrs(mtu=mtu, window_packets=args.window_packets, ack_req_every=args.ack_req_every,
                   ack_every=args.ack_every, timeout_ns=args.timeout_ns,
                   retry_cnt=args.retry_cnt, max_burst_bytes=args.max_burst_bytes)


def cc_settings(args: Namespace) -> tuple[str, str | None]:
    """(kind, preset) from --cc / --cc-preset, with each kind's default preset."""
    kind = args.cc
    name = args.cc_preset
    if kind == "dcqcn":
        name = name or DEFAULT_DCQCN_PRESET
        if name not in PRESETS:
            raise OptionError(f"--cc-preset {name!r} is not a DCQCN preset; "
                              f"known: {', '.join(sorted(PRESETS))}")
    elif kind == "dctcp":
        name = name or DEFAULT_DCTCP_PRESET
        if name not in DCTCP_PRESETS:
            raise OptionError(f"--cc-preset {name!r} is not a DCTCP preset; "
                              f"known: {', '.join(sorted(DCTCP_PRESETS))}")
    else:
        name = None
    return kind, name


def cc_params(args: Namespace, cc: tuple[str, str | None]) -> DcqcnParams | DctcpParams | None:
    """The parameters every QP runs with: the preset scaled to --line-rate-bps, then
    --cc-params (absolute values); None without congestion control."""
    try:
        return effective_params(cc[0], cc[1], args.line_rate_bps, args.cc_params)
    except ValueError as e:
        raise OptionError(f"--cc-params: {e}") from None


def check(args: Namespace) -> None:
    """Raise OptionError if the QP attributes or the congestion control are invalid."""
    try:
        qp_attrs(args, args.mtu)
    except ValueError as e:
        raise OptionError(str(e)) from None
    cc_params(args, cc_settings(args))


def make_rate_controller(args: Namespace, cc: tuple[str, str | None],
                         now_ns: float) -> RateController:
    """A requester's rate controller, started at fabric time `now_ns` (one per QP)."""
    return make_cc(cc[0], cc[1], args.line_rate_bps, now_ns, args.cc_params)


def make_np(args: Namespace, kind: str, params: DcqcnParams | DctcpParams | None) -> DcqcnNp | None:
    """The notification point of a responder: the DCQCN parameters' interval and mode
    (--cnp-interval-ns replaces the interval); DCTCP gets a CNP for every CE packet (or
    one per --cnp-interval-ns); no CC sends no CNPs unless --cnp-interval-ns asks."""
    if isinstance(params, DcqcnParams):         # kind "dcqcn"
        interval = (args.cnp_interval_ns if args.cnp_interval_ns is not None
                    else params.cnp_interval_ns)
        return DcqcnNp(interval, params.np_mode)
    if args.cnp_interval_ns is not None:
        return DcqcnNp(args.cnp_interval_ns)
    if kind == "dctcp":
        return DcqcnNp(0)
    return None


def cc_record(args: Namespace, cc: tuple[str, str | None],
              params: DcqcnParams | DctcpParams | None) -> dict:
    """What a run directory needs to show which congestion control ran."""
    return {"cc": cc[0], "cc_preset": cc[1], "cc_overrides": dict(args.cc_params),
            "cc_params": params.to_dict() if params is not None else None}
