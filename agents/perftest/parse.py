"""Parse perftest's report (ib_write_bw, ib_send_bw, ib_write_lat stdout) into rows. Pure.

perftest prints a header, the connection's addresses and then one table between two
dashed lines: a title line starting with `#bytes` and one line of numbers per message size.
The table is what is parsed: this perftest version (4.5+0.17, Debian 12) also writes
`--out_json`, but its file is not JSON (unquoted keys, trailing commas), and holds the same
numbers. Three tables exist:

- bandwidth tests: #bytes #iterations BW peak BW average MsgRate[Mpps], the rates in Gb/s
  with --report_gbits, else MB/s (MiB per second);
- latency tests with -n: #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%;
- latency tests with -D: #bytes #iterations t_avg tps average.

Numbers are wall time, as perftest measured them; fabric units are the caller's business
(testbed/workloads/perftest.py multiplies rates by the dilation D).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

MIB = 1024 * 1024


class PerftestOutputError(ValueError):
    """perftest did not print a result table; the message says what it printed instead."""


@dataclass(frozen=True)
class PerftestRow:
    bytes: int
    iterations: int
    bw_peak_gbps: float | None = None      # wall Gb/s (10^9 bit/s)
    bw_avg_gbps: float | None = None
    msg_rate_mpps: float | None = None     # wall million messages per second
    t_min_us: float | None = None          # wall microseconds
    t_max_us: float | None = None
    t_typical_us: float | None = None
    t_avg_us: float | None = None
    t_stdev_us: float | None = None
    t_p99_us: float | None = None
    t_p999_us: float | None = None
    tps: float | None = None               # transactions per second (latency, -D)

    def as_dict(self) -> dict:
        return asdict(self)


_NUM = re.compile(r"^\s*\d+\s+\d+(\s+[-+0-9.eE]+)+\s*$")


def _problem(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("---")]
    for ln in lines:
        if re.search(r"(?i)couldn't|unable|error|fail|not found|invalid", ln):
            return ln
    return lines[-1] if lines else "no output at all"


def parse_report(text: str) -> list[PerftestRow]:
    """Every result row of one perftest report; PerftestOutputError if it has none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip().startswith("#bytes"):
            continue
        out = []
        for row in lines[i + 1:]:
            if row.lstrip().startswith("---"):
                break                  # the closing dashed line
            if _NUM.match(row):
                out.append(_row(line, row))
        if out:
            return out
        raise PerftestOutputError(f"perftest printed a result table with no rows: "
                                  f"{_problem(text)}")
    raise PerftestOutputError(f"perftest printed no result table: {_problem(text)}")


def _row(header: str, line: str) -> PerftestRow:
    v = [float(x) for x in line.split()]
    size, iters = int(v[0]), int(v[1])
    if "BW average" in header:
        if len(v) < 5:
            raise PerftestOutputError(f"bandwidth row with {len(v)} numbers: {line.strip()}")
        scale = 1.0 if "Gb/sec" in header else MIB * 8 / 1e9   # MB/sec is MiB/s
        return PerftestRow(size, iters, bw_peak_gbps=v[2] * scale, bw_avg_gbps=v[3] * scale,
                           msg_rate_mpps=v[4])
    if "t_min" in header:
        if len(v) < 9:
            raise PerftestOutputError(f"latency row with {len(v)} numbers: {line.strip()}")
        return PerftestRow(size, iters, t_min_us=v[2], t_max_us=v[3], t_typical_us=v[4],
                           t_avg_us=v[5], t_stdev_us=v[6], t_p99_us=v[7], t_p999_us=v[8])
    if "tps" in header:
        return PerftestRow(size, iters, t_avg_us=v[2], tps=v[3])
    raise PerftestOutputError(f"unknown perftest table: {header.strip()}")
