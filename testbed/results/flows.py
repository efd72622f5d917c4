"""Sized flows' results: their ideal (standalone) completion time, the two files a run
writes of them and the statistics the report and `testbed compare` show.

- results/flows.csv: ours, every flow (finished or not), in flow_id order;
- results/fct.txt: HPCC's format, a line per finished flow, so HPCC's analysis scripts
  (analysis/fct_analysis.py) read our runs as they read ns-3's;
- slowdown_buckets: HPCC's fct_analysis.py buckets (5 % slices of the flows by size) or
  fixed size ranges; fct_cdf / slowdown_cdf; unfinished.

Pure, except the writers. The database side (the `flows` table) is
testbed/results/store.py; docs/run-format.md documents the files and the table.
"""

from __future__ import annotations

import csv
import ipaddress
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.results.files import write_private
from testbed.workloads.base import FlowRecord

# the kind's formula, here too for the readers of results (one definition, the kind's)
from testbed.workloads.flows import ideal_fct_ns, message_wire_bytes  # noqa: F401

FLOWS_CSV = "flows.csv"
FCT_TXT = "fct.txt"
FLOWS_CSV_HEADER = ("src", "dst", "sport", "dport", "size_bytes", "start_ns", "fct_ns",
                    "ideal_fct_ns", "slowdown")

#: HPCC's fct_analysis.py default step: 20 buckets of 5 % of the flows each.
HPCC_STEP_PERCENT = 5
#: scheme="sizes": upper edges (exclusive) of the size ranges, bytes; the last is open.
SIZE_EDGES_BYTES = (10_000, 100_000, 1_000_000, 10_000_000)
PERCENTILES = (0.5, 0.95, 0.99)


# --- files --------------------------------------------------------------------------------

def _fmt_slowdown(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def flows_csv_lines(records: Iterable[FlowRecord]) -> Iterator[str]:
    """flows.csv's lines: the header, then a row per record as given."""
    yield ",".join(FLOWS_CSV_HEADER) + "\n"
    for r in records:
        yield (f"{r.src},{r.dst},{r.sport},{r.dport},{r.size_bytes},{r.start_ns},"
               f"{'' if r.fct_ns is None else r.fct_ns},{r.ideal_fct_ns},"
               f"{_fmt_slowdown(r.slowdown)}\n")


def write_flows_csv(path: Path, records: Iterable[FlowRecord]) -> None:
    """results/flows.csv: every flow, in flow_id order; an unfinished one has empty fct_ns
    and slowdown. Host names, fabric ns after the workload's t0."""
    write_private(path, flows_csv_lines(sorted(records, key=lambda r: r.flow_id)))


def _ip_hex(address: str) -> str:
    return f"{int(ipaddress.IPv4Address(address)):08x}"


def fct_txt_line(r: FlowRecord) -> str:
    """One finished flow as HPCC's qp_finish prints it: sip dip sport dport size start fct
    standalone_fct, addresses as 8 hex digits, times in ns. The dport column is the
    entry's `fct_dport` where it sets one (extra["fct_dport"]): HPCC's analysis selects
    flows by it (100 normal, 200 incast), where our flows have ports of their own."""
    if r.fct_ns is None:
        raise ValueError(f"flow {r.flow_id} did not finish: fct.txt holds finished flows only")
    dport = r.extra.get("fct_dport") or r.dport
    return (f"{_ip_hex(r.src_ip)} {_ip_hex(r.dst_ip)} {r.sport} {dport} {r.size_bytes} "
            f"{r.start_ns + r.time_offset_ns} {r.fct_ns} {r.ideal_fct_ns}\n")


def write_fct_txt(path: Path, records: Iterable[FlowRecord]) -> None:
    """results/fct.txt in HPCC's format: a line per finished flow, in the order they
    finished (as ns-3 prints a line when a QP completes), ties by flow_id.

    Matched against alibaba-edu/High-Precision-Congestion-Control, simulation/scratch/
    third.cc at commit 4b78df67: qp_finish's
    fprintf("%08x %08x %u %u %lu %lu %lu %lu\\n", sip, dip, sport, dport, m_size,
    startTime, now - startTime, standalone_fct), ns. Our start is the scheduled start plus
    the entry's time_offset (HPCC's flows start at absolute simulator times, 2 s in its
    traces); unfinished flows get no line, as a QP that never completes prints none."""
    done = sorted((r for r in records if r.fct_ns is not None),
                  key=lambda r: (r.start_ns + (r.fct_ns or 0), r.flow_id))
    write_private(path, (fct_txt_line(r) for r in done))


def write_flow_files(run_dir: Path, records: Sequence[FlowRecord]) -> tuple[Path, Path]:
    """results/flows.csv and results/fct.txt of a run (both written even with no flows
    finished); called once with every kind's records. Returns their paths."""
    out = Path(run_dir) / "results"
    out.mkdir(mode=0o700, exist_ok=True)
    csv_path, txt_path = out / FLOWS_CSV, out / FCT_TXT
    write_flows_csv(csv_path, records)
    write_fct_txt(txt_path, records)
    return csv_path, txt_path


def read_flows_csv(path: Path) -> list[FlowRecord]:
    """The records of a flows.csv (for run directories whose database has no flows
    table). The file has no workload, addresses or class: they read as '' and -1, and
    flow ids are the rows' order. ValueError for a file that is not a flows.csv."""
    path = Path(path)
    out = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        head = next(reader, None)
        if head is None or tuple(head) != FLOWS_CSV_HEADER:
            raise ValueError(f"{path}: not a flows.csv (header {head!r})")
        for n, row in enumerate(reader):
            if not row:
                continue
            try:
                src, dst, sport, dport, size, start, fct, ideal, _slowdown = row
                out.append(FlowRecord(
                    workload="", flow_id=n, src=src, dst=dst, src_ip="", dst_ip="",
                    sport=int(sport), dport=int(dport), size_bytes=int(size),
                    start_ns=int(start), fct_ns=int(fct) if fct else None,
                    ideal_fct_ns=int(ideal), tc=-1))
            except ValueError:
                raise ValueError(f"{path}:{n + 2}: not a flows.csv row: {row!r}") from None
    return out


# --- statistics ---------------------------------------------------------------------------

def pctl(ordered: Sequence[float], p: float) -> float:
    """HPCC's get_pctl: a[int(len(a) x p)] of the sorted values (the last at p = 1)."""
    return ordered[min(int(len(ordered) * p), len(ordered) - 1)]


def finished(records: Iterable[FlowRecord]) -> list[FlowRecord]:
    return [r for r in records if r.fct_ns is not None]


def unfinished(records: Iterable[FlowRecord]) -> list[FlowRecord]:
    """The flows that did not complete, by scheduled start (then flow_id)."""
    return sorted((r for r in records if r.fct_ns is None),
                  key=lambda r: (r.start_ns, r.flow_id))


@dataclass(frozen=True)
class Bucket:
    """One row of slowdown_buckets: flows of sizes up to `size_max_bytes` (HPCC: the
    largest size in the slice; sizes: the range's upper edge, None for the open one)."""

    label: str
    size_min_bytes: int
    size_max_bytes: int | None
    count: int
    p50: float
    p95: float
    p99: float


def _bucket(label: str, lo: int, hi: int | None, slowdowns: list[float]) -> Bucket:
    s = sorted(slowdowns)
    return Bucket(label, lo, hi, len(s), *(pctl(s, p) for p in PERCENTILES))


def _size_label(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}B"


def slowdown_buckets(records: Iterable[FlowRecord], scheme: str = "hpcc") -> list[Bucket]:
    """Slowdown percentiles of the finished flows by size.

    scheme "hpcc", as HPCC's analysis/fct_analysis.py (default step 5): the flows sorted
    by size (then slowdown), slice i of 20 is flows [i x n / 20, (i + 1) x n / 20) (whole
    division), labelled with the slice's largest size; p50/p95/p99 are get_pctl
    (a[int(len(a) x p)]) of its sorted slowdowns. Empty slices (fewer than 20 flows) are
    left out, where fct_analysis.py would fail; it also drops the last line of its input
    (split('\\n')[:-2]), which we do not.
    scheme "sizes": fixed ranges <10KB, 10KB-100KB, 100KB-1MB, 1MB-10MB, >=10MB
    (SIZE_EDGES_BYTES, SI units), the empty ones left out."""
    done = sorted((r.size_bytes, r.slowdown or 1.0) for r in finished(records))
    if scheme == "hpcc":
        n, out = len(done), []
        for i in range(0, 100, HPCC_STEP_PERCENT):
            part = done[i * n // 100:(i + HPCC_STEP_PERCENT) * n // 100]
            if part:
                out.append(_bucket(_size_label(part[-1][0]), part[0][0], part[-1][0],
                                   [s for _, s in part]))
        return out
    if scheme == "sizes":
        edges = (0, *SIZE_EDGES_BYTES)
        out = []
        for j, lo in enumerate(edges):
            hi = edges[j + 1] if j + 1 < len(edges) else None
            inside = [s for size, s in done if size >= lo and (hi is None or size < hi)]
            if inside:
                label = (f"<{_size_label(hi)}" if lo == 0 and hi is not None else
                         f">={_size_label(lo)}" if hi is None else
                         f"{_size_label(lo)}-{_size_label(hi)}")
                out.append(_bucket(label, lo, hi, inside))
        return out
    raise ValueError(f"slowdown_buckets: scheme {scheme!r} is not 'hpcc' or 'sizes'")


def hpcc_upper_bytes(records: Iterable[FlowRecord]) -> list[int]:
    """The largest size of each of HPCC's 5 % slices of every flow, finished or not
    (increasing, each once): bucket edges two runs of the same flows share even when
    different flows of them finished (testbed compare)."""
    sizes = sorted(r.size_bytes for r in records)
    n = len(sizes)
    out: list[int] = []
    for i in range(0, 100, HPCC_STEP_PERCENT):
        part = sizes[i * n // 100:(i + HPCC_STEP_PERCENT) * n // 100]
        if part and (not out or part[-1] > out[-1]):
            out.append(part[-1])
    return out


def edge_buckets(records: Iterable[FlowRecord], upper_bytes: Sequence[int]) -> list[Bucket]:
    """Slowdown percentiles (get_pctl) of the finished flows with sizes in
    (previous edge, edge], per edge of `upper_bytes` (increasing), labelled with the edge;
    flows above the last edge are left out, and so are empty buckets."""
    done = sorted((r.size_bytes, r.slowdown or 1.0) for r in finished(records))
    out, lo = [], 0
    for hi in upper_bytes:
        inside = [s for size, s in done if lo < size <= hi]
        if inside:
            out.append(_bucket(_size_label(hi), lo + 1, hi, inside))
        lo = hi
    return out


def _cdf(values: list[float]) -> list[tuple[float, float]]:
    values.sort()
    n = len(values)
    return [(v, (i + 1) / n) for i, v in enumerate(values)]


def fct_cdf(records: Iterable[FlowRecord]) -> list[tuple[float, float]]:
    """[(fct_ns, fraction of finished flows with an FCT <= it)], increasing."""
    return _cdf([float(r.fct_ns) for r in finished(records) if r.fct_ns is not None])


def slowdown_cdf(records: Iterable[FlowRecord]) -> list[tuple[float, float]]:
    """[(slowdown, fraction of finished flows with a slowdown <= it)], increasing."""
    return _cdf([r.slowdown or 1.0 for r in finished(records)])


@dataclass(frozen=True)
class FlowSummary:
    flows: int
    finished: int
    unfinished: int
    p50: float | None           # slowdown percentiles of the finished flows (get_pctl)
    p95: float | None
    p99: float | None


def flow_summary(records: Iterable[FlowRecord]) -> FlowSummary:
    """How many flows, how many finished, and their overall slowdown percentiles."""
    records = list(records)
    s = sorted(r.slowdown or 1.0 for r in finished(records))
    p50, p95, p99 = (pctl(s, p) for p in PERCENTILES) if s else (None, None, None)
    return FlowSummary(len(records), len(s), len(records) - len(s), p50, p95, p99)
