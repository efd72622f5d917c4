"""Every all-reduce algorithm on the default fabric (8 ranks, one per host, 100G NICs,
2 leaves x 4 hosts, 2 spines), swept over sizes, beside an alpha-beta model.

One `testbed run` per algorithm (ring, rhd, tree, ina) of the default fabric with a
collective entry; prints, per size, the measured time, algbw and busbw (fabric units,
nccl-tests' definitions), the model's time, and the bytes the leaf-spine links carried.

Leaf-spine bytes. Ranks are in leaf order (h1..h8), as NCCL builds its rings, so the
ring crosses the leaf-spine links at 2 of its 8 hops: 2 hops x 2(n-1)/n S x 2 links =
7 S, against in-network's 2 leaves x (S up + S down) = 4 S, a ratio of 4/7 whatever H.
"ring-x" is the same ring over ranks interleaved across the leaves (every hop crosses:
28 S), the placement the 1/H target compares with: 4/28 = 1/7 at n = 8, H = 4.

The model (Hockney's alpha-beta, as in Thakur et al. 2005), with n ranks, S bytes, B the
NIC rate and alpha one step's latency:
- ring: 2(n-1) alpha + 2(n-1)/n S/B
- rhd:  2 ceil(log2 n) alpha + 2(n-1)/n S/B (+ 2 alpha + S/B when n is not a power of 2)
- tree: 2 ceil(log2 n) alpha + 2 S/B (no rank sends more than 2S over both trees)
- ina:  2 alpha + S/B (each rank sends S up and receives S down, at once)
alpha is fitted from ring's smallest size (its time over 2(n-1)), so the table shows
how far each algorithm's latency and bandwidth terms are from the model's.

    sudo .venv/bin/python bench/collectives.py [--min 4KiB] [--max 4MiB] [--factor 4]
        [--iterations 3] [--algorithms ring,rhd,tree,ina,ring-x] [--dilation 4000]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.config import load_config_text  # noqa: E402
from testbed.plan import compile_plan  # noqa: E402
from testbed.run.runner import RunOptions, run_config  # noqa: E402
from testbed.units import parse_size_bytes  # noqa: E402

FABRIC = """\
name: bc{name}
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
    - {{name: ar, kind: allreduce, algorithm: {alg}, ranks: [{ranks}],
       sizes: {{min: {min}, max: {max}, factor: {factor}}}, iterations: {iterations},
       warmup: 1}}
"""
N = 8
LEAF_ORDER = "h1, h2, h3, h4, h5, h6, h7, h8"      # rank order = leaf order, as NCCL rings
#: "ring-x": the ring over ranks interleaved across the leaves, so that every hop crosses
#: the leaf-spine links (a placement that ignores the topology).
INTERLEAVED = "h1, h5, h2, h6, h3, h7, h4, h8"
HOSTS_PER_LEAF = 4
NIC_BYTES_PER_US = 100e9 / 8 / 1e6


def model_us(alg: str, size: int, alpha_us: float, n: int = N) -> float:
    s_us = size / NIC_BYTES_PER_US
    steps = math.ceil(math.log2(n))
    if alg in ("ring", "ring-x"):
        return 2 * (n - 1) * alpha_us + 2 * (n - 1) / n * s_us
    if alg == "rhd":
        extra = 0.0 if n & (n - 1) == 0 else 2 * alpha_us + s_us
        return 2 * steps * alpha_us + 2 * (n - 1) / n * s_us + extra
    if alg == "tree":
        return 2 * steps * alpha_us + 2 * s_us
    return 2 * alpha_us + s_us


def run_one(name: str, args: argparse.Namespace, root: Path) -> dict:
    alg = "ring" if name == "ring-x" else name
    text = FABRIC.format(name=name.replace("-", ""), alg=alg, min=args.min, max=args.max,
                         factor=args.factor, iterations=args.iterations,
                         dilation=args.dilation,
                         ranks=INTERLEAVED if name == "ring-x" else LEAF_ORDER)
    loaded = load_config_text(text, f"bench-{alg}.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=root, say=lambda _m: None))
    summary = result.summary
    rows = summary["workloads"][0]["results"]
    return {"rows": rows, "fabric_bytes": summary["totals"]["fabric_link_bytes"],
            "notes": [n for n in summary["fidelity"] if "collective" in n or "aggregator" in n],
            "dilation": summary["dilation"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min", default="4KiB")
    p.add_argument("--max", default="4MiB")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--algorithms", default="ring,rhd,tree,ina,ring-x",
                   help="ring-x: ring over ranks interleaved across the leaves")
    p.add_argument("--dilation", default="4000",
                   help="the fabric's dilation (default 4000: at auto, 2000 on a 2-core VM, "
                        "the fidelity watchdog finds the host ports short of their rate)")
    args = p.parse_args()
    parse_size_bytes(args.min), parse_size_bytes(args.max)      # fail early on a typo
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for alg in args.algorithms.split(","):
            out[alg] = run_one(alg, args, Path(tmp))
            print(f"ran {alg}: D={out[alg]['dilation']}", file=sys.stderr)
    ring = out.get("ring")
    alpha = (ring["rows"][0]["time_us"] / (2 * (N - 1))) if ring and ring["rows"] else 1.0
    print(f"# all-reduce, {N} ranks, default fabric; fabric us and GB/s; alpha fitted from "
          f"ring's smallest size: {alpha:.2f} us")
    print("| algorithm | size (B) | time (us) | model (us) | algbw (GB/s) | busbw (GB/s) "
          "| busbw / NIC | #wrong |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for alg, res in out.items():
        for r in res["rows"]:
            print(f"| {alg} | {r['bytes']:,} | {r['time_us']:.1f} | "
                  f"{model_us(alg, r['bytes'], alpha):.1f} | {r['algbw_gbps']:.2f} | "
                  f"{r['busbw_gbps']:.2f} | {r['busbw_gbps'] / 12.5:.0%} | {r['wrong']} |")
    print(f"\n| algorithm | leaf-spine bytes (whole sweep) | vs ring | vs ring-x | "
          f"target 1/H = 1/{HOSTS_PER_LEAF} |")
    print("|---|---:|---:|---:|---:|")
    ring_x = out.get("ring-x")
    for alg, res in out.items():
        ratio = res["fabric_bytes"] / ring["fabric_bytes"] if ring else float("nan")
        ratio_x = res["fabric_bytes"] / ring_x["fabric_bytes"] if ring_x else float("nan")
        print(f"| {alg} | {res['fabric_bytes']:,} | {ratio:.2f} | {ratio_x:.2f} | "
              f"{1 / HOSTS_PER_LEAF:.2f} |")
    if ring and "ina" in out:
        print("\n| size (B) | in-network speed-up over ring | model's |")
        print("|---:|---:|---:|")
        for r_ring, r_ina in zip(ring["rows"], out["ina"]["rows"], strict=False):
            got = r_ring["time_us"] / r_ina["time_us"] if r_ina["time_us"] else float("nan")
            want = model_us("ring", r_ring["bytes"], alpha) / model_us("ina", r_ina["bytes"],
                                                                        alpha)
            print(f"| {r_ring['bytes']:,} | {got:.2f} | {want:.2f} |")
    for alg, res in out.items():
        for note in res["notes"]:
            print(f"note ({alg}): {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
