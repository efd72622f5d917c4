"""Evaluate an incident's signature against a run's raw data (docs/incidents.md).

Every metric reads what the run recorded, never a number the incident file computed:
counter series from counters.sqlite (`Store.series`, step functions in fabric time from
t0), the result rows the agents wrote (`Store.results`), summary.json fields and rows of
the events table. Each predicate comes back as the contract's row: measured `value`,
`threshold`, `op`, `unit`, `held` (True, False, or None when its data is missing) and a
`detail` saying what was measured or why it could not be.

Units: values are computed in base units (bytes, ns, bit/s, counts) and shown scaled in
the verdict: bit/s as Gb/s, ns as us.
"""

from __future__ import annotations

import bisect
import fnmatch
import json
import math
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.incident.model import (
    CounterMetric,
    EventsMetric,
    Incident,
    Metric,
    Predicate,
    ResultMetric,
    Window,
)
from testbed.incident.paths import PathError, lookup
from testbed.results.store import Key, Points, Store
from testbed.units import UnitError, parse_duration_ns, parse_rate_bps, parse_size_bytes

OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12),
}


@dataclass
class RunData:
    """What a signature reads of one run: its store, its summary, its class names."""

    store: Store
    summary: dict
    classes: dict[str, int] = field(default_factory=dict)    # traffic class name -> tc
    run_dir: str | None = None


@contextmanager
def open_run(run_dir: Path, classes: dict[str, int] | None = None) -> Iterator[RunData]:
    """A finished run directory's data, for evaluation (the store is closed after)."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    if classes is None:
        classes = plan_classes(run_dir)
    store = Store(run_dir / "counters.sqlite")
    try:
        yield RunData(store, summary, classes, str(run_dir))
    finally:
        store.close()


def plan_classes(run_dir: Path) -> dict[str, int]:
    """Traffic class names of the run's fabric, from its plan.json (empty if unreadable)."""
    try:
        plan = json.loads((Path(run_dir) / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    classes = plan.get("traffic_classes") or []
    return {c["name"]: c["tc"] for c in classes if isinstance(c, dict) and "name" in c}


# ---- measured values -------------------------------------------------------------------

class Missing(Exception):
    """The data a metric needs is not in the run; the message says what is absent."""


@dataclass
class Measured:
    unit: str                                   # base unit: B, ns, b/s, us, '' (a count)
    detail: str
    value: float | None = None                  # one number (sum, max, ..., a count)
    per_series: dict[str, float] | None = None  # across all / any: one number per series


def counter_unit(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("_bps"):
        return "b/s"
    if "bytes" in leaf:
        return "B"
    if leaf.endswith("_ns"):
        return "ns"
    if leaf.endswith("_us"):
        return "us"
    return ""


def field_unit(name: str) -> str:
    """Result and summary fields name their unit (docs/run-format.md)."""
    if name == "gbps":
        return "Gb/s"        # roce rows: bytes over time, fabric Gb/s
    if name.endswith("_gbps"):
        return "GB/s"        # collectives' algbw/busbw: 10^9 bytes/s, as nccl-tests
    return counter_unit(name)


def _window(window: Window, times: list[int], open_ended: bool = False) -> tuple[float, float]:
    """The window in fabric ns; `start`/`end` are the first/last sample (or unbounded)."""
    def bound(v: str | int, default_inf: float) -> float:
        if v == "start":
            return -math.inf if open_ended else float(times[0])
        if v == "end":
            return math.inf if open_ended else float(times[-1])
        try:
            return float(parse_duration_ns(v))
        except UnitError as exc:
            raise Missing(f"window: {exc}") from None
    return bound(window.from_, -math.inf), bound(window.to, math.inf)


def _value_at(pts: Points, t: float) -> float | None:
    i = bisect.bisect_right([p[0] for p in pts], t) - 1
    return pts[i][1] if i >= 0 else None


def _pieces(pts: Points, a: float, b: float) -> list[tuple[float, float, float]]:
    """(from, to, value) of the step function within [a, b], from its first known value;
    a window of one instant is the value holding then."""
    out = []
    for j, (ts, v) in enumerate(pts):
        end = pts[j + 1][0] if j + 1 < len(pts) else b
        lo, hi = max(ts, a), min(end, b)
        if hi > lo:
            out.append((lo, hi, v))
    if not out and a == b and (v_at := _value_at(pts, b)) is not None:
        out.append((b, b, v_at))
    return out


def series_stat(pts: Points, stat: str, a: float, b: float, first_sample: float
                ) -> float | None:
    """One series' stat over [a, b]; None if it has no value in the window. A series first
    read after the run's first sample (an agent started later) counted from 0 before."""
    pieces = _pieces(pts, a, b)
    if not pieces:
        return None
    if stat in ("delta", "rate", "rate_bps"):
        start = _value_at(pts, a)
        t_start = a
        if start is None:
            if pts[0][0] > first_sample:
                start = 0.0
            else:
                t_start, start = pieces[0][0], pieces[0][2]
        end = _value_at(pts, b)
        delta = (end if end is not None else start) - start
        if stat == "delta":
            return delta
        span_s = (b - t_start) / 1e9
        if span_s <= 0:
            return None
        return delta / span_s * (8 if stat == "rate_bps" else 1)
    values = [v for _lo, _hi, v in pieces]
    if stat == "max":
        return max(values)
    if stat == "min":
        return min(values)
    if stat == "last":
        return _value_at(pts, b)
    total = sum(hi - lo for lo, hi, _v in pieces)
    if stat == "mean":
        return (sum((hi - lo) * v for lo, hi, v in pieces) / total) if total else values[-1]
    if stat == "fraction_nonzero":
        return (sum(hi - lo for lo, hi, v in pieces if v) / total) if total else \
            float(bool(values[-1]))
    raise ValueError(stat)


def _stat_unit(stat: str, unit: str) -> str:
    if stat == "rate_bps":
        return "b/s"
    if stat == "rate":
        return f"{unit}/s" if unit else "/s"
    if stat == "fraction_nonzero":
        return ""
    return unit


def _tclass_of(tclass: int | str, classes: dict[str, int]) -> int | None:
    if tclass == "*":
        return None
    if isinstance(tclass, int):
        return tclass
    if tclass.lstrip("-").isdigit():
        return int(tclass)
    if tclass not in classes:
        raise Missing(f"no traffic class {tclass!r} in this run ({', '.join(classes) or 'none'})")
    return classes[tclass]


def label(key: Key) -> str:
    node, port, tclass = key
    return f"{node}:{port or '-'}" + (f" TC{tclass}" if tclass >= 0 else "")


def matching_series(store: Store, name: str, node: str, port: str, tclass: int | str,
                    classes: dict[str, int]) -> dict[Key, Points]:
    tc = _tclass_of(tclass, classes)
    return {key: pts for key, pts in store.series(name).items()
            if fnmatch.fnmatchcase(key[0], node) and fnmatch.fnmatchcase(key[1], port)
            and (tc is None or key[2] == tc)}


def _where(m: CounterMetric) -> str:
    tc = "" if m.tclass == "*" else f" TC{m.tclass}"
    return f"{m.name} at {m.node}:{m.port}{tc}"


def measure_counter(m: CounterMetric, run: RunData) -> Measured:
    store = run.store
    unit = counter_unit(m.name)
    if m.stat == "rate_bps" and unit != "B":
        raise Missing(f"stat rate_bps turns bytes into bit/s, but {m.name} is not in bytes; "
                      "use stat: rate (per fabric second)")
    times = store.sample_times()
    if not times:
        raise Missing("the run has no samples")
    found = matching_series(store, m.name, m.node, m.port, m.tclass, run.classes)
    if not found:
        known = ", ".join(store.counters()[:12]) or "none"
        raise Missing(f"no series of {_where(m)} (counters: {known})")
    a, b = _window(m.window, times)
    a, b = max(a, times[0]), min(b, times[-1])
    if b < a:
        raise Missing(f"the window {m.window.from_}..{m.window.to} holds no sample "
                      f"(samples {times[0] / 1e3:,.0f}..{times[-1] / 1e3:,.0f} us)")
    values = {label(k): v for k, pts in sorted(found.items())
              if (v := series_stat(pts, m.stat, a, b, times[0])) is not None}
    if not values:
        raise Missing(f"none of the {len(found)} series of {_where(m)} has a value in the "
                      "window")
    out_unit = _stat_unit(m.stat, unit)
    span = f"{a / 1e3:,.0f}..{b / 1e3:,.0f} us"
    detail = f"{m.stat} of {len(values)} series over {span}"
    if m.across in ("all", "any"):
        return Measured(out_unit, detail, per_series=values)
    if m.across == "count":
        each = m.each.op if m.each else ">"
        limit = parse_threshold(m.each.value if m.each else 0, out_unit)
        held = [k for k, v in values.items() if OPS[each](v, limit)]
        return Measured("series", f"{detail}; {len(held)} with {m.stat} {each} "
                        f"{show(limit, out_unit)[0]:g}{show(limit, out_unit)[1]}",
                        value=float(len(held)))
    picks: dict[str, Callable[[list[float]], float]] = {"sum": sum, "max": max, "min": min}
    value = float(picks[m.across](list(values.values())))
    if m.across != "sum" or len(values) == 1:
        at = next(k for k, v in values.items() if v == value)
        detail += f"; at {at}"
    elif value:
        top = max(values, key=lambda k: abs(values[k]))
        shown, shown_unit = show(values[top], out_unit)
        detail += f"; largest {top}: {shown:g} {shown_unit}".rstrip()
    return Measured(out_unit, detail, value=value)


def _matches(row: dict, where: dict[str, Any]) -> bool:
    for k, want in where.items():
        got = row.get(k)
        if isinstance(want, str) and isinstance(got, str):
            if not fnmatch.fnmatchcase(got, want):
                return False
        elif got != want:
            return False
    return True


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def measure_result(m: ResultMetric, run: RunData) -> Measured:
    rows = [r for r in run.store.results()
            if fnmatch.fnmatchcase(str(r.get("workload", "")), m.workload) and _matches(r, m.where)]
    if not rows:
        names = sorted({str(r.get("workload")) for r in run.store.results()})
        raise Missing(f"no result rows of workload {m.workload!r}"
                      + (f" matching {m.where}" if m.where else "")
                      + f" (workloads with rows: {', '.join(names) or 'none'})")
    values = [v for r in rows if (v := _number(r.get(m.field))) is not None]
    if m.agg == "count":
        return Measured("rows", f"{len(values)} of {len(rows)} rows have {m.field}",
                        value=float(len(values)))
    if not values:
        raise Missing(f"none of the {len(rows)} rows of {m.workload!r} has a number in "
                      f"{m.field!r}")
    agg: dict[str, Callable[[list[float]], float]] = {
        "sum": sum, "max": max, "min": min, "mean": lambda v: sum(v) / len(v),
        "first": lambda v: v[0], "last": lambda v: v[-1]}
    return Measured(field_unit(m.field), f"{m.agg} of {m.field} over {len(values)} row(s) of "
                    f"{m.workload}", value=float(agg[m.agg](values)))


def measure_summary(path: str, run: RunData) -> Measured:
    try:
        value, _loc = lookup(run.summary, path, "summary")
    except PathError as exc:
        raise Missing(str(exc)) from None
    number = _number(value)
    if number is None:
        raise Missing(f"summary {path} is {json.dumps(value)[:60]}, not a number")
    return Measured(field_unit(path.rsplit(".", 1)[-1]), f"summary.json {path}", value=number)


def measure_events(m: EventsMetric, run: RunData) -> Measured:
    times = run.store.sample_times() or [0]
    a, b = _window(m.window, times, open_ended=True)
    rows = [e for e in run.store.events(m.kind)
            if fnmatch.fnmatchcase(e["node"], m.node) and fnmatch.fnmatchcase(e["port"], m.port)
            and a <= e["ts_fabric_ns"] <= b and _matches(e, m.detail_match)]
    return Measured("events", f"{m.kind} events at {m.node}:{m.port}"
                    + (f" with {m.detail_match}" if m.detail_match else ""),
                    value=float(len(rows)))


def measure(metric: Metric, run: RunData) -> Measured:
    if metric.counter is not None:
        return measure_counter(metric.counter, run)
    if metric.result is not None:
        return measure_result(metric.result, run)
    if metric.summary is not None:
        return measure_summary(metric.summary, run)
    assert metric.events is not None
    return measure_events(metric.events, run)


# ---- thresholds and display ---------------------------------------------------------------

def parse_threshold(value: float | int | str, unit: str) -> float:
    """A predicate's value in the metric's base unit: a number as is, or a quantity."""
    if not isinstance(value, str):
        return float(value)
    try:
        if unit == "b/s":
            return float(parse_rate_bps(value))
        if unit == "B":
            return float(parse_size_bytes(value))
        if unit == "ns":
            return float(parse_duration_ns(value))
        if unit == "us":
            return parse_duration_ns(value) / 1e3
        return float(value)
    except (UnitError, ValueError):
        raise Missing(f"value {value!r} is not a quantity in {unit or 'a plain number'}") \
            from None


# Base unit -> (shown unit, divisor)
_SHOWN = {"b/s": ("Gb/s", 1e9), "ns": ("us", 1e3), "B/s": ("Gb/s", 1e9 / 8)}


def show(value: float, unit: str) -> tuple[float, str]:
    """A value in the unit the verdict shows it in, rounded to 4 significant digits."""
    shown, div = _SHOWN.get(unit, (unit, 1.0))
    v = value / div
    return (float(f"{v:.4g}") if v and math.isfinite(v) else v), shown


def describe(metric: Metric) -> str:
    if metric.counter is not None:
        m = metric.counter
        return f"{m.across} of {m.stat} of {_where(m)}"
    if metric.result is not None:
        r = metric.result
        return f"{r.agg} of {r.field} of {r.workload}"
    if metric.summary is not None:
        return f"summary {metric.summary}"
    assert metric.events is not None
    return f"{metric.events.kind} events"


def predicate_text(pred: Predicate) -> str:
    if pred.text:
        return pred.text
    what = describe(pred)
    if pred.of == "control":
        return f"{what} {pred.op} {pred.value:g} x control"
    if isinstance(pred.of, Metric):
        return f"{what} {pred.op} {pred.value:g} x {describe(pred.of)}"
    return f"{what} {pred.op} {pred.value}"


def _row(pred: Predicate, held: bool | None, detail: str, unit: str = "",
         value: float | None = None, threshold: float | None = None) -> dict:
    shown_v = show(value, unit) if value is not None else (None, show(0, unit)[1])
    shown_t = show(threshold, unit) if threshold is not None else (None, shown_v[1])
    return {"name": pred.name, "text": predicate_text(pred), "value": shown_v[0],
            "threshold": shown_t[0], "op": pred.op, "unit": shown_v[1], "held": held,
            "detail": detail}


def _pick(pred_op: str, across: str, rows: list[tuple[str, float, float, bool]]
          ) -> tuple[str, float, float, bool]:
    """The series to show for all/any: for all the first failing one (or the closest to
    failing), for any the first holding one (or the closest to holding)."""
    want = not (across == "all")
    chosen = [r for r in rows if r[3] == want]
    pool = chosen or rows
    if pred_op in ("<", "<="):
        key = (lambda r: -(r[1] - r[2])) if want else (lambda r: r[1] - r[2])
    elif pred_op in (">", ">="):
        key = (lambda r: r[1] - r[2]) if want else (lambda r: -(r[1] - r[2]))
    else:
        key = (lambda r: abs(r[1] - r[2])) if want else (lambda r: -abs(r[1] - r[2]))
    return min(pool, key=key) if chosen else max(pool, key=key)


def evaluate_predicate(pred: Predicate, run: RunData, control: RunData | None) -> dict:
    try:
        m = measure(pred, run)
    except Missing as exc:
        return _row(pred, None, f"missing data: {exc}")
    detail = m.detail
    scale = float(pred.value) if pred.of is not None else None
    base: Measured | None = None
    try:
        if pred.of == "control":
            if control is None:
                return _row(pred, None, "missing data: no control run to compare with",
                            m.unit, m.value)
            base = measure(pred, control)
            detail += "; control: " + base.detail
        elif isinstance(pred.of, Metric):
            base = measure(pred.of, run)
            if base.per_series is not None:
                raise Missing("of: needs one number; give its counter an across of sum, "
                              "max, min or count")
            if base.unit != m.unit:
                detail += f"; note: {m.unit or 'count'} against {base.unit or 'count'}"
            detail += "; of: " + base.detail
        threshold = parse_threshold(pred.value, m.unit) if base is None else None
    except Missing as exc:
        return _row(pred, None, f"missing data: {exc}", m.unit, m.value)
    if m.per_series is not None:
        return _per_series_row(pred, m, base, threshold, scale, detail)
    assert m.value is not None
    if base is not None:
        if base.value is None:
            return _row(pred, None, "missing data: the control's measure is per series but "
                                    "this one is not", m.unit, m.value)
        threshold = scale * base.value  # type: ignore[operator]
        if pred.of == "control":
            bv, bu = show(base.value, base.unit)
            detail += f" = {bv:g} {bu}".rstrip()
    assert threshold is not None
    return _row(pred, OPS[pred.op](m.value, threshold), detail, m.unit, m.value, threshold)


def _per_series_row(pred: Predicate, m: Measured, base: Measured | None,
                    threshold: float | None, scale: float | None, detail: str) -> dict:
    """across all / any: every series against its threshold (with of: control, the same
    series of the control run)."""
    assert m.per_series is not None
    rows = []
    for key, v in m.per_series.items():
        if base is None:
            thr = threshold
        elif base.per_series is not None:
            if key not in base.per_series:
                return _row(pred, None, f"missing data: {key} has no value in the control "
                                        "run", m.unit, v)
            thr = scale * base.per_series[key]  # type: ignore[operator]
        else:
            thr = scale * base.value  # type: ignore[operator]
        assert thr is not None
        rows.append((key, v, thr, OPS[pred.op](v, thr)))
    across = pred.counter.across if pred.counter else "all"
    holding = sum(r[3] for r in rows)
    held = holding == len(rows) if across == "all" else holding > 0
    key, v, thr, _ = _pick(pred.op, across, rows)
    return _row(pred, held, f"{detail}; {holding} of {len(rows)} series hold; shown: {key}",
                m.unit, v, thr)


def evaluate_signature(signature: list[Predicate], run: RunData,
                       control: RunData | None) -> list[dict]:
    return [evaluate_predicate(p, run, control) for p in signature]


def build_verdict(*, name: str, incident: Incident, variant: str, predicates: list[dict],
                  baseline_run: str | None, allowed: list[str],
                  classes: dict[str, int] | None = None) -> dict:
    """summary.json's `verdict` (the contract's section 5)."""
    missing = [p for p in predicates if p["held"] is None]
    reproduced = bool(predicates) and all(p["held"] is True for p in predicates)
    expected = variant == "incident"
    reason = None
    if missing:
        reason = ("not decided: no data for " + "; ".join(
            f"{p['name']} ({p['detail'].removeprefix('missing data: ')})" for p in missing))
    elif not reproduced:
        reason = "did not hold: " + ", ".join(p["name"] for p in predicates if not p["held"])
    ev = incident.evidence
    return {
        "incident": name, "variant": variant, "title": incident.title,
        "source": incident.source, "description": incident.description,
        "fault": incident.fault,
        "control_description": incident.control.description,
        "reproduced": reproduced, "expected": expected,
        # a control whose data is missing is not a clean control either
        "as_expected": reproduced == expected and not missing,
        "reason": reason,
        "allowed": list(allowed), "baseline_run": baseline_run,
        "predicates": predicates,
        "evidence": None if ev is None else {
            "counter": ev.counter, "node": ev.node, "port": ev.port,
            "tclass": (classes or {}).get(ev.tclass, ev.tclass) if isinstance(ev.tclass, str)
            else ev.tclass,
            "caption": ev.caption},
    }
