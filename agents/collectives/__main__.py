"""`python -m agents.collectives`: one rank of a collective benchmark (nccl-tests-like) over
the user-space RoCEv2 transport or the Ultra Ethernet one (`--transport uet`).

Synopsis (all times the worker reports are FABRIC time; `--dilation D` converts)::

    python -m agents.collectives --rank R --peers IP:TCPPORT:UDPPORT,...
        [--op allreduce|reducescatter|allgather|broadcast|alltoall]
        [--algorithm ring|rhd|tree|pairwise] [--dtype float32|float16|bfloat16|int32]
        [--redop sum|max] [--root N] [--min-bytes N] [--max-bytes N] [--factor F]
        [--warmup N] [--iterations N] [--chunk-bytes N] [--qps N] [--pipeline-chunks N]
        [--seed N] [RoCE flags: --mtu --cc --cc-preset --cc-params --line-rate-bps
        --dscp --cnp-dscp --cnp-interval-ns --window-packets --ack-every --ack-req-every
        --timeout-ns --retry-cnt --max-burst-bytes --sndbuf-bytes --spin-ns]
        [--transport roce|uet] [UET flags: --uet-cc nscc|credit|none
        --uet-entropy spray|oblivious|reps --uet-entropies N --uet-trim-dscp N
        --uet-payload-bytes N --uet-base-rtt-ns N --uet-ecn|--no-uet-ecn]
        [--dilation D] [--start-at-mono-ns T] [--control-sock PATH] [--ready-file PATH]
        [--out PATH] [--events PATH] [--max-events N] [--connect-timeout-s S]

Entry i of --peers is rank i; this rank binds its own entry (TCP set-up port, UDP RoCE
port) and reaches the others at theirs (`agents.collectives.roce`). With `--transport
uet` the UDP port of every entry is the UET NIC's (4793, the same for all: one UET rank
per host, peers told apart by IP), the data moves as UET SENDs (`agents.collectives.uet`)
and --dscp / --line-rate-bps / --uet-* set the NIC up; the RoCE-only flags (--qps, --cc,
--mtu, ...) are then unused, and --algorithm ina is refused. The ready file
appears once the set-up port listens; then the rank connects (up to
--connect-timeout-s), waits for --start-at-mono-ns, and sweeps the sizes --min-bytes
.. --max-bytes by --factor (nccl-tests' -b -e -f; sizes and counts as
`agents.collectives.sweep` says). For each size: --warmup iterations, then
--iterations timed ones. Every iteration begins with a barrier over the fabric (a
dissemination barrier: ceil(log2 n) rounds; in round k a rank sends an (size index,
iteration) token to rank + 2^k and waits for the one from rank - 2^k, so no rank
starts before every rank has arrived, and ranks out of step are caught), then times,
on this rank, `algorithms.run(...)` plus `wait_sends()` in fabric microseconds; the
algorithm's `on_phase(name)` calls split that time into phases. The last iteration
runs on fresh inputs into a receive buffer pre-filled with a sentinel and is checked
with `data.count_wrong` against `data.reference`, block by block.

Output: one JSON line on stdout (and --out), `{"rank", "size", "op", "algorithm",
"dtype", "redop", "root", "transport", "results": [{"bytes", "count", "iterations_us",
"min_us", "avg_us", "p50_us", "p99_us", "wrong", "phases_us", "wire_bytes_per_iteration",
"retransmissions", "timeouts", "trims" (UET only)}],
"partial", "counters", "error",
"stopped_by", "events_written", "events_dropped"}`, where `counters` are the transport's
(`RoceTransport.counters`, or `UetTransport.counters`). `results` holds the sizes that
ran to their check (`wrong` is always a count); a size cut short by a stop or an error
is `partial` (the same fields, the iterations it timed, `wrong` null), else `partial`
is null.

--control-sock serves the live snapshot (`Live.snapshot`, mode `collective`): the
transport's flat totals (bytes_sent, bytes_received, retransmissions, ...), `ina_<key>`
for the in-network all-reduce's totals, `phase_<name>_ns` (fabric ns spent in each phase
so far, warm-ups included), the current size and iteration, and the events counts.
--events appends one `collective_phase` JSON line per phase of every iteration
(`sweep.PhaseLog`; written in batches off the data path by `agents.runtime.events`, at
most --max-events of them: the rest are counted in `events_dropped`). SIGTERM / SIGINT stop
cleanly with what the rank has; the rank exits when its parent dies. Exit codes: 0
done (every checked result right) or stopped; 1 an error or a wrong result; 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import importlib
import socket
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from types import ModuleType

import numpy as np

from agents.collectives import ina, sweep
from agents.collectives.roce import (
    MAX_QPS,
    RoceTransport,
    SetupError,
    Stopped,
    TransportError,
    parse_peers,
)
from agents.collectives.sync import barrier, finish, open_transport, open_uet_transport
from agents.collectives.transport import RankTransport
from agents.rdma import options
from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.events import MAX_EVENTS, EventLog
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import report_counters
from agents.runtime.start import add_start_arguments, await_start
from agents.timebase import Dilation
from agents.wire import BytesLike

ALGORITHMS_MODULE = "agents.collectives.algorithms"
DATA_MODULE = "agents.collectives.data"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agents.collectives",
        description="One rank of a collective benchmark (nccl-tests-like) over the "
                    "user-space RoCEv2 transport. Times are fabric time; --dilation "
                    "converts them.")
    p.add_argument("--rank", type=argtypes.nonneg_int, required=True)
    p.add_argument("--peers", required=True, metavar="IP:TCPPORT:UDPPORT,...",
                   help="every rank's address, set-up port and RoCE port; entry i is rank i")
    p.add_argument("--op", choices=sweep.OPS, default="allreduce")
    p.add_argument("--algorithm", choices=sweep.ALGORITHMS, default=None,
                   help="all-reduce: ring, rhd (recursive halving-doubling) or tree (double "
                        "binary tree); default ring, pairwise for alltoall")
    p.add_argument("--dtype", choices=sweep.DTYPES, default="float32")
    p.add_argument("--redop", choices=sweep.REDOPS, default="sum")
    p.add_argument("--root", type=argtypes.nonneg_int, default=0,
                   help="broadcast's root rank (default 0)")
    p.add_argument("--min-bytes", type=argtypes.nonneg_int, default=1024,
                   help="smallest size (nccl-tests -b; default %(default)s)")
    p.add_argument("--max-bytes", type=argtypes.nonneg_int, default=1 << 20,
                   help="largest size (nccl-tests -e; default %(default)s)")
    p.add_argument("--factor", type=argtypes.positive_float, default=2.0,
                   help="size multiplier from one size to the next (nccl-tests -f; "
                        "default %(default)s)")
    p.add_argument("--warmup", type=argtypes.nonneg_int, default=1,
                   help="untimed iterations per size (default %(default)s)")
    p.add_argument("--iterations", type=argtypes.positive_int, default=5,
                   help="timed iterations per size (default %(default)s)")
    p.add_argument("--chunk-bytes", type=argtypes.positive_int, default=65536,
                   help="bytes per RDMA WRITE (one landing-ring slot), its 16-byte header "
                        "included (default %(default)s); messages are split into chunks "
                        "spread over the QPs")
    p.add_argument("--qps", type=int, choices=range(1, MAX_QPS + 1), default=1,
                   metavar=f"1..{MAX_QPS}", help="RC QPs per pair of ranks (default 1)")
    p.add_argument("--pipeline-chunks", type=argtypes.positive_int, default=1,
                   help="the algorithm's `chunks` (pipelining of each step; default 1)")
    p.add_argument("--seed", type=argtypes.nonneg_int, default=1, help="test data seed")
    options.add_arguments(p)
    add_uet_arguments(p)
    p.add_argument("--dilation", type=argtypes.positive_int, default=1,
                   help="time-dilation factor D: the fabric runs D times slower (default 1)")
    add_start_arguments(p)
    p.add_argument("--start-at-mono-ns", type=argtypes.nonneg_int, default=0, metavar="MONO_NS",
                   help="after set-up, wait until CLOCK_MONOTONIC reaches this (wall ns)")
    p.add_argument("--control-sock", metavar="PATH",
                   help="serve a live snapshot (one JSON line) on this UNIX socket")
    p.add_argument("--ready-file", metavar="PATH",
                   help="create PATH once the set-up port listens (one JSON line: rank, "
                        "ports, pid)")
    p.add_argument("--out", metavar="PATH", help="also write the final JSON here")
    p.add_argument("--events", metavar="PATH",
                   help="append a collective_phase event (a JSON line) per phase here")
    p.add_argument("--max-events", type=argtypes.nonneg_int, default=MAX_EVENTS,
                   help="events written at most; later ones are only counted "
                        "(default %(default)s)")
    p.add_argument("--connect-timeout-s", type=argtypes.positive_float, default=30.0,
                   help="wall seconds for connecting to every rank (default %(default)s)")
    # tests: stand-ins for the algorithms / data modules
    ina_args = p.add_argument_group("in-network all-reduce (--algorithm ina)")
    ina_args.add_argument("--aggregator", metavar="IP:PORT",
                          help="this rank's (leaf switch's) aggregator")
    ina_args.add_argument("--job-id", type=argtypes.nonneg_int, default=1)
    ina_args.add_argument("--worker-id", type=argtypes.nonneg_int, default=None,
                          help="this rank's id in the aggregator's job (default: --rank)")
    ina_args.add_argument("--ina-slots", type=argtypes.positive_int, default=128)
    ina_args.add_argument("--ina-slot-elements", type=argtypes.positive_int, default=2048)
    ina_args.add_argument("--ina-port", type=argtypes.port, default=0,
                          help="UDP port of this rank's aggregation socket (the job's "
                               "member entry names it)")
    p.add_argument("--algorithms-module", default=ALGORITHMS_MODULE, help=argparse.SUPPRESS)
    p.add_argument("--data-module", default=DATA_MODULE, help=argparse.SUPPRESS)
    return p


UET_CC = ("nscc", "credit", "none")
UET_ENTROPY = ("spray", "oblivious", "reps")
MAX_UET_ENTROPIES = 4096


def add_uet_arguments(p: argparse.ArgumentParser) -> None:
    """--transport and the UET NIC's flags (agents.uet.nic.UetOptions)."""
    g = p.add_argument_group("transport")
    g.add_argument("--transport", choices=("roce", "uet"), default="roce",
                   help="roce: RDMA WRITEs with immediate over RC QPs (default); uet: SENDs "
                        "over the Ultra Ethernet transport's NIC (one per host, UDP 4793)")
    g.add_argument("--uet-cc", choices=UET_CC, default="nscc",
                   help="UET congestion control: nscc (sender-based, ECN + delay), credit "
                        "(receiver-paced credit) or none (default %(default)s)")
    g.add_argument("--uet-entropy", choices=UET_ENTROPY, default="spray",
                   help="UET per-packet entropy (UDP source port): spray (round robin over "
                        "--uet-entropies), oblivious (one per peer) or reps (default "
                        "%(default)s)")
    g.add_argument("--uet-entropies", type=argtypes.positive_int, default=16,
                   help="source ports a PDC sprays over (default %(default)s)")
    g.add_argument("--uet-trim-dscp", type=int, default=None, choices=range(64),
                   metavar="0..63", help="DSCP a switch gives a trimmed UET packet (default: "
                                         "trims are known by their short payload only)")
    g.add_argument("--uet-payload-bytes", type=argtypes.positive_int, default=4096,
                   help="UET payload per packet (default %(default)s)")
    g.add_argument("--uet-base-rtt-ns", type=argtypes.positive_int, default=10_000,
                   help="fabric round trip with empty queues, ns: NSCC's base (default "
                        "%(default)s)")
    g.add_argument("--uet-ecn", action=argparse.BooleanOptionalAction, default=True,
                   help="send UET packets ECN-capable (ECT(0)); default on")


def check_uet_args(args: Namespace) -> str | None:
    """--transport uet: one NIC port for every rank, a rank per IP, no in-network."""
    if args.transport != "uet":
        return None
    if args.algorithm == "ina":
        return "--algorithm ina runs over the RoCE transport only, not --transport uet"
    ports = {p.udp_port for p in args.peer_list}
    if len(ports) != 1:
        return (f"--transport uet: every rank's UDP port is the UET NIC's (4793), one for "
                f"all; --peers has {sorted(ports)}")
    ips = [p.ip for p in args.peer_list]
    if len(set(ips)) != len(ips):
        return "--transport uet: two ranks share an IP; one UET NIC (UDP 4793) per host"
    if args.uet_entropies > MAX_UET_ENTROPIES:
        return f"--uet-entropies {args.uet_entropies} is above {MAX_UET_ENTROPIES}"
    return None


def check_args(args: Namespace) -> str | None:
    """What is wrong with the arguments beyond their types, or None."""
    try:
        args.peer_list = parse_peers(args.peers)
        args.size_list = sweep.sizes(args.min_bytes, args.max_bytes, args.factor)
        options.check(args)
    except ValueError as e:
        return str(e)
    if args.algorithm is None:
        args.algorithm = sweep.DEFAULT_ALGORITHM[args.op]
    n = len(args.peer_list)
    if n < 2:
        return "--peers names fewer than two ranks"
    if args.rank >= n:
        return f"--rank {args.rank} is not one of the {n} ranks of --peers"
    if args.root >= n:
        return f"--root {args.root} is not one of the {n} ranks"
    if args.chunk_bytes <= 16:
        return "--chunk-bytes must exceed the 16-byte chunk header"
    uet_problem = check_uet_args(args)
    if uet_problem:
        return uet_problem
    if args.algorithm == "ina":
        return _check_ina(args)
    return None


def _check_ina(args: Namespace) -> str | None:
    if args.op != "allreduce":
        return "--algorithm ina is an all-reduce"
    if args.aggregator is None:
        return "--algorithm ina needs --aggregator IP:PORT"
    if args.dtype == "bfloat16" or args.redop != "sum":
        return "--algorithm ina sums float32, float16 or int32"
    host, _, port = args.aggregator.rpartition(":")
    if not host or not port.isdigit():
        return f"--aggregator {args.aggregator!r} is not IP:PORT"
    args.aggregator_addr = (host, int(port))
    if args.worker_id is None:
        args.worker_id = args.rank
    return None


def load(name: str, what: str) -> ModuleType:
    """Import the algorithms or data module by name, with a clear error if it is absent."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            raise SetupError(f"{name} is missing: the collective {what} are not on this "
                             "branch yet") from None
        raise


def module_op(module: ModuleType, op: str) -> str:
    """A module's name for `op`: the command line's (allreduce, ...) unless the module's
    table (ALGORITHMS, or OPS) names it the other way (all_reduce, ...)."""
    names = getattr(module, "ALGORITHMS", None) or getattr(module, "OPS", None) or ()
    alt = sweep.SNAKE_OP[op]
    return alt if op not in names and alt in names else op


def check_algorithm(algorithms: ModuleType, op: str, algorithm: str) -> None:
    """Refuse, before any set-up, an algorithm the module's table does not list for `op`
    (the in-network all-reduce is not the module's: it runs through the aggregators)."""
    if algorithm == "ina":
        return
    table = getattr(algorithms, "ALGORITHMS", None)
    if isinstance(table, dict):
        known = table.get(module_op(algorithms, op), ())
        if algorithm not in known:
            raise SetupError(f"no algorithm {algorithm!r} for {op}: {', '.join(known)}")


class Live:
    """What the rank has so far: the results, the current size and iteration."""

    def __init__(self, args: Namespace, events: EventLog | None = None) -> None:
        self.args = args
        self.transport: RankTransport | None = None
        self.phase = "setup"
        self.results: list[dict] = []       # checked sizes
        self.partial: dict | None = None     # the size under way (unchecked)
        self.current_bytes: int | None = None
        self.iteration: int | None = None
        self.ina: InaLink | None = None
        self.events = events
        self.phases: sweep.PhaseLog | None = None

    def counters(self) -> dict:
        out = self.transport.counters() if self.transport is not None else {}
        if self.ina is not None:
            out = {**out, "ina": dict(self.ina.totals),
                   "ina_max_error_bound": self.ina.max_error_bound}
        return out

    def wire_bytes_sent(self) -> int:
        """Bytes this rank's data packets cost on its host link so far (UDP payload plus
        agents.runtime.framing's per-packet overhead): RoCE data packets, and the
        in-network datagrams. The ACKs it sends are not counted (one per few packets)."""
        total = 0
        if self.transport is not None:
            total += int(self.transport.counters().get("wire_bytes_sent", 0))
        if self.ina is not None:
            totals = self.ina.totals
            total += (totals.get("bytes_sent", 0)
                      + totals.get("packets_sent", 0) * WIRE_OVERHEAD_BYTES)
        return total

    def recovery(self) -> dict[str, int]:
        """The transport's loss recovery so far: `retransmissions` (data packets sent
        again), `timeouts`, and over UET `trims` (trimmed packets that reached this rank)."""
        c = self.transport.counters() if self.transport is not None else {}
        out = {"retransmissions": int(c.get("retransmissions", 0)),
               "timeouts": int(c.get("timeouts", 0))}
        if c.get("transport") == "uet":
            out["trims"] = int(c.get("trims_received", 0))
        return out

    def snapshot(self) -> dict:
        """The live counters; the collector samples every top-level number of it as
        `collective.<key>` (docs/run-format.md)."""
        try:
            counters = self.counters()
        except RuntimeError:        # a QP list changing under us: the next one is whole
            counters = {}
        flat = {k: v for k, v in counters.items() if isinstance(v, int | float)}
        ina_totals = counters.get("ina") or {}
        flat.update({f"ina_{k}": v for k, v in ina_totals.items()
                     if isinstance(v, int | float)})
        if self.phases is not None:
            flat.update(self.phases.counters())
        if self.events is not None:
            flat.update(self.events.counters())
        return {**flat, "mode": "collective", "rank": self.args.rank, "op": self.args.op,
                "phase": self.phase, "current_bytes": self.current_bytes,
                "iteration": self.iteration, "sizes_done": len(self.results),
                "counters": counters}

    def header(self) -> dict:
        a = self.args
        return {"rank": a.rank, "size": len(a.peer_list), "op": a.op,
                "algorithm": a.algorithm, "dtype": a.dtype, "redop": a.redop, "root": a.root,
                "transport": getattr(a, "transport", "roce")}


# --------------------------------------------------------------------------- the sweep


class Sweep:
    """Runs the sizes of one rank, recording into `live`."""

    def __init__(self, args: Namespace, t: RankTransport, algorithms: ModuleType,
                 data: ModuleType, live: Live, link: InaLink | None = None,
                 should_stop: Callable[[], bool] = lambda: False) -> None:
        self.args = args
        self.should_stop = should_stop
        self.t = t
        self.algorithms = algorithms
        self.data = data
        self.live = live
        self.ina = link
        self.data_op = module_op(data, args.op)
        self.algo_op = module_op(algorithms, args.op)
        self.phases = sweep.PhaseLog(t.rank, t.clock, live.events)
        live.phases = self.phases

    def run(self) -> None:
        for i, nbytes in enumerate(self.args.size_list):
            self.one_size(i, nbytes)

    def one_size(self, index: int, nbytes: int) -> None:
        a, t, data = self.args, self.t, self.data
        count = sweep.param_count(a.op, nbytes, t.size, sweep.ITEMSIZE[a.dtype])
        send = data.make_sendbuf(self.data_op, t.rank, t.size, count, a.dtype, a.seed)
        pristine = send.copy()
        recv = data.make_recvbuf(self.data_op, t.size, count, a.dtype)
        sentinel = recv.copy()
        result = {"bytes": sweep.reported_bytes(send.size, recv.size, send.itemsize),
                  "count": count, "iterations_us": [], **sweep.summary([]), "wrong": None,
                  "phases_us": {}}
        phases: list[dict[str, float]] = []
        self.live.current_bytes = result["bytes"]
        self.live.partial = result
        total = a.warmup + a.iterations
        sent0 = 0
        lost0: dict[str, int] = {}
        for it in range(total):
            self.live.iteration = it
            if it == total - 1:            # the checked one: fresh inputs, sentinel output
                send[...] = pristine
                recv[...] = sentinel
            barrier(self.t, (index, it))
            if it == a.warmup:
                sent0 = self.live.wire_bytes_sent()
                lost0 = self.live.recovery()
            self.phases.iteration(result["bytes"], it, it < a.warmup)
            clock = sweep.PhaseClock(t.clock.now_ns, on_close=self.phases.close)
            t0 = t.clock.now_ns()
            if self.ina is not None:
                # The aggregation runs on its own socket, and nothing drives the RoCE
                # engine meanwhile: the barrier's last sends must be on the wire and
                # acknowledged first, or a peer still waiting for one never leaves it.
                t.wait_sends()
                clock.mark("in_network")
                self.ina.allreduce(send, recv)
            else:
                self.algorithms.run(self.algo_op, a.algorithm, t, send, recv, redop=a.redop,
                                    root=a.root, chunks=a.pipeline_chunks, dtype=a.dtype,
                                    on_phase=clock.mark)
            t.wait_sends()
            clock.end()
            elapsed = t.clock.now_ns() - t0
            if it >= a.warmup:
                result["iterations_us"].append(elapsed / 1e3)
                phases.append(clock.ns)
                result.update(sweep.summary(result["iterations_us"]))
                result["phases_us"] = sweep.mean_phases_us(phases)
        # what this rank put on its host link per timed run (the barriers' few bytes too)
        result["wire_bytes_per_iteration"] = round(
            (self.live.wire_bytes_sent() - sent0) / a.iterations)
        # what loss recovery cost over the timed runs (and their barriers)
        lost1 = self.live.recovery()
        result.update({k: v - lost0.get(k, 0) for k, v in lost1.items()})
        result["wrong"] = self.wrong(count, recv)
        self.live.results.append(result)
        self.live.partial = None

    def wrong(self, count: int, recv: np.ndarray) -> int:
        a, t, data = self.args, self.t, self.data
        tolerance = None
        if self.ina is not None and a.dtype != "int32":
            # fixed point: each element within the quantisation bound the agreed exponent
            # implies (agents/collectives/ina.py), plus the dtype's rounding of the result
            bound, unit = self.ina.max_error_bound, data.eps(a.dtype)
            tolerance = lambda ref: bound + unit * np.abs(ref.values)  # noqa: E731
        # Block by block, so a large result is checked in bounded memory; a stop request
        # is seen between blocks (the check of 256 MiB takes seconds of wall time).
        return int(data.count_wrong(recv, self.data_op, a.redop, t.size, count, a.dtype,
                                    a.algorithm, rank=t.rank, root=a.root, seed=a.seed,
                                    tolerance=tolerance, between=self.check_stop))

    def check_stop(self) -> None:
        if self.should_stop():
            raise Stopped()


# Longest wall time the aggregation socket waits before the RoCE engine is served again.
SERVICE_WALL_NS = 1_000_000


class ServicedPort(ina.UdpPort):
    """The aggregation socket, serving the RoCE engine between receives: a peer whose
    barrier message our ACK for was lost retransmits it, and would run out of retries if
    nothing answered while this rank aggregates in the switches."""

    def __init__(self, sock: socket.socket, life: Lifecycle, t: RoceTransport,
                 wall_ns: Callable[[], int] = time.monotonic_ns) -> None:
        super().__init__(sock, life)
        self.t = t
        self._wall_ns = wall_ns
        self._next_service_ns = 0
        self.services = 0

    def recv(self, timeout_wall_ns: int) -> tuple[BytesLike, ina.Addr] | None:
        # Step the engine (ACKs, timers) and reap: a message that lands is put in place
        # and its ring slot's receive posted again, or the peer's next WRITE meets RNR NAKs.
        # At most every SERVICE_WALL_NS: a step visits every QP, which per result
        # datagram (8 per 64 KiB) would cost the aggregation more than the RoCE side,
        # idle here but for a peer's retransmission, needs.
        now = self._wall_ns()
        if now >= self._next_service_ns:
            self._next_service_ns = now + SERVICE_WALL_NS
            self.services += 1
            while self.t.engine.step() or self.t.reap():
                pass
        return super().recv(min(timeout_wall_ns, SERVICE_WALL_NS))


class InaLink:
    """This rank's side of the in-network all-reduce: a UDP socket to its leaf switch's
    aggregator, the job, and what the calls so far cost."""

    def __init__(self, args: Namespace, bind_ip: str, life: Lifecycle,
                 t: RoceTransport) -> None:
        self.args = args
        self.life = life
        self.sock = ina.open_socket(bind_ip, args.ina_port, dscp=args.dscp)
        self.port = ServicedPort(self.sock, life, t)
        self.job = ina.InaJob(args.job_id, len(args.peer_list), args.ina_slots,
                              args.ina_slot_elements)
        self.chunk_base = 0
        self.max_error_bound = 0.0
        self.totals: dict[str, int] = {}

    def allreduce(self, send: np.ndarray, recv: np.ndarray) -> None:
        c = ina.allreduce_ina(self.port, self.args.aggregator_addr, self.job,
                              self.args.worker_id, send, recv,
                              dilation=Dilation(self.args.dilation),
                              chunk_base=self.chunk_base, life=self.life)
        self.chunk_base = c.next_chunk_base
        self.max_error_bound = max(self.max_error_bound, c.max_error_bound)
        for key, value in c.as_dict().items():
            if isinstance(value, int) and key != "next_chunk_base":
                self.totals[key] = self.totals.get(key, 0) + value

    def close(self) -> None:
        self.sock.close()


def run(args: Namespace, life: Lifecycle, live: Live) -> None:
    algorithms = load(args.algorithms_module, "algorithms")
    data = load(args.data_module, "data helpers")
    check_algorithm(algorithms, args.op, args.algorithm)
    t: RankTransport = (open_uet_transport(args, life) if args.transport == "uet"
                        else open_transport(args, life))
    live.transport = t
    left = "error"
    try:
        await_start(args, life)
        if life.should_stop():
            raise Stopped()
        live.phase = "running"
        me = args.peer_list[args.rank]
        link = None
        if args.algorithm == "ina":
            assert isinstance(t, RoceTransport)       # check_args refuses ina over UET
            link = InaLink(args, me.ip, life, t)
        live.ina = link
        try:
            Sweep(args, t, algorithms, data, live, link, life.should_stop).run()
        finally:
            if link is not None:
                link.close()
        finish(t)
        live.phase = left = "done"
    finally:
        # the peers learn why we go: anything but "done" fails their run at once
        t.leave(left if left == "done" else life.stop_reason or left)
        t.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    life = Lifecycle()
    life.install_signal_handlers()
    error: str | None = None
    try:
        events = EventLog(args.events, args.max_events,
                          who=f"agents.collectives rank {args.rank}").start()
    except OSError as e:
        parser.error(f"--events {args.events}: {e}")
    live = Live(args, events)
    server = serve_snapshots(args.control_sock, live.snapshot)
    try:
        run(args, life, live)
    except Stopped:
        pass
    except (SetupError, TransportError, OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
        print(f"agents.collectives rank {args.rank}: {error}", file=sys.stderr)
    finally:
        if server is not None:
            server.close()
        events.close()
    stopped_by = life.stop_reason or ("error" if error else "done")
    out = {**live.header(), "results": live.results, "partial": live.partial,
           "counters": live.counters(),
           "error": error, "stopped_by": stopped_by, **events.counters()}
    report_counters(out, args.out)
    bad = any(r["wrong"] for r in live.results)
    return 1 if error is not None or bad else 0


if __name__ == "__main__":
    sys.exit(main())
