"""A test-only sender of forged in-network aggregation packets:
`python -m tests.integration.ina_inject` inside a host's namespace that is NOT a member of
the job. It waits for a file (the aggregator's ready file), then sends well-formed
REQUESTs for a live job (its id, a member's worker id, the right slot and generation for
each chunk, a full slot of large values that would wreck the sum if they were added) and
REQUESTs for a job id nobody configured, spread over `--spread-s`, and prints what it
sent as one JSON line."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np

from agents.wire.ina import Header, PacketType, build, gen_of, slot_of


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.integration.ina_inject")
    p.add_argument("--wait-file", type=Path, required=True)
    p.add_argument("--to", required=True, metavar="IP:PORT")
    p.add_argument("--job", type=int, required=True, help="the live job's id")
    p.add_argument("--unknown-job", type=int, required=True, help="an id no job has")
    p.add_argument("--sender", type=int, default=0, help="a member's worker id, forged")
    p.add_argument("--count", type=int, default=5, help="forged REQUESTs of the live job")
    p.add_argument("--unknown-count", type=int, default=3)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--elements", type=int, default=2048)
    p.add_argument("--spread-s", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=60.0)
    args = p.parse_args(argv)
    ip, _, port = args.to.rpartition(":")
    deadline = time.monotonic() + args.timeout_s
    while not args.wait_file.exists():
        if time.monotonic() > deadline:
            print(json.dumps({"error": f"{args.wait_file} never appeared"}), flush=True)
            return 1
        time.sleep(0.01)
    values = np.full(args.elements, 1 << 20, dtype=np.int32)
    packets = []
    for k in range(args.count + args.unknown_count):
        job = args.job if k < args.count else args.unknown_job
        chunk = k % args.slots
        packets.append(build(Header(PacketType.REQUEST, job, chunk, slot_of(chunk, args.slots),
                                    gen_of(chunk, args.slots), args.sender), values))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sent = 0
    try:
        for data in packets:
            sock.sendto(data, (ip, int(port)))
            sent += 1
            time.sleep(args.spread_s / len(packets))
    finally:
        sock.close()
    print(json.dumps({"sent": sent, "live_job": args.count, "unknown_job": args.unknown_count}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
