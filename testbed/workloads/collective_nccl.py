"""Collective results the way nccl-tests prints them: its text table and its `-J` JSON.

Both are written from the run's result rows (testbed/workloads/collective.py), one row
per message size, so a user's nccl-tests parsers read them unchanged. What differs from
a GPU run is said in the header: times are fabric microseconds and bandwidths fabric
GB/s (10^9 bytes/s, as nccl-tests), only the out-of-place column is measured (the
in-place one is null in JSON and blank in the table), and the bus-bandwidth factor of
the operation is stated.

Layouts follow nccl-tests' src/util.cu (JSON file version 2): `results[]` holds `size`,
`count`, `type`, `redop`, `root` (a padded string, as nccl-tests writes it),
`out_of_place {time, alg_bw, bus_bw, nwrong}`, `out_of_place_per_iter {min_us, max_us,
avg_us, p50_us, p95_us, p99_us, stdev_us, cv_pct, times_us}`, `in_place: null`,
`actual_iterations`, `experiment_name`; then `out_of_bounds {count, okay}` and
`average_bus_bandwidth {bandwidth, okay}`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# nccl-tests' names of the data types and what it prints for an operation without one.
NCCL_TYPE = {"float32": "float", "float16": "half", "bfloat16": "bfloat16", "int32": "int32"}
JSON_FILE_VERSION = 2


def _float(value: float, width: int) -> str:
    """A number in `width` characters, with as many decimals as fit (nccl-tests'
    getFloatStr)."""
    power = 0
    val = 1
    while value >= val:
        power += 1
        val *= 10
    if power < width - 2:
        return f"{value:{width}.2f}"
    if power < width - 1:
        return f"{value:{width}.1f}"
    if power < width + 1:
        return f"{value:{width}.0f}"
    return f"{value:{width}.1e}"


def percentile_index(n: int, percentile: int) -> int:
    """nccl-tests' index of a percentile in n sorted samples."""
    return min(n - 1, (n * percentile + 99) // 100 - 1)


def iteration_stats(times_us: Sequence[float]) -> dict[str, Any]:
    """min/max/avg/p50/p95/p99/stdev/cv% of per-iteration times, as nccl-tests' -I."""
    if not times_us:
        return {}
    s = sorted(times_us)
    n = len(s)
    avg = sum(s) / n
    stdev = math.sqrt(sum((t - avg) ** 2 for t in s) / n)
    return {"min_us": s[0], "max_us": s[-1], "avg_us": avg, "p50_us": s[n // 2],
            "p95_us": s[percentile_index(n, 95)], "p99_us": s[percentile_index(n, 99)],
            "stdev_us": stdev, "cv_pct": stdev / avg * 100 if avg > 0 else 0.0,
            "times_us": list(times_us)}


def table(entry: str, rows: Sequence[Mapping], header: Mapping[str, object]) -> str:
    """nccl-tests' stdout for one workload entry: the settings, the table, the footer."""
    h = header
    lines = [
        f"# {entry}: {h['operation']} ({h['algorithm']}) over {h['ranks']} ranks, "
        "emulated fabric (testbed)",
        f"# nThread 1 nGpus 1 minBytes {h['min_bytes']} maxBytes {h['max_bytes']} step: "
        f"{h['factor']}(factor) warmup iters: {h['warmup']} iters: {h['iterations']} "
        "agg iters: 1 validation: 1 graph: 0",
        f"# time: fabric us; algbw, busbw: fabric GB/s; busbw = algbw x {h['bus_factor']} "
        f"({h['bus_factor_formula']}); out-of-place only",
        "#",
        f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}           out-of-place"
        "                       in-place          ",
        f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  "
        f"{'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  {'time':>7}  "
        f"{'algbw':>6}  {'busbw':>6}  {'#wrong':>6}",
        f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  "
        f"{'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}"
        f"  {'':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r['bytes']:12d}  {r['count']:12d}  {NCCL_TYPE[r['dtype']]:>8}  "
            f"{r['redop']:>6}  {r['root']:6d}  {_float(r['time_us'], 7)}  "
            f"{_float(r['algbw_gbps'], 6)}  {_float(r['busbw_gbps'], 6)}  "
            f"{_wrong_cell(r['wrong'])}  {'':>7}  {'':>6}  {'':>6}  {'':>6}")
    wrong = sum(int(r["wrong"]) for r in rows if r["wrong"] is not None)
    unchecked = sum(1 for r in rows if r["wrong"] is None)
    if unchecked:
        lines.append(f"# {unchecked} size(s) stopped before their check: #wrong N/A")
    lines += [f"# {'Out of bounds values':<20} : {wrong} {'FAILED' if wrong else 'OK'}",
              f"# {'Avg bus bandwidth':<20} : {average_busbw(rows):g} ",
              "#"]
    return "\n".join(lines) + "\n"


def _wrong_cell(wrong: object) -> str:
    """#wrong as nccl-tests prints it: a count, or N/A where nothing was checked."""
    return f"{'N/A':>6}" if wrong is None else f"{wrong:6g}"


def average_busbw(rows: Sequence[Mapping]) -> float:
    """nccl-tests' closing line: the mean bus bandwidth over the sizes."""
    return sum(float(r["busbw_gbps"]) for r in rows) / len(rows) if rows else 0.0


def json_report(entry: str, rows: Sequence[Mapping], header: Mapping[str, object],
                argv: Sequence[str]) -> dict:
    """nccl-tests' -J document for one workload entry."""
    results = []
    for r in rows:
        results.append({
            "size": r["bytes"], "count": r["count"], "type": NCCL_TYPE[r["dtype"]],
            "redop": r["redop"], "root": f"{r['root']:6d}",
            "out_of_place": {"time": r["time_us"], "alg_bw": r["algbw_gbps"],
                             "bus_bw": r["busbw_gbps"],
                             "nwrong": None if r["wrong"] is None else float(r["wrong"])},
            "out_of_place_per_iter": iteration_stats(r["iterations_us"]),
            "in_place": None,
            "actual_iterations": len(r["iterations_us"]),
            "experiment_name": entry,
        })
    wrong = sum(int(r["wrong"]) for r in rows if r["wrong"] is not None)
    return {
        "version": JSON_FILE_VERSION, "args": list(argv), "env": [], "nccl_version": None,
        "config": {"nthreads": 1, "ngpus": 1, "minimum_bytes": header["min_bytes"],
                   "maximum_bytes": header["max_bytes"], "step_factor": header["factor"],
                   "warmup_iters": header["warmup"], "iterations": header["iterations"],
                   "aggregated_iterations": 1, "validation": 1, "graph": 0,
                   "blocking_collectives": "false", "per_iter_timing": "true",
                   "parallel_init": "false", "devices": header["devices"]},
        "results": results,
        "out_of_bounds": {"count": wrong, "okay": "true" if wrong == 0 else "false"},
        "average_bus_bandwidth": {"bandwidth": average_busbw(rows), "okay": "unchecked"},
        "errors": [],
    }
