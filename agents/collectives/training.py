"""`python -m agents.collectives.training`: one rank of a data-parallel training step.

Synopsis (every time is FABRIC time; `--dilation D` converts)::

    python -m agents.collectives.training --rank R --peers IP:TCPPORT:UDPPORT,...
        --buckets-bytes B0,B1,... [--algorithm ring|rhd|tree]
        [--dtype float32|float16|bfloat16|int32] [--forward-ns N] [--backward-ns N]
        [--overlap | --no-overlap] [--warmup N] [--iterations N] [--chunk-bytes N]
        [--qps N] [--seed N] [RoCE flags: --mtu --cc --cc-preset --cc-params
        --line-rate-bps --dscp --cnp-dscp --window-packets ... --spin-ns]
        [--dilation D] [--start-at-mono-ns T] [--control-sock PATH] [--ready-file PATH]
        [--out PATH] [--connect-timeout-s S]

Each iteration is one step of data-parallel training as PyTorch DDP runs it
(`agents.collectives.schedule` has the timeline): a barrier over the fabric so every rank
starts together, `--forward-ns` of forward compute, then `--backward-ns` of backward
compute split over the gradient buckets in proportion to their bytes, bucket 0 (the
last layers) ready first. Compute is a wait in fabric time that keeps serving the RoCE
engine (ACKs, retransmissions, peers' data landing early): a rank that only slept would
leave its peers' packets unacknowledged until their retry budget ran out. Each bucket is
all-reduced (`algorithms.run`, RDMA WRITEs with immediate on the same `RoceTransport`
as the collective benchmark) in order: with --overlap at max(its ready time, the end of
the bucket before), as DDP overlaps communication with the rest of backward; with
--no-overlap all of them after backward. The step ends at max(compute end, last all-reduce end).

Per timed iteration the rank reports, relative to its start: iteration_ns, compute_ns
(forward + backward), comm_ns (its all-reduce times summed), exposed_ns = iteration -
compute (the communication compute did not hide), each bucket's ready, start and
all-reduce time, and what congestion did meanwhile (from the transport's counters:
CNPs received, DCQCN / DCTCP rate cuts, retransmissions, RNR NAKs, timeouts, CE-marked
packets received, and the lowest sending rate any of its QPs had, sampled every
RATE_SAMPLE_FABRIC_NS of fabric time). The last iteration runs into receive buffers
pre-filled with a sentinel and is checked against the exact reference (`data.wrong`);
bucket k's inputs are `data.make_sendbuf` with seed --seed + k.

Output: one JSON line on stdout (and --out): `{"rank", "size", "algorithm", "dtype",
"overlap", "buckets_bytes", "forward_ns", "backward_ns", "warmup", "iterations": [{...}],
"wrong", "counters", "error", "stopped_by"}`; `wrong` is null unless the checked
iteration completed. --control-sock serves the live counters, the iteration and bucket.
SIGTERM / SIGINT stop cleanly with what the rank has. Exit codes: 0 done (right) or
stopped; 1 an error or a wrong result; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from argparse import Namespace
from collections.abc import Callable

from agents.collectives import algorithms, data, sweep
from agents.collectives.roce import (
    LINK_CHECK_S,
    MAX_QPS,
    RoceTransport,
    SetupError,
    Stopped,
    TransportError,
    parse_peers,
)
from agents.collectives.schedule import ready_times_ns
from agents.collectives.sync import barrier, finish, open_transport
from agents.rdma import options
from agents.runtime import argtypes
from agents.runtime.control import serve_snapshots
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import report_counters
from agents.runtime.start import add_start_arguments, await_start
from agents.timebase import Dilation

ALGORITHMS = ("ring", "rhd", "tree")
#: Fabric time between two looks at the QPs' sending rates: well below DCQCN's 55 us
#: recovery timers, so a cut is seen at its lowest before it recovers.
RATE_SAMPLE_FABRIC_NS = 2_000
#: ... but never more often than this (wall), so the sampler costs the engine nothing.
MIN_RATE_SAMPLE_WALL_S = 0.001
#: Longest single wait of the engine while computing (wall), so a stop is seen promptly.
MAX_WAIT_WALL_NS = 20_000_000
#: The transport counters (summed over QPs) a step reports the change of, by our name.
CONGESTION_COUNTERS = {"cnps": "cnps_received", "retransmissions": "retransmissions",
                       "rnr_naks": "rnr_naks_received", "timeouts": "timeouts",
                       "ecn_marked": "ce_packets_received"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agents.collectives.training",
        description="One rank of a data-parallel training step (compute, then gradient "
                    "buckets all-reduced in order, optionally overlapped with backward) "
                    "over the user-space RoCEv2 transport. Times are fabric time.")
    p.add_argument("--rank", type=argtypes.nonneg_int, required=True)
    p.add_argument("--peers", required=True, metavar="IP:TCPPORT:UDPPORT,...",
                   help="every rank's address, set-up port and RoCE port; entry i is rank i")
    p.add_argument("--buckets-bytes", required=True, metavar="B0,B1,...",
                   help="gradient bucket sizes in bytes, bucket 0 (the last layers) first")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    p.add_argument("--dtype", choices=sweep.DTYPES, default="float32")
    p.add_argument("--forward-ns", type=argtypes.nonneg_int, default=1_000_000,
                   help="forward compute per step, fabric ns (default %(default)s)")
    p.add_argument("--backward-ns", type=argtypes.nonneg_int, default=3_000_000,
                   help="backward compute per step, fabric ns (default %(default)s)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="all-reduce each bucket once it is ready, during the rest of "
                        "backward (DDP); --no-overlap: all buckets after backward")
    p.add_argument("--warmup", type=argtypes.nonneg_int, default=1,
                   help="untimed steps first (default %(default)s)")
    p.add_argument("--iterations", type=argtypes.positive_int, default=10,
                   help="timed steps (default %(default)s)")
    p.add_argument("--chunk-bytes", type=argtypes.positive_int, default=65536,
                   help="bytes per RDMA WRITE (one landing-ring slot), its 16-byte header "
                        "included (default %(default)s)")
    p.add_argument("--qps", type=int, choices=range(1, MAX_QPS + 1), default=1,
                   metavar=f"1..{MAX_QPS}", help="RC QPs per pair of ranks (default 1)")
    p.add_argument("--seed", type=argtypes.nonneg_int, default=1, help="test data seed")
    options.add_arguments(p)
    p.add_argument("--dilation", type=argtypes.positive_int, default=1,
                   help="time-dilation factor D: the fabric runs D times slower (default 1)")
    add_start_arguments(p)
    p.add_argument("--start-at-mono-ns", type=argtypes.nonneg_int, default=0, metavar="MONO_NS",
                   help="after set-up, wait until CLOCK_MONOTONIC reaches this (wall ns)")
    p.add_argument("--control-sock", metavar="PATH",
                   help="serve a live snapshot (one JSON line) on this UNIX socket")
    p.add_argument("--ready-file", metavar="PATH",
                   help="create PATH once the set-up port listens")
    p.add_argument("--out", metavar="PATH", help="also write the final JSON here")
    p.add_argument("--connect-timeout-s", type=argtypes.positive_float, default=30.0,
                   help="wall seconds for connecting to every rank (default %(default)s)")
    return p


def check_args(args: Namespace) -> str | None:
    """What is wrong with the arguments beyond their types, or None."""
    try:
        args.peer_list = parse_peers(args.peers)
        options.check(args)
    except ValueError as e:
        return str(e)
    try:
        args.bucket_list = [int(b) for b in args.buckets_bytes.split(",")]
    except ValueError:
        return f"--buckets-bytes {args.buckets_bytes!r} is not a list of byte counts"
    item = sweep.ITEMSIZE[args.dtype]
    bad = [b for b in args.bucket_list if b < item or b % item]
    if bad:
        return (f"--buckets-bytes: {bad[0]} is not a positive multiple of {args.dtype}'s "
                f"{item} bytes")
    n = len(args.peer_list)
    if n < 2:
        return "--peers names fewer than two ranks"
    if args.rank >= n:
        return f"--rank {args.rank} is not one of the {n} ranks of --peers"
    if args.chunk_bytes <= 16:
        return "--chunk-bytes must exceed the 16-byte chunk header"
    return None


# --------------------------------------------------------------------------- serving


def serve_until(t: RoceTransport, until_ns: float, should_stop: Callable[[], bool]) -> None:
    """Keep the RoCE engine running (receive, ACK, retransmit, re-post receive buffers)
    until fabric time `until_ns`: a compute phase, during which peers still send."""
    engine, clock, dilation = t.engine, t.clock, t.dilation
    next_check = 0.0
    t.reap()
    while True:
        now = clock.now_ns()
        if now >= until_ns:
            return
        if should_stop():
            raise Stopped()
        if time.monotonic() >= next_check:
            t.check_links()
            next_check = time.monotonic() + LINK_CHECK_S
        busy = engine.step()
        if t.reap() or busy:
            continue
        engine.wait(max(0, min(MAX_WAIT_WALL_NS, dilation.to_wall_ns(until_ns - now))))


class RateWatch:
    """The lowest sending rate of any of the transport's QPs since `reset`, sampled on a
    thread (the all-reduce drives the engine itself, with no hook of ours in its loop)."""

    def __init__(self, t: RoceTransport, dilation: Dilation) -> None:
        self.t = t
        self.interval_s = max(MIN_RATE_SAMPLE_WALL_S, dilation.to_wall_s(RATE_SAMPLE_FABRIC_NS))
        self.low_bps = math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rate-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def reset(self) -> None:
        self.low_bps = math.inf
        self.sample()

    def take(self) -> float | None:
        self.sample()
        return None if math.isinf(self.low_bps) else self.low_bps

    def sample(self) -> None:
        for b in list(self.t.engine.bindings):      # a list replaced whole on refresh
            rate = b.qp.requester.cc.rate_bps
            if rate < self.low_bps:
                self.low_bps = rate

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


def congestion(t: RoceTransport) -> dict[str, int]:
    """The transport's congestion counters now (CONGESTION_COUNTERS, and rate cuts: the
    rate controllers' decreases, summed over the QPs)."""
    totals = t.counters()
    out = {ours: int(totals.get(theirs, 0)) for ours, theirs in CONGESTION_COUNTERS.items()}
    out["rate_cuts"] = sum(int(b.qp.requester.cc.snapshot()["counters"].get(
        "rate_decreases", 0)) for b in t.engine.bindings)
    return out


# --------------------------------------------------------------------------- the steps


class Live:
    """What the rank has so far, for the control socket and the final JSON."""

    def __init__(self, args: Namespace) -> None:
        self.args = args
        self.transport: RoceTransport | None = None
        self.phase = "setup"
        self.iteration: int | None = None
        self.bucket: int | None = None
        self.iterations: list[dict] = []
        self.wrong: int | None = None

    def counters(self) -> dict:
        return self.transport.counters() if self.transport is not None else {}

    def snapshot(self) -> dict:
        try:
            counters = self.counters()
        except RuntimeError:        # a QP list changing under us: the next one is whole
            counters = {}
        flat = {k: v for k, v in counters.items() if isinstance(v, int | float)}
        return {**flat, "rank": self.args.rank, "op": "training", "phase": self.phase,
                "iteration": self.iteration, "bucket": self.bucket,
                "iterations_done": len(self.iterations), "counters": counters}

    def header(self) -> dict:
        a = self.args
        return {"rank": a.rank, "size": len(a.peer_list), "algorithm": a.algorithm,
                "dtype": a.dtype, "overlap": a.overlap, "buckets_bytes": a.bucket_list,
                "forward_ns": a.forward_ns, "backward_ns": a.backward_ns,
                "warmup": a.warmup}


class Steps:
    """Runs the steps of one rank, recording into `live`."""

    def __init__(self, args: Namespace, t: RoceTransport, life: Lifecycle, live: Live) -> None:
        self.args, self.t, self.life, self.live = args, t, life, live
        n, count = t.size, [b // sweep.ITEMSIZE[args.dtype] for b in args.bucket_list]
        self.counts = count
        self.send = [data.make_sendbuf("allreduce", t.rank, n, c, args.dtype, args.seed + k)
                     for k, c in enumerate(count)]
        self.recv = [data.make_recvbuf("allreduce", n, c, args.dtype) for c in count]
        self.sentinel = [r[:1].copy() for r in self.recv]
        self.ready_ns = ready_times_ns(args.bucket_list, args.forward_ns, args.backward_ns)
        self.watch = RateWatch(t, Dilation(args.dilation))

    def run(self) -> None:
        a = self.args
        total = a.warmup + a.iterations
        self.watch.start()
        try:
            for it in range(total):
                self.live.iteration = it
                if it == total - 1:       # the checked one: sentinel-filled outputs
                    for r, s in zip(self.recv, self.sentinel, strict=True):
                        r[...] = s[0]
                record = self.one_step(it)
                if it >= a.warmup:
                    self.live.iterations.append(record)
        finally:
            self.watch.stop()

    def one_step(self, it: int) -> dict:
        a, t = self.args, self.t
        barrier(t, (0, it))
        before = congestion(t)
        self.watch.reset()
        now = t.clock.now_ns
        t0 = now()
        compute_ns = a.forward_ns + a.backward_ns
        buckets = []
        for k, (send, recv) in enumerate(zip(self.send, self.recv, strict=True)):
            self.live.bucket = k
            serve_until(t, t0 + (self.ready_ns[k] if a.overlap else compute_ns),
                        self.life.should_stop)
            start = now()
            algorithms.run("allreduce", a.algorithm, t, send, recv, dtype=a.dtype)
            end = now()
            buckets.append({"ready_ns": round(self.ready_ns[k]), "start_ns": round(start - t0),
                            "allreduce_ns": round(end - start)})
        self.live.bucket = None
        # the step is over when both the compute and the last all-reduce are
        serve_until(t, t0 + compute_ns, self.life.should_stop)
        iteration_ns = now() - t0
        after = congestion(t)
        low = self.watch.take()
        comm_ns = sum(b["allreduce_ns"] for b in buckets)
        return {"iteration": it, "iteration_ns": round(iteration_ns), "compute_ns": compute_ns,
                "comm_ns": comm_ns, "exposed_ns": round(max(0.0, iteration_ns - compute_ns)),
                "buckets": buckets, **{k: after[k] - before[k] for k in after},
                "min_rate_bps": None if low is None else round(low)}

    def wrong(self) -> int:
        a, t = self.args, self.t
        bad = 0
        for k, (count, recv) in enumerate(zip(self.counts, self.recv, strict=True)):
            ref = data.reference("allreduce", "sum", t.size, count, a.dtype, rank=t.rank,
                                 seed=a.seed + k)
            bad += int(data.wrong(recv, ref, a.dtype, t.size, a.algorithm))
        return bad


def run(args: Namespace, life: Lifecycle, live: Live) -> None:
    t = open_transport(args, life)
    live.transport = t
    left = "error"
    try:
        steps = Steps(args, t, life, live)     # buffers before t0: not in any step's time
        await_start(args, life)
        if life.should_stop():
            raise Stopped()
        live.phase = "running"
        steps.run()
        finish(t)
        live.phase = left = "done"
    finally:
        t.leave(left if left == "done" else life.stop_reason or left)
        t.close()
    # checked after every rank has left together: the check's CPU time delays no peer
    live.wrong = steps.wrong()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    life = Lifecycle()
    life.install_signal_handlers()
    live = Live(args)
    server = serve_snapshots(args.control_sock, live.snapshot)
    error: str | None = None
    try:
        run(args, life, live)
    except Stopped:
        pass
    except (SetupError, TransportError, OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
        print(f"agents.collectives.training rank {args.rank}: {error}", file=sys.stderr)
    finally:
        if server is not None:
            server.close()
    out = {**live.header(), "iterations": live.iterations, "wrong": live.wrong,
           "counters": live.counters(), "error": error,
           "stopped_by": life.stop_reason or ("error" if error else "done")}
    report_counters(out, args.out)
    return 1 if error is not None or live.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
