"""A test-only worker for the in-network all-reduce: `python -m tests.integration.ina_worker`
inside a host's namespace. It makes its own data (standard normal, seeded by its worker
id, so the test can remake everyone's), runs agents.collectives.ina.allreduce_ina
against the aggregator, saves the result (.npy) and prints its counters as one JSON line.
(The collective worker proper, `python -m agents.collectives --algorithm ina`, calls the
same function.)"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from agents.collectives.ina import InaError, InaJob, allreduce_ina, open_socket
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.waiting import wait_until_mono
from agents.timebase import Dilation


def worker_data(worker_id: int, elements: int, dtype: str) -> np.ndarray:
    return np.random.default_rng(1000 + worker_id).standard_normal(elements).astype(dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.integration.ina_worker")
    p.add_argument("--bind", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--aggregator", required=True, metavar="IP:PORT")
    p.add_argument("--job-id", type=int, required=True)
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--slot-elements", type=int, required=True)
    p.add_argument("--elements", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dilation", type=int, default=1)
    p.add_argument("--timeout-ns", type=int, default=1_000_000)
    p.add_argument("--start-at-mono-ns", type=int, default=0)
    p.add_argument("--out-npy", required=True)
    args = p.parse_args(argv)
    host, port = args.aggregator.rsplit(":", 1)
    life = Lifecycle()
    life.install_signal_handlers()
    x = worker_data(args.worker_id, args.elements, args.dtype)
    out = np.zeros_like(x)
    sock = open_socket(args.bind, args.port)
    try:
        wait_until_mono(args.start_at_mono_ns, life)
        t0 = time.monotonic_ns()
        c = allreduce_ina(sock, (host, int(port)),
                          InaJob(args.job_id, args.workers, args.slots, args.slot_elements),
                          args.worker_id, x, out, dilation=Dilation(args.dilation),
                          timeout_ns=args.timeout_ns, life=life)
        wall = time.monotonic_ns() - t0
    except InaError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    finally:
        sock.close()
    np.save(args.out_npy, out)
    print(json.dumps({**c.as_dict(), "elapsed_wall_ns": wall}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
