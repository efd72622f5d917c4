"""How fast the collectives' RoCE transport (`RoceTransport`) streams chunks, on 127.0.0.1.

Two processes, rank 0 and rank 1, each one `agents.collectives.roce.connect` over
loopback (no root, no namespaces, D = 1, `--cc none`, a line rate far above what
Python reaches, `--spin-ns 0`, a 1 s retransmit timeout). Rank 0 `send`s
`--messages` messages of `--bytes` to rank 1 and waits for them to be acknowledged;
rank 1 `recv`s each into one buffer and checks the last one byte for byte. Per
setting (QPs, chunk bytes, path MTU): wall seconds of the stream, data packets per
second that rank 0 put on the wire, payload Gb/s, CPU seconds per wall second of each
process (user + system), retransmissions and RNR NAKs. Medians over `--repeat`.

    .venv/bin/python bench/collective_transport.py [--messages 64] [--bytes 1048576]
        [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LOOPBACK = "127.0.0.1"
#: (QPs, chunk bytes, path MTU) per row
SETTINGS = [(1, 65536, 4096), (2, 65536, 4096), (1, 16384, 1024)]


def _free_ports(n: int, kind: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, kind) for _ in range(n)]
    try:
        for s in socks:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def child(rank: int, peers_text: str, qps: int, chunk_bytes: int, mtu: int, messages: int,
          nbytes: int) -> None:
    """One rank: connect, stream (rank 0 sends, rank 1 receives), print one JSON line."""
    import numpy as np

    from agents.collectives.__main__ import build_parser
    from agents.collectives.roce import RoceConfig, connect, parse_peers

    args = build_parser().parse_args(
        ["--rank", str(rank), "--peers", peers_text, "--cc", "none", "--line-rate-bps", "1e13",
         "--timeout-ns", "1e9", "--spin-ns", "0", "--mtu", str(mtu)])
    config = RoceConfig(args=args, qps=qps, chunk_bytes=chunk_bytes, connect_timeout_s=30)
    t = connect(rank, parse_peers(peers_text), config)
    try:
        data = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes, dtype=np.uint8)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        if rank == 0:
            for _ in range(messages):
                t.send(1, 0, data)
            t.wait_sends()
        else:
            for _ in range(messages):
                t.recv(0, 0, out)
        wall = time.monotonic() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        # leave together: the receiver's last ACKs must reach the sender
        t.send(1 - rank, 1, np.zeros(1, dtype=np.uint8))
        t.recv(1 - rank, 1, np.empty(1, dtype=np.uint8))
        t.wait_sends()
        t.leave("done")
        c = t.counters()
        print(json.dumps({
            "rank": rank, "wall_s": wall,
            "cpu_s": ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
            "packets_sent": c["packets_sent"], "retransmissions": c["retransmissions"],
            "rnr_naks": c["rnr_naks_received"] + c["rnr_naks_sent"],
            "steps": c["engine"]["steps"], "waits": c["engine"]["waits"],
            "exact": bool(rank == 0 or np.array_equal(out, data))}))
    finally:
        t.close()


def run_once(qps: int, chunk_bytes: int, mtu: int, messages: int, nbytes: int) -> dict:
    tcp, udp = _free_ports(2, socket.SOCK_STREAM), _free_ports(2, socket.SOCK_DGRAM)
    peers = ",".join(f"{LOOPBACK}:{tcp[r]}:{udp[r]}" for r in (0, 1))
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--child", str(r), "--peers", peers, "--qps", str(qps),
         "--chunk-bytes", str(chunk_bytes), "--mtu", str(mtu), "--messages", str(messages),
         "--bytes", str(nbytes)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"rank failed ({p.returncode}): {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    s, r = outs
    wall = max(s["wall_s"], r["wall_s"])
    return {"wall_s": wall, "pps": s["packets_sent"] / wall,
            "gbps": messages * nbytes * 8 / wall / 1e9, "tx_cpu": s["cpu_s"] / wall,
            "rx_cpu": r["cpu_s"] / wall, "retx": s["retransmissions"],
            "rnr": s["rnr_naks"], "exact": r["exact"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=64)
    parser.add_argument("--bytes", type=int, default=1 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peers", help=argparse.SUPPRESS)
    parser.add_argument("--qps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-bytes", type=int, default=65536, help=argparse.SUPPRESS)
    parser.add_argument("--mtu", type=int, default=4096, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.peers, args.qps, args.chunk_bytes, args.mtu, args.messages,
              args.bytes)
        return 0
    print(f"RoceTransport on {LOOPBACK}, rank 0 -> rank 1, {args.messages} x {args.bytes} B, "
          f"median of {args.repeat}, pid {os.getpid()}")
    head = (f"{'qps':>3} {'chunk':>6} {'mtu':>5} {'wall s':>7} {'pkt/s':>8} {'Gb/s':>6} "
            f"{'tx cpu':>6} {'rx cpu':>6} {'retx':>5} {'rnr':>5} exact")
    print(head)
    print("-" * len(head))
    for qps, chunk, mtu in SETTINGS:
        rows = [run_once(qps, chunk, mtu, args.messages, args.bytes) for _ in range(args.repeat)]
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("wall_s", "pps", "gbps", "tx_cpu", "rx_cpu")}
        print(f"{qps:>3} {chunk:>6} {mtu:>5} {med['wall_s']:>7.3f} {med['pps']:>8,.0f} "
              f"{med['gbps']:>6.2f} {med['tx_cpu']:>6.2f} {med['rx_cpu']:>6.2f} "
              f"{max(r['retx'] for r in rows):>5} {max(r['rnr'] for r in rows):>5} "
              f"{all(r['exact'] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
