"""What a report says: its sections as plain data (tables of strings, SVG plots).

Both templates (HTML and Markdown) render the same context, so the two
formats cannot drift apart. A section that has nothing to show is None (or
an empty list) and the templates leave it out.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from testbed.plan.model import InterfacePlan, Plan
from testbed.report import plots
from testbed.report.plots import Annotation, FaultMark, Series, natural_key
from testbed.report.rundir import RunData, metadata_dilation, run_name_and_time
from testbed.results.tables import PHY_DROP_COUNTERS, QUEUE_DROP_COUNTERS

SERIES_PER_PLOT = 8
MAX_PLOTS = 3                 # per section; the tables below the plots list the rest
TOP_PORTS = 20
MAX_TABLE_ROWS = 200


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    numeric: list[bool] = field(default_factory=list)   # right-aligned columns
    note: str = ""

    def __post_init__(self) -> None:
        if not self.numeric:
            self.numeric = [False] * len(self.columns)


# --- formatting (fabric units throughout) -------------------------------------------------

def fmt_int(n: float) -> str:
    return f"{int(round(n)):,}"


def fmt_bytes(n: float) -> str:
    """Human size, SI like the config: 1.234 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bps: float) -> str:
    for unit, scale in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if abs(bps) >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} b/s"


def fmt_duration(ns: float) -> str:
    if ns == 0:
        return "0"
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.4g} {unit}"
    return f"{ns:.4g} ns"


def fmt_value(key: str, value: object) -> str:
    """A workload result cell; the key's unit suffix decides the format."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and math.isfinite(value):
        if key.endswith("_bps"):
            return fmt_rate(value)
        if key.endswith("_ns"):
            return fmt_duration(value)
        if isinstance(value, int) or float(value).is_integer():
            return fmt_int(value)
        return f"{value:.4g}"
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Result columns docs/run-format.md names, in its order; others follow in first-seen order
# (summary.json is written with sorted keys, so first-seen order is often alphabetical).
KNOWN_COLUMNS = ["src", "dst", "algorithm", "ranks", "bytes", "tx_packets", "tx_bytes",
                 "rx_packets", "rx_bytes", "lost", "set_fabric_bps", "tx_fabric_bps",
                 "rx_fabric_bps", "time_us", "algbw_gbps", "busbw_gbps", "wrong"]


def generic_table(rows: list[dict], skip: Iterable[str] = ()) -> Table:
    """Columns = union of the rows' keys: known ones in documented order, then the rest."""
    skip = set(skip)
    seen: list[str] = []
    for row in rows:
        seen += [k for k in row if k not in seen and k not in skip]
    columns = [k for k in KNOWN_COLUMNS if k in seen] + [k for k in seen
                                                         if k not in KNOWN_COLUMNS]
    numeric = [all(_is_number(r.get(c)) for r in rows if r.get(c) is not None) for c in columns]
    shown = rows[:MAX_TABLE_ROWS]
    note = f"first {MAX_TABLE_ROWS} of {len(rows)} rows" if len(rows) > MAX_TABLE_ROWS else ""
    return Table(columns, [[fmt_value(c, r.get(c)) for c in columns] for r in shown], numeric,
                 note)


# --- helpers over the plan ----------------------------------------------------------------

class PlanIndex:
    """Lookups the sections need; all of them tolerate a missing plan."""

    def __init__(self, plan: Plan | None) -> None:
        self.plan = plan
        self.class_names = {c.tc: c.name for c in plan.traffic_classes} if plan else {}
        self.ifaces: dict[tuple[str, str], InterfacePlan] = {}
        if plan:
            for node in plan.nodes:
                for iface in node.interfaces:
                    self.ifaces[(node.name, iface.ifname)] = iface

    def tclass(self, tc: int) -> str:
        name = self.class_names.get(tc)
        return f"TC{tc} {name}" if name else f"TC{tc}"

    def port_label(self, node: str, port: str, tc: int | None = None) -> str:
        label = f"{node}:{port}"
        return label if tc is None or tc < 0 else f"{label} {self.tclass(tc)}"

    def peer(self, node: str, port: str) -> str | None:
        iface = self.ifaces.get((node, port))
        return f"{iface.peer.node}:{iface.peer.ifname}" if iface else None

    def class_plan(self, node: str, port: str, tc: int):
        iface = self.ifaces.get((node, port))
        if iface is None:
            return None
        return next((c for c in iface.egress.classes if c.tc == tc), None)


# --- sections -----------------------------------------------------------------------------

def _created(run: RunData) -> str:
    created = run.metadata.get("created_utc")
    if not created:
        _, stamp = run_name_and_time(run.run_dir)
        if stamp:
            created = stamp
    if not created:
        return "unknown"
    try:
        when = dt.datetime.strptime(str(created), "%Y%m%dT%H%M%SZ")
        return when.strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return str(created)


def header(run: RunData) -> dict:
    s, m = run.summary, run.metadata
    probe = m.get("probe")
    if not isinstance(probe, dict):
        probe = {}
    features = probe.get("features") or {}
    missing = []
    for name in probe.get("missing") or []:
        feature = features.get(name) or {}
        missing.append({"name": name, "disables": feature.get("disables", "")})
    interrupted_detail = []
    if run.store is not None:
        for event in run.store.events("interrupted"):
            extra = {k: v for k, v in event.items()
                     if k not in ("ts_wall_ns", "node", "port", "tclass", "kind")}
            at = extra.pop("ts_fabric_ns", None)
            text = ", ".join(f"{k}={v}" for k, v in sorted(extra.items()))
            interrupted_detail.append(f"at fabric {fmt_duration(at or 0)}"
                                      + (f": {text}" if text else ""))
    d = run.dilation
    meta_d = metadata_dilation(m)
    facts = [
        ("lab", str(s.get("lab", ""))),
        ("started", _created(run)),
        ("dilation D", f"{d} (the fabric ran {d}x slower than real time; all figures are "
                       "fabric units)"),
        ("duration (fabric)", "unknown" if s.get("duration_fabric_ns") is None
         else fmt_duration(s["duration_fabric_ns"])),
        ("duration (wall)", "unknown" if s.get("duration_wall_s") is None
         else f"{float(s['duration_wall_s']):.2f} s"),
        ("kernel", f"{m.get('kernel') or probe.get('kernel') or 'unknown'} "
                   f"{m.get('machine') or probe.get('machine') or ''}".strip()),
    ]
    if m.get("hostname"):
        facts.append(("host", f"{m['hostname']} ({m.get('cpus', '?')} CPUs)"))
    if m.get("testbed_version"):
        facts.append(("testbed", str(m["testbed_version"])))
    collector = s.get("collector")
    if not isinstance(collector, dict):
        collector = {}
    if collector.get("samples"):
        period = collector.get("period_fabric_ns")
        facts.append(("samples", f"{collector['samples']}"
                      + (f", one every {fmt_duration(period)} of fabric time" if period else "")))
    notes = list(run.notes)
    if s.get("results_complete") is False:
        notes.append("agent results were not all collected: workload tables may be short")
    if meta_d is not None and meta_d != d:
        facts.append(("note", f"metadata says D={meta_d}, summary says D={d}"))
    facts.append(("run directory", str(run.run_dir)))
    return {
        "name": str(s.get("name") or run.run_dir.name),
        "lab": str(s.get("lab", "")),
        "dilation": d,
        "facts": facts,
        "interrupted": bool(s.get("interrupted")),
        "interrupted_detail": interrupted_detail,
        # a stage raised (bring-up, agents): the figures below are of a run that did not run
        "failed": str(s["failed"]) if s.get("failed") else "",
        "incomplete": run.rebuilt,
        "missing_features": missing,
        "notes": notes,
    }


def totals(run: RunData) -> Table | None:
    t = run.summary.get("totals") or {}
    if not t:
        return None
    rows = []
    labels = {"tx_bytes": "bytes sent (all egress ports)", "drops": "drops",
              "ecn_marks": "ECN marks", "trims": "packets trimmed",
              "pause_frames": "PFC pause frames sent",
              "delivered_bytes": "bytes delivered to receivers"}
    keys: list[str] = [k for k in labels if k in t] + [k for k in t if k not in labels]
    for key, value in ((k, t[k]) for k in keys):
        text = fmt_int(value) if _is_number(value) else str(value)
        if key.endswith("bytes") and _is_number(value) and value >= 1000:
            text += f" ({fmt_bytes(value)})"
        rows.append([labels.get(key, key), text])
    return Table(["total", "value"], rows, [False, True])


# --- faults and the verdict ---------------------------------------------------------------

#: The store's event kind for the fault timeline (docs/run-format.md, Events).
FAULT_EVENT = "fault"
#: Keys of a fault event the fault table shows in its own columns (or leaves out).
_FAULT_KEYS = {"ts_fabric_ns", "ts_wall_ns", "node", "port", "tclass", "kind", "event_kind",
               "target", "description", "index", "late_ns", "converge_ns", "phase"}
#: Counters whose growth is a packet the fabric lost (testbed/results/tables.py, plus the
#: kernel's own link counters, where a packet sent into a link that is down is counted).
_LOSS_COUNTERS = (*QUEUE_DROP_COUNTERS, *PHY_DROP_COUNTERS, "tx_dropped", "rx_dropped")


@dataclass
class Fault:
    """One fault of the run's timeline as the report shows it: numbered in time order."""

    number: int
    event: dict                          # the applied event, as the store returned it
    converged: dict | None = None        # its "converged" event, if routes changed later

    @property
    def ts_ns(self) -> int:
        return int(self.event.get("ts_fabric_ns") or 0)

    @property
    def kind(self) -> str:
        return str(self.event.get("event_kind") or "?")

    @property
    def target(self) -> str:
        return str(self.event.get("target") or "")

    @property
    def description(self) -> str:
        text = self.event.get("description")
        return str(text) if text else f"{self.kind} {self.target}".strip()


def fault_events(run: RunData) -> list[Fault]:
    """The run's "fault" events, the applied ones numbered 1.. in time order, each with
    the "converged" event that followed it (matched by `index`, else by kind and target)."""
    if run.store is None:
        return []
    faults: list[Fault] = []
    for e in run.store.events(FAULT_EVENT):
        if str(e.get("phase") or "applied") != "converged":
            faults.append(Fault(len(faults) + 1, e))
            continue
        match = [f for f in faults if f.converged is None and (
            f.event.get("index") == e.get("index") if e.get("index") is not None
            else (f.kind, f.target) == (e.get("event_kind"), e.get("target")))]
        if match:
            match[-1].converged = e
    return faults


def fault_marks(faults: list[Fault]) -> list[FaultMark]:
    marks = [FaultMark(f.number, f.ts_ns, f.description) for f in faults]
    marks += [FaultMark(f.number, int(f.converged.get("ts_fabric_ns") or 0), f.description,
                        converged=True) for f in faults if f.converged is not None]
    return marks


def _plan_event(run: RunData, index: object):
    """The plan's EventPlan at config position `index` (None: no plan, no such event)."""
    events = getattr(run.plan, "events", None) or []
    return next((e for e in events if getattr(e, "index", None) == index), None)


def _port_names(ports) -> str:
    return ", ".join(f"{p.node}:{p.ifname}" for p in ports)


def _planned_details(ev) -> list[str]:
    """What the plan says the event changes, in words (per kind)."""
    ports = list(getattr(ev, "ports", None) or [])
    if not ports:
        return []
    kind = getattr(ev, "kind", "")
    first = ports[0]
    if kind in ("link_down", "link_up"):
        return [f"ports {'up' if kind == 'link_up' else 'down'}: {_port_names(ports)}"]
    if kind == "loss" and first.loss_probability is not None:
        return [f"drop probability {first.loss_probability:.3g} on {_port_names(ports)}"]
    if kind == "rate" and first.egress is not None:
        return [f"rate {fmt_rate(first.egress.rate_bps)} on {_port_names(ports)}"]
    if kind == "pfc" and first.pfc_enabled is not None:
        return [f"PFC {'on' if first.pfc_enabled else 'off'} for TC{first.tc} on "
                f"{_port_names(ports)}"]
    if kind == "ecn" and first.ecn is not None:
        e = first.ecn
        return [f"ECN Kmin {fmt_bytes(e.kmin_bytes)} Kmax {fmt_bytes(e.kmax_bytes)} Pmax "
                f"{e.pmax:g} for TC{first.tc} on {_port_names(ports)}"]
    if kind == "host_drain":
        rate = ("line rate" if first.drain_rate_bps is None
                else fmt_rate(first.drain_rate_bps))
        return [f"NIC drains TC{first.tc} at {rate} on {_port_names(ports)}"
                + (f", XOFF {fmt_bytes(first.xoff_bytes)}" if first.xoff_bytes else "")]
    return []


def _losses_between(run: RunData, t0_ns: int, t1_ns: int) -> int | None:
    """Packets the fabric's counters say were dropped between two fabric times (every
    port, every class), or None when there are no such counters."""
    if run.store is None:
        return None
    names = set(run.store.counters())
    total, seen = 0.0, False
    for counter in _LOSS_COUNTERS:
        if counter not in names:
            continue
        seen = True
        for pts in run.store.aligned(counter, times=[t0_ns, t1_ns]).values():
            values = dict(pts)
            total += max(0.0, values.get(t1_ns, 0.0) - values.get(t0_ns, 0.0))
    return int(total) if seen else None


def _fault_details(run: RunData, fault: Fault, faults: list[Fault]) -> str:
    details = _planned_details(_plan_event(run, fault.event.get("index")))
    if fault.kind == "link_down":
        up = next((f for f in faults if f.number > fault.number and f.kind == "link_up"
                   and f.target == fault.target), None)
        end = up.ts_ns if up else int(run.summary.get("duration_fabric_ns") or 0)
        if up:
            details.append(f"down for {fmt_duration(up.ts_ns - fault.ts_ns)} (fault {up.number})")
        lost = _losses_between(run, fault.ts_ns, max(end, fault.ts_ns))
        if lost is not None:
            details.append(f"{fmt_int(lost)} packets dropped in the fabric while down")
    converge = fault.event.get("converge_ns")
    if _is_number(converge) and converge:
        details.append(f"routes converge after {fmt_duration(converge)}")
    for key, value in sorted(fault.event.items()):
        if key not in _FAULT_KEYS:
            details.append(f"{key} {fmt_value(key, value)}")
    return "; ".join(details) or "-"


def fault_timeline(run: RunData, faults: list[Fault]) -> dict | None:
    """The fault timeline: one row per applied fault, in time order, numbered as its
    markers on the time plots."""
    if not faults:
        return None
    rows = []
    for f in faults[:MAX_TABLE_ROWS]:
        converged = f.converged.get("ts_fabric_ns") if f.converged else None
        rows.append([str(f.number), fmt_duration(f.ts_ns), f.kind, f.target or "-",
                     f.description, _fmt_ns(f.event.get("late_ns")), _fmt_ns(converged),
                     _fault_details(run, f, faults)])
    table = Table(["#", "at (fabric)", "kind", "target", "description", "late by",
                   "routes converged at", "details"], rows,
                  [True, True, False, False, False, True, True, False])
    if len(faults) > MAX_TABLE_ROWS:
        table.note = f"first {MAX_TABLE_ROWS} of {len(faults)} faults"
    return {"table": table, "count": len(faults)}


#: What a verdict holds (docs/incidents.md); `allowed` and `baseline_run` may be absent.
VERDICT_KEYS = ("incident", "variant", "title", "source", "description", "reproduced",
                "expected", "as_expected", "predicates", "evidence")
PREDICATE_KEYS = ("name", "value", "op", "threshold", "held")


def _yes_no(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _predicate_cell(p: dict, key: str) -> str:
    value = p.get(key)
    if key == "held":
        held = _yes_no(value)
        return "-" if held is None else "held" if held else "did not hold"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return fmt_int(value)
    return "-" if value is None or value == "" else str(value)


def _fmt_ns(value: object) -> str:
    """A duration from an event's detail, '-' when it is absent or not a number."""
    return fmt_duration(value) if isinstance(value, int | float) and not isinstance(
        value, bool) else "-"


def _predicates(raw: object, missing: list[str]) -> Table | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        missing.append("predicates (not a list)")
        return None
    rows, lacking = [], []
    for i, p in enumerate(raw, 1):
        if not isinstance(p, dict):
            lacking.append(f"predicate {i} is not an object")
            continue
        gaps = [k for k in PREDICATE_KEYS if k not in p]
        if gaps:
            lacking.append(f"predicate {i} lacks {', '.join(gaps)}")
        name = str(p.get("name") or f"predicate {i}")
        text = str(p.get("text") or "")
        rows.append([name, text or "-", *(_predicate_cell(p, k) for k in
                                          ("value", "op", "threshold", "unit", "held",
                                           "detail"))])
    missing += lacking
    return Table(["predicate", "says", "measured", "op", "threshold", "unit", "held",
                  "detail"], rows, [False, False, True, False, True, False, False, False])


def verdict(run: RunData, marks: list[FaultMark] | None = None) -> dict | None:
    """The incident verdict banner (summary.json `verdict`): what was reproduced, whether
    that was expected, each predicate's measured value beside its threshold, and the
    evidence plot. A verdict missing keys shows what it has and says what is missing."""
    v = run.summary.get("verdict")
    if not v:
        return None
    if not isinstance(v, dict):
        return {"title": "incident verdict", "variant": "", "status": "verdict unreadable",
                "state": "unknown", "facts": [],
                "description": str(v), "allowed": [], "predicates": None, "evidence": None,
                "missing": ["summary.json verdict is not an object"]}
    missing = [k for k in VERDICT_KEYS if k not in v]
    reproduced, expected = _yes_no(v.get("reproduced")), _yes_no(v.get("expected"))
    variant = str(v.get("variant") or "")
    if expected is None and variant in ("incident", "control"):
        expected = variant == "incident"          # an incident should happen, a control not
    as_expected = _yes_no(v.get("as_expected"))
    if as_expected is None and reproduced is not None and expected is not None:
        as_expected = reproduced == expected
    if reproduced is None:
        status, state = "REPRODUCED? unknown", "unknown"
    else:
        status = "REPRODUCED" if reproduced else "NOT REPRODUCED"
        if as_expected is None:
            state = "unknown"
        elif as_expected:
            state = "ok"
            status += ", as expected"
        else:
            state = "fail"
            status += (": FAILURE, a control run must not reproduce the incident"
                       if variant == "control" else
                       ": FAILURE, the incident was expected to reproduce"
                       if expected else ": FAILURE, not as expected")
    facts = []
    for key, label in (("incident", "incident"), ("variant", "variant"),
                       ("source", "source"), ("baseline_run", "control run compared")):
        value = v.get(key)
        if value not in (None, ""):
            facts.append((label, str(value)))
    allowed = v.get("allowed") or []
    if not isinstance(allowed, list):
        allowed = [allowed]
    return {
        "title": str(v.get("title") or v.get("incident") or "incident verdict"),
        "status": status, "state": state, "variant": variant, "facts": facts,
        "description": str(v.get("description") or ""),
        "allowed": [f"this fabric is misconfigured on purpose: {a}" for a in allowed],
        "predicates": _predicates(v.get("predicates"), missing),
        "evidence": evidence(run, v.get("evidence"), marks or [], missing),
        "missing": missing,
    }


#: Series the evidence plot draws at most; a "*" that matches more keeps the ones that
#: moved the most.
EVIDENCE_SERIES = SERIES_PER_PLOT


def _unit_of(counter: str) -> tuple[str, float]:
    if counter.endswith("_bytes"):
        return "KB", 1e3
    if counter.endswith("_bps"):
        return "Gb/s", 1e9
    if counter.endswith("_ns"):
        return "us", 1e3
    return counter.rsplit(".", 1)[-1], 1.0


def _fmt_counter(counter: str, value: float) -> str:
    """A counter's value in the unit its name ends in (bytes, rates, durations)."""
    if counter.endswith("_bytes"):
        return fmt_bytes(value)
    return fmt_value(counter, value)


def _value_at(points: list[tuple[int, float]], ts: float) -> float:
    before = [v for t, v in points if t <= ts]
    return before[-1] if before else (points[0][1] if points else 0.0)


def evidence(run: RunData, spec: object, marks: list[FaultMark],
             missing: list[str] | None = None) -> dict | None:
    """The counter series a verdict names as its evidence, plotted over fabric time with
    the fault markers, an arrow at the first fault and one where the failure shows (the
    peak; for a counter that only grows, where it starts to grow), and a table of the
    same numbers for readers of the Markdown report."""
    missing = missing if missing is not None else []
    if spec is None:
        return None
    if not isinstance(spec, dict) or not spec.get("counter"):
        missing.append("evidence.counter")
        return None
    counter = str(spec["counter"])
    caption = str(spec.get("caption") or "")

    def pick(key: str) -> str | None:
        value = spec.get(key, "*")
        return None if value in ("*", None) else str(value)

    tc_raw = pick("tclass")
    try:
        tclass = None if tc_raw is None else int(tc_raw)
    except ValueError:
        missing.append(f"evidence.tclass {tc_raw!r} (not a class number)")
        tclass = None
    where = (f"{spec.get('node', '*')}:{spec.get('port', '*')} "
             f"class {spec.get('tclass', '*')}")
    out: dict[str, object] = {"counter": counter, "where": where, "caption": caption, "svg": None,
           "table": None, "text": ""}
    if run.store is None:
        out["text"] = f"no counters database: {counter} at {where} cannot be drawn"
        return out
    series = run.store.series(counter, pick("node"), pick("port"), tclass)
    if not series:
        out["text"] = f"no series of {counter} at {where} in the counters database"
        return out
    moved = {k: max(v for _, v in pts) - min(v for _, v in pts) for k, pts in series.items()}
    ranked = sorted(series, key=lambda k: (-moved[k], natural_key(f"{k[0]}:{k[1]}"), k[2]))
    shown = ranked[:EVIDENCE_SERIES]
    if len(ranked) > len(shown):
        out["text"] = (f"{len(shown)} of the {len(ranked)} series of {counter} at {where}: "
                       "the ones that changed the most")
    unit, divisor = _unit_of(counter)
    idx = PlanIndex(run.plan)
    top = series[shown[0]]
    annotations = []
    applied = sorted((m for m in marks if not m.converged), key=lambda m: m.ts_fabric_ns)
    if applied:
        first = applied[0]
        annotations.append(Annotation(first.ts_fabric_ns, _value_at(top, first.ts_fabric_ns),
                                      f"fault {first.number}: {first.text}"[:60]))
    monotone = all(b[1] >= a[1] for a, b in zip(top, top[1:], strict=False))
    if monotone and top[-1][1] > top[0][1]:
        t_on = next(t for t, val in top if val > top[0][1])
        annotations.append(Annotation(t_on, _value_at(top, t_on),
                                      f"{counter} starts rising at {fmt_duration(t_on)}"))
    else:
        t_peak, peak = max(top, key=lambda p: p[1])
        annotations.append(Annotation(t_peak, peak, f"peak {_fmt_counter(counter, peak)}"
                                      f" at {fmt_duration(t_peak)}"))
    x_max = _duration_ns(run, series.values())
    title = caption or f"{counter} at {where}"
    out["svg"] = plots.line_plot(
        [Series(idx.port_label(*k), series[k]) for k in shown], "evidence", title,
        f"{counter} ({unit})" if divisor != 1.0 else counter, divisor, x_max,
        ymin_zero=min(v for k in shown for _, v in series[k]) >= 0, faults=marks,
        annotations=annotations)
    at = applied[0].ts_fabric_ns if applied else None
    rows = []
    for k in shown:
        pts = series[k]
        t_peak, peak = max(pts, key=lambda p: p[1])
        rows.append([idx.port_label(*k), _fmt_counter(counter, _value_at(pts, at))
                     if at is not None else "-", _fmt_counter(counter, peak),
                     fmt_duration(t_peak), _fmt_counter(counter, pts[-1][1])])
    out["table"] = Table(["series", f"at fault {applied[0].number}" if applied else "at fault",
                          "peak", "peak at (fabric)", "last"], rows,
                         [False, True, True, True, True])
    return out


def fabric(run: RunData) -> dict | None:
    plan = run.plan
    if plan is None or not plan.nodes:
        return None
    groups: dict[tuple, list] = {}
    for link in plan.links:
        key = (link.rate_bps, link.wall_rate_bps, link.port_type, link.length_m, link.delay_ns,
               link.frame_loss_ratio)
        groups.setdefault(key, []).append(link)
    rows = []
    for (rate, wall, ptype, length, delay, flr), links in sorted(groups.items()):
        warnings = sorted({w for link in links for w in link.phy_warnings})
        rows.append([fmt_rate(rate), str(len(links)), ptype, f"{length:g} m", fmt_duration(delay),
                     f"{flr:.2g}", fmt_rate(wall), "; ".join(warnings) or "-"])
    table = Table(["rate (fabric)", "links", "port type", "length", "one-way delay",
                   "frame loss", "wall rate on this VM", "PHY warnings"], rows,
                  [False, True, False, True, True, True, False, False])
    d = plan.dilation
    text = (f"{len(plan.hosts())} hosts, {len(plan.switches())} switches, {len(plan.links)} "
            f"links; MTU {plan.mtu_bytes}, RoCE MTU {plan.roce_mtu_bytes}; dilation "
            f"{d.factor} ({d.mode}), busiest port {fmt_rate(d.busiest_port_bps)} fabric = "
            f"{fmt_rate(d.busiest_wall_port_bps)} wall. How D was chosen: {d.why()}")
    return {"svg": plots.fabric_plot(plan), "text": text, "links": table,
            "parts": parts(run)}


def parts(run: RunData) -> Table | None:
    """A run over several VMs (testbed merge): which VM ran which nodes, its clock offset
    to the reference VM and how far its samples were moved; a VM that left nothing."""
    rows_in = run.summary.get("parts")
    if not isinstance(rows_in, list) or not rows_in:
        return None
    rows = []
    for p in rows_in:
        if not isinstance(p, dict):
            continue
        clock = p.get("clock") if isinstance(p.get("clock"), dict) else None
        offset = (f"{clock.get('offset_ns', 0) / 1e3:+.1f} us +- "
                  f"{clock.get('uncertainty_ns', 0) / 1e3:.1f} us against "
                  f"{clock.get('reference', '?')}" if clock else "reference (or unmeasured)")
        state = ("failed: " + str(p["failed"]) if p.get("failed") else
                 "interrupted" if p.get("interrupted") else "finished")
        rows.append([str(p.get("vm", "?")), " ".join(map(str, p.get("nodes") or [])), offset,
                     fmt_duration(float(p.get("shift_fabric_ns") or 0)), state])
    rows += [[str(vm), "-", "-", "-", "left no part run directory"]
             for vm in run.summary.get("missing_vms") or []]
    return Table(["VM", "nodes", "clock offset (wall)", "samples moved (fabric)", "part run"],
                 rows, [False, False, False, True, False])


def _duration_ns(run: RunData, series: Iterable[list[tuple[int, float]]] = ()) -> float:
    longest = max((pts[-1][0] for pts in series if pts), default=0)
    return max(float(run.summary.get("duration_fabric_ns") or 0), float(longest), 1.0)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _span(n: int, chunk: list) -> str:
    return f"{n * SERIES_PER_PLOT + 1}-{n * SERIES_PER_PLOT + len(chunk)}"


def _thresholds(c) -> tuple[tuple[int, str], ...] | None:
    """(bytes, name) of the ECN, PFC and buffer thresholds of a class plan."""
    if c is None:
        return None
    marks = []
    if c.ecn:
        marks += [(c.ecn.kmin_bytes, "ECN Kmin"), (c.ecn.kmax_bytes, "ECN Kmax")]
    if c.pfc:
        marks.append((c.pfc.xoff_bytes, "PFC XOFF"))
    marks.append((c.limit_bytes, "buffer limit"))
    return tuple(marks)


def queues(run: RunData, idx: PlanIndex, faults: list[FaultMark] | None = None
           ) -> dict | None:
    """Backlog over time of every port class that queued, worst first."""
    series, per_sample = {}, {}
    if run.store is not None:
        series = {k: v for k, v in run.store.series("backlog_bytes").items()
                  if k[2] >= 0 and any(val > 0 for _, val in v)}
        if series:
            per_sample = run.store.aligned("backlog_bytes")     # for means over samples
    ports = [p for p in run.summary.get("ports") or [] if (p.get("max_queue_bytes") or 0) > 0]
    if not series and not ports:
        return None
    x_max = _duration_ns(run, series.values())
    ranked = sorted(series, key=lambda k: (-max(v for _, v in series[k]), k))
    svgs = []
    for n, chunk in enumerate(_chunks(ranked, SERIES_PER_PLOT)[:MAX_PLOTS]):
        peak = max(max(v for _, v in series[k]) for k in chunk)
        hlines = []
        thresholds = {_thresholds(idx.class_plan(*k)) for k in chunk}
        shared = thresholds.pop() if len(thresholds) == 1 else None    # lines only if alike
        if shared is not None:
            seen = set()
            for value, name in shared:
                if value <= 1.3 * peak and value not in seen:
                    seen.add(value)
                    hlines.append((value, f"{name} {fmt_bytes(value)}"))
        title = ("queue depth, worst port classes" if n == 0
                 else f"queue depth, port classes {_span(n, chunk)} by peak")
        svgs.append(plots.line_plot(
            [Series(idx.port_label(*k), series[k]) for k in chunk], f"queue{n}", title,
            "backlog (KB)", 1e3, x_max, hlines, faults=faults or ()))
    rows = []
    if series:
        for k in ranked[:TOP_PORTS]:
            pts = series[k]
            t_peak, peak = max(pts, key=lambda p: p[1])
            sampled = per_sample.get(k) or pts
            mean = sum(v for _, v in sampled) / len(sampled)
            c = idx.class_plan(*k)
            rows.append([idx.port_label(k[0], k[1]), idx.tclass(k[2]), fmt_bytes(peak),
                         fmt_duration(t_peak), fmt_bytes(mean),
                         fmt_bytes(c.limit_bytes) if c else "-"])
        table = Table(["port", "class", "peak backlog", "at (fabric)", "mean backlog", "buffer"],
                      rows, [False, False, True, True, True, True])
        total = len(ranked)
    else:
        ports.sort(key=lambda p: -p["max_queue_bytes"])
        for p in ports[:TOP_PORTS]:
            c = idx.class_plan(p["node"], p["port"], p["tclass"])
            rows.append([idx.port_label(p["node"], p["port"]), idx.tclass(p["tclass"]),
                         fmt_bytes(p["max_queue_bytes"]), fmt_bytes(c.limit_bytes) if c else "-"])
        table = Table(["port", "class", "peak backlog", "buffer"], rows,
                      [False, False, True, True])
        total = len(ports)
    if total > len(rows):
        table.note = f"{len(rows)} of {total} port classes that queued"
    return {"svgs": svgs, "table": table, "count": total,
            "shown_in_plots": min(total, SERIES_PER_PLOT * MAX_PLOTS) if svgs else 0}


def _cumulative_plots(run: RunData, idx: PlanIndex, counter: str, plot_id: str, title: str,
                      ylabel: str, faults: list[FaultMark] | None
                      ) -> tuple[list[str], list[dict]] | None:
    """Plots of a cumulative per-port-class counter (the busiest classes first, in
    chunks), and the summary's port rows where it is above 0; None when it never is."""
    series = {}
    if run.store is not None:
        series = {k: v for k, v in run.store.series(counter).items() if v and v[-1][1] > 0}
    ports = [p for p in run.summary.get("ports") or [] if (p.get(counter) or 0) > 0]
    if not series and not ports:
        return None
    ranked = sorted(series, key=lambda k: (-series[k][-1][1], k))
    svgs = []
    if ranked:
        x_max = _duration_ns(run, series.values())
        for n, chunk in enumerate(_chunks(ranked, SERIES_PER_PLOT)[:MAX_PLOTS]):
            svgs.append(plots.line_plot(
                [Series(idx.port_label(*k), series[k]) for k in chunk], f"{plot_id}{n}",
                title if n == 0 else f"{title}, port classes {_span(n, chunk)}",
                ylabel, 1.0, x_max, faults=faults or ()))
    return svgs, ports


def ecn(run: RunData, idx: PlanIndex, faults: list[FaultMark] | None = None) -> dict | None:
    found = _cumulative_plots(run, idx, "ecn_marks", "ecn", "ECN marks (cumulative)",
                              "packets marked CE", faults)
    if found is None:
        return None
    svgs, ports = found
    ports.sort(key=lambda p: (-p["ecn_marks"], p["node"], p["port"]))
    rows = [[idx.port_label(p["node"], p["port"]), idx.tclass(p["tclass"]),
             fmt_int(p["ecn_marks"]), fmt_int(p.get("tx_packets") or 0),
             f"{100 * p['ecn_marks'] / p['tx_packets']:.2f} %" if p.get("tx_packets") else "-"]
            for p in ports[:TOP_PORTS]]
    table = Table(["port", "class", "ECN marks", "packets sent", "marked"], rows,
                  [False, False, True, True, True])
    if len(ports) > TOP_PORTS:
        table.note = f"{TOP_PORTS} of {len(ports)} port classes that marked"
    return {"svgs": svgs, "table": table if rows else None}


def trims(run: RunData, idx: PlanIndex, faults: list[FaultMark] | None = None) -> dict | None:
    """UET packets trimmed at switch ports (cut and sent on in the trim class instead of
    dropped), over time per port class and in total; None when nothing was trimmed. The
    note says whether PFC was needed: trimming runs on lossy classes."""
    found = _cumulative_plots(run, idx, "trims", "trims", "Trimmed packets (cumulative)",
                              "packets trimmed", faults)
    if found is None:
        return None
    svgs, ports = found
    ports.sort(key=lambda p: (-p["trims"], p["node"], p["port"]))
    rows = [[idx.port_label(p["node"], p["port"]), idx.tclass(p["tclass"]),
             fmt_int(p["trims"]), fmt_int(p.get("tx_packets") or 0), fmt_int(p.get("drops") or 0)]
            for p in ports[:TOP_PORTS]]
    table = Table(["port", "class", "trimmed", "packets sent whole", "drops"], rows,
                  [False, False, True, True, True])
    if len(ports) > TOP_PORTS:
        table.note = f"{TOP_PORTS} of {len(ports)} port classes that trimmed"
    all_ports = [p for p in run.summary.get("ports") or [] if isinstance(p, dict)]
    pauses = sum(int(p.get("pause_tx") or 0) for p in all_ports)
    total = sum(int(p.get("trims") or 0) for p in all_ports)
    note = (f"{fmt_int(total)} packets trimmed instead of dropped; "
            + ("no PFC pause frame was sent anywhere: the trimming classes needed no PFC"
               if pauses == 0 else f"{fmt_int(pauses)} PFC pause frames were sent"))
    return {"svgs": svgs, "table": table if rows else None, "note": note}


def _pause_intervals_from_events(run: RunData) -> dict[tuple, list[tuple[int, int]]]:
    """(node, port, tclass) -> [(start_ns, duration_ns)] from pfc_xoff/pfc_xon events.

    Read as: `node` sent XOFF (then XON) out of `port` for priority `tclass`,
    pausing the egress of the peer at the other end of that link.
    """
    if run.store is None:
        return {}
    events = run.store.events("pfc_xoff") + run.store.events("pfc_xon")
    events.sort(key=lambda e: (e["ts_fabric_ns"], e["kind"] == "pfc_xoff"))
    end = run.summary.get("duration_fabric_ns") or 0
    if events:
        end = max(end, events[-1]["ts_fabric_ns"])
    open_at: dict[tuple, int] = {}
    out: dict[tuple, list[tuple[int, int]]] = {}
    for e in events:
        key = (e["node"], e["port"], e["tclass"])
        if e["kind"] == "pfc_xoff":
            out.setdefault(key, [])
            if key not in open_at:
                open_at[key] = e["ts_fabric_ns"]
        elif key in open_at:
            start = open_at.pop(key)
            out[key].append((start, e["ts_fabric_ns"] - start))
    for key, start in open_at.items():
        out[key].append((start, max(end - start, 0)))
    return out


def _pause_intervals_from_counters(run: RunData) -> dict[tuple, list[tuple[int, int]]]:
    """Sample intervals in which a port's `pause_tx` count grew (merged when adjacent)."""
    if run.store is None:
        return {}
    out: dict[tuple, list[tuple[int, int]]] = {}
    for key, pts in run.store.aligned("pause_tx").items():
        spans: list[list[int]] = []
        for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False):
            if v1 > v0:
                if spans and spans[-1][1] == t0:
                    spans[-1][1] = t1
                else:
                    spans.append([t0, t1])
        if spans:
            out[key] = [(a, b - a) for a, b in spans]
    return out


def pfc(run: RunData, idx: PlanIndex, faults: list[FaultMark] | None = None) -> dict | None:
    intervals = _pause_intervals_from_events(run)
    source = "pfc_xoff / pfc_xon events"
    if not intervals:
        intervals = _pause_intervals_from_counters(run)
        source = ("sampled pause_tx counters (a bar spans each sample period in which pause "
                  "frames were sent)")
    ports = [p for p in run.summary.get("ports") or []
             if (p.get("pause_tx") or 0) > 0 or (p.get("pause_rx") or 0) > 0
             or (p.get("paused_ns") or 0) > 0]
    if not intervals and not ports:
        return None
    svg = None
    rows_out = []
    if intervals:
        ranked = sorted(intervals, key=lambda k: (-sum(d for _, d in intervals[k]), k))
        x_max = _duration_ns(run)
        for _, spans in intervals.items():
            for s, d in spans:
                x_max = max(x_max, s + d)
        rows = []
        # Timeline rows in order of the first pause, so the spread reads top to bottom.
        for k in sorted(ranked[:24], key=lambda k: (min(s for s, _ in intervals[k]), k)):
            peer = idx.peer(k[0], k[1])
            label = f"{k[0]}:{k[1]} → {peer or '?'} {idx.tclass(k[2])}"
            rows.append((label, intervals[k]))
        svg = plots.timeline_plot(rows, "pfc", "PFC pauses: port that sent XOFF → paused peer",
                                  x_max, faults=faults or ())
        for k in ranked[:TOP_PORTS * 2]:
            spans = intervals[k]
            rows_out.append([idx.port_label(k[0], k[1]), idx.peer(k[0], k[1]) or "?",
                             idx.tclass(k[2]), fmt_int(len(spans)),
                             fmt_duration(sum(d for _, d in spans)),
                             fmt_duration(spans[0][0]) if spans else "-"])
        timeline = Table(["pausing port", "paused peer", "class", "pauses", "paused for",
                          "first at"], rows_out, [False, False, False, True, True, True])
    else:
        timeline = None
        source = ""
    ports.sort(key=lambda p: (-(p.get("pause_tx") or 0), p["node"], p["port"], p["tclass"]))
    totals_table = Table(
        ["port", "peer", "class", "pause frames sent", "pause frames received",
         "egress paused for"],
        [[idx.port_label(p["node"], p["port"]), idx.peer(p["node"], p["port"]) or "?",
          idx.tclass(p["tclass"]), fmt_int(p.get("pause_tx") or 0),
          fmt_int(p.get("pause_rx") or 0), fmt_duration(p.get("paused_ns") or 0)]
         for p in ports[:TOP_PORTS * 2]],
        [False, False, False, True, True, True]) if ports else None
    return {"svg": svg, "source": source, "timeline": timeline, "totals": totals_table,
            "loop": pfc_loop_line(run.summary.get("pfc_reaction"))}


def pfc_loop_line(r: dict | None) -> str | None:
    """One sentence on how fast the emulated PFC loop answered (summary `pfc_reaction`)."""
    if not r:
        return None
    over = r["p99_wall_ns"] > r.get("assumed_wall_ns", r["p99_wall_ns"])
    return (f"The emulated PFC loop (the crossing packet to the upstream gate closed) paused "
            f"{fmt_int(r['pauses'])} times: median {fmt_duration(r['median_fabric_ns'])}, "
            f"p99 {fmt_duration(r['p99_fabric_ns'])} of fabric time "
            f"({r['median_wall_ns'] / 1e6:.2f} / {r['p99_wall_ns'] / 1e6:.2f} ms of wall time; "
            f"the plan sized lossless headroom for {r.get('assumed_wall_ns', 0) / 1e6:.2f} ms"
            f"{', which the p99 exceeded' if over else ''}). Real switches answer in about "
            "a microsecond.")


def agent_rates(run: RunData, faults: list[FaultMark] | None = None) -> dict | None:
    """Receive rate of every agent over time, from its cumulative `recv.bytes`.

    Byte counts are the same in fabric and wall time and the samples carry
    fabric timestamps, so delta_bytes * 8 / delta_ts_fabric_ns * 1e9 is the
    fabric rate directly (= wall rate x D); nothing here multiplies by D.
    """
    if run.store is None:
        return None
    # The count at every sample: a rate is the change from one sample to the next.
    series = {k: v for k, v in run.store.aligned("recv.bytes").items() if len(v) >= 2}
    rates: dict[tuple, list[tuple[int, float]]] = {}
    for key, pts in series.items():
        step = max(1, math.ceil(len(pts) / plots.MAX_POINTS))
        picked = list(pts[::step])
        if picked[-1] != pts[-1]:
            picked.append(pts[-1])
        out = []
        for (t0, v0), (t1, v1) in zip(picked, picked[1:], strict=False):
            if t1 > t0:
                out.append((t0, max(v1 - v0, 0) * 8 / (t1 - t0) * 1e9))
        if out:
            out.append((picked[-1][0], out[-1][1]))
            rates[key] = out
    active = {k: v for k, v in rates.items() if any(r > 0 for _, r in v)}
    if not active:
        return None
    ordered = sorted(active, key=lambda k: (natural_key(k[1]), natural_key(k[0])))
    x_max = _duration_ns(run, series.values())
    svgs = []
    for n, chunk in enumerate(_chunks(ordered, SERIES_PER_PLOT)[:MAX_PLOTS]):
        svgs.append(plots.line_plot(
            [Series(f"{k[1]} ({k[0]})", active[k]) for k in chunk], f"rate{n}",
            "receive rate per agent" if n == 0 else f"receive rate, agents {_span(n, chunk)}",
            "fabric rate (Gb/s)", 1e9, x_max, faults=faults or ()))
    rows = []
    for k in ordered:
        pts = series[k]
        # Mean over the span in which bytes arrived: from the last sample before the
        # first arrival to the first sample that holds the final count.
        first, last = pts[0][1], pts[-1][1]
        i0 = next((i for i in range(len(pts) - 1) if pts[i + 1][1] != first), 0)
        i1 = next(i for i, (_, v) in enumerate(pts) if v == last)
        (t0, v0), (t1, v1) = pts[i0], pts[i1]
        mean = (v1 - v0) * 8 / (t1 - t0) * 1e9 if t1 > t0 else 0.0
        rows.append([k[1], k[0], fmt_int(last), fmt_rate(mean),
                     fmt_rate(max(r for _, r in active[k]))])
    table = Table(["agent", "node", "bytes received", "mean rate while receiving",
                   "peak rate"], rows, [False, False, True, True, True])
    return {"svgs": svgs, "table": table}


QP_RATE = re.compile(r"^send\.qp(\d+)\.rc_bps$")


def dcqcn_rates(run: RunData, faults: list[FaultMark] | None = None) -> dict | None:
    """DCQCN's current rate Rc of every QP over time (RoCE clients' `send.qp<i>.rc_bps`)."""
    if run.store is None:
        return None
    series: dict[tuple, list[tuple[int, float]]] = {}
    for counter in run.store.counters():
        m = QP_RATE.match(counter)
        if not m:
            continue
        for (node, agent, _tc), pts in run.store.series(counter).items():
            if len(pts) >= 2:
                series[(agent, node, int(m.group(1)))] = pts
    if not series:
        return None
    ordered = sorted(series, key=lambda k: (natural_key(k[0]), k[2]))
    x_max = _duration_ns(run, series.values())
    svgs = []
    for n, chunk in enumerate(_chunks(ordered, SERIES_PER_PLOT)[:MAX_PLOTS]):
        svgs.append(plots.line_plot(
            [Series(f"{k[0]} QP{k[2]}", series[k]) for k in chunk], f"dcqcn{n}",
            "DCQCN rate Rc per QP" if n == 0 else f"DCQCN rate Rc, QPs {_span(n, chunk)}",
            "fabric rate (Gb/s)", 1e9, x_max, faults=faults or ()))
    cnps = {}
    for counter in run.store.counters():
        m = re.match(r"^send\.qp(\d+)\.cnps$", counter)
        if m:
            for (node, agent, _tc), value in run.store.last_values(counter).items():
                cnps[(agent, node, int(m.group(1)))] = value
    rows = [[k[0], k[1], str(k[2]), fmt_rate(min(v for _, v in series[k])),
             fmt_rate(series[k][-1][1]), fmt_int(cnps.get(k, 0))] for k in ordered]
    table = Table(["agent", "node", "QP", "lowest Rc", "final Rc", "CNPs received"], rows,
                  [False, False, True, True, True, True])
    return {"svgs": svgs, "table": table}


# --- collectives --------------------------------------------------------------------------

#: The collective ranks' phase events and the counter prefixes of ranks and aggregators
#: (their snapshots' modes; docs/run-format.md).
PHASE_EVENT = "collective_phase"
RANK_PREFIX = "collective."
AGGREGATOR_SLOTS = "aggregator.slots_in_use"
#: Phases in the order the algorithms run them, so a phase keeps its colour across runs.
PHASE_ORDER = ("pre_reduce", "reduce_scatter", "all_gather", "post_distribute", "tree_up",
               "tree_down", "broadcast", "all_to_all", "in_network")
#: Bars one timeline draws at most; beyond it, the last size's timed iterations only.
MAX_TIMELINE_BARS = 1200
MAX_TIMELINE_ROWS = 32


def _phase_names(names: Iterable[str]) -> list[str]:
    seen = set(names)
    return [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))


def _last_sizes_timed(by_rank: dict[tuple[str, str], list[dict]]
                      ) -> dict[tuple[str, str], list[dict]]:
    """Each rank's timed (not warm-up) phases of the last size it ran."""
    out = {}
    for key, evs in by_rank.items():
        last = evs[-1]["bytes"]
        out[key] = [e for e in evs if e["bytes"] == last and not e.get("warmup")]
    return out


def _phase_timeline(run: RunData, events: list[dict], faults: list[FaultMark]
                    ) -> dict | None:
    """One row per rank, a bar per phase of each iteration, coloured by phase."""
    by_rank: dict[tuple[str, str], list[dict]] = {}
    for e in sorted(events, key=lambda e: e["ts_fabric_ns"]):
        if isinstance(e.get("duration_ns"), int | float) and e.get("phase"):
            by_rank.setdefault((e["node"], e["port"]), []).append(e)
    if not by_rank:
        return None
    total = sum(len(v) for v in by_rank.values())
    ranks = sorted(by_rank, key=lambda k: (natural_key(k[1]), natural_key(k[0])))
    shown_ranks = ranks[:MAX_TIMELINE_ROWS]
    chosen = {k: by_rank[k] for k in shown_ranks}
    what = "every phase of every iteration, warm-ups included"
    if sum(len(v) for v in chosen.values()) > MAX_TIMELINE_BARS:
        chosen = _last_sizes_timed(chosen)
        sizes = sorted({int(v[0]["bytes"]) for v in chosen.values() if v})
        what = ("the timed iterations of each rank's last size ("
                + ", ".join(fmt_bytes(b) for b in sizes) + ")")
        per_rank = max(1, MAX_TIMELINE_BARS // len(chosen))
        if any(len(v) > per_rank for v in chosen.values()):
            chosen = {k: v[-per_rank:] for k, v in chosen.items()}
            what += f", the last {per_rank} phases of each rank"
    shown = sum(len(v) for v in chosen.values())
    if not shown:
        return None
    rows = []
    for key in shown_ranks:
        evs = chosen[key]
        rank = next((e.get("rank") for e in evs), None)
        label = f"{key[1]} ({key[0]})" if rank is None else f"{key[1]} rank {rank} ({key[0]})"
        rows.append((label, [(int(e["ts_fabric_ns"]), int(e["duration_ns"]), str(e["phase"]))
                             for e in evs]))
    x_min = min(b[0] for _, bars in rows for b in bars)
    x_max = max(b[0] + b[1] for _, bars in rows for b in bars)
    phases = _phase_names(b[2] for _, bars in rows for b in bars)
    svg = plots.timeline_plot(rows, "phases", "collective phases per rank", x_max,
                              x_min_ns=x_min, categories=phases, faults=faults)
    caption = (f"{shown} of {total} phase bars: {what}." if shown < total
               else f"{total} phase bars: {what}.")
    if len(ranks) > len(shown_ranks):
        caption += f" The first {len(shown_ranks)} of {len(ranks)} ranks."
    dropped = sum(run.store.last_values(RANK_PREFIX + "events_dropped").values()) \
        if run.store is not None else 0
    if dropped:
        caption += (f" {fmt_int(dropped)} phase events were not written (each rank writes "
                    "at most its cap): the timeline stops early.")
    return {"svg": svg, "caption": caption}


def _slot_occupancy(run: RunData, faults: list[FaultMark]) -> dict | None:
    """Slots in use per aggregator over time, the configured pool as a dashed line."""
    assert run.store is not None
    series = run.store.series(AGGREGATOR_SLOTS)
    if not series:
        return None
    pools = run.store.last_values("aggregator.slots")
    ordered = sorted(series, key=lambda k: (natural_key(k[1]), natural_key(k[0])))
    x_max = _duration_ns(run, series.values())
    svgs = []
    for n, chunk in enumerate(_chunks(ordered, SERIES_PER_PLOT)[:MAX_PLOTS]):
        sizes = sorted({int(pools[k]) for k in chunk if k in pools})
        hlines = [(float(v), f"pool {v} slots") for v in sizes]
        svgs.append(plots.line_plot(
            [Series(f"{k[1]} ({k[0]})", series[k]) for k in chunk], f"slots{n}",
            "aggregator slot occupancy" if n == 0
            else f"aggregator slot occupancy, aggregators {_span(n, chunk)}",
            "slots in use", 1.0, x_max, hlines, faults=faults))
    # The samples can miss a peak between them; the aggregator counts its own exactly
    # (per job: with several jobs, the sum of their peaks bounds the total's).
    exact = run.store.last_values("aggregator.slots_in_use_max")
    peaks = [[k[1], k[0], fmt_int(max(v for _, v in series[k])),
              fmt_int(exact[k]) if k in exact else "-",
              fmt_int(pools[k]) if k in pools else "-"] for k in ordered]
    return {"svgs": svgs, "table": Table(
        ["aggregator", "node", "peak slots in use (sampled)", "peak (its own count)",
         "pool (slots)"], peaks, [False, False, True, True, True])}


def _rank_table(run: RunData, events: list[dict]) -> Table | None:
    """Per rank: bytes, retransmissions and fabric time in each phase (every iteration,
    warm-ups included), from the ranks' last sampled counters."""
    assert run.store is not None
    last: dict[str, dict[tuple[str, str], float]] = {}
    wanted = {"rank", "bytes_sent", "bytes_received", "retransmissions", "ina_bytes_sent",
              "ina_retransmissions"}
    for counter in run.store.counters():
        name = counter[len(RANK_PREFIX):]
        if counter.startswith(RANK_PREFIX) and (
                name in wanted or (name.startswith("phase_") and name.endswith("_ns"))):
            last[name] = {
                (k[0], k[1]): v for k, v in run.store.last_values(counter).items()}
    from_events: dict[tuple[str, str], dict[str, float]] = {}
    for e in events:
        if isinstance(e.get("duration_ns"), int | float) and e.get("phase"):
            per = from_events.setdefault((e["node"], e["port"]), {})
            per[str(e["phase"])] = per.get(str(e["phase"]), 0.0) + e["duration_ns"]
    keys = set(from_events)
    for values in last.values():
        keys |= set(values)
    if not keys:
        return None
    phase_counters = {k[len("phase_"):-len("_ns")]: k for k in last
                      if k.startswith("phase_") and k.endswith("_ns")}
    phases = _phase_names([*phase_counters, *(p for v in from_events.values() for p in v)])
    columns = [("bytes_sent", "bytes sent"), ("bytes_received", "bytes received"),
               ("retransmissions", "retransmissions")]
    columns += [(k, label) for k, label in (("ina_bytes_sent", "INA bytes sent"),
                                            ("ina_retransmissions", "INA retransmissions"))
                if k in last]
    rows = []
    for key in sorted(keys, key=lambda k: (natural_key(k[1]), natural_key(k[0]))):
        rank = last.get("rank", {}).get(key)
        cells = [key[1], key[0], "-" if rank is None else fmt_int(rank)]
        for counter, _ in columns:
            value = last.get(counter, {}).get(key)
            cells.append("-" if value is None else fmt_int(value))
        for phase in phases:
            value = last.get(phase_counters.get(phase, ""), {}).get(key)
            if value is None:
                value = from_events.get(key, {}).get(phase)
            cells.append("-" if value is None else fmt_duration(value))
        rows.append(cells)
    head = ["rank agent", "node", "rank", *(label for _, label in columns),
            *(f"{p} time" for p in phases)]
    return Table(head, rows, [False, False, True] + [True] * (len(head) - 3))


def collectives(run: RunData, faults: list[FaultMark] | None = None) -> dict | None:
    """The collective ranks' phases over time and the aggregators' slot occupancy; None
    when the run had neither (or no counters database)."""
    if run.store is None:
        return None
    events = run.store.events(PHASE_EVENT)
    timeline = _phase_timeline(run, events, faults or [])
    occupancy = _slot_occupancy(run, faults or [])
    table = _rank_table(run, events)
    if timeline is None and occupancy is None and table is None:
        return None
    return {"timeline": timeline, "occupancy": occupancy, "ranks": table}


def workloads(run: RunData) -> list[dict]:
    out = []
    for w in run.summary.get("workloads") or []:
        results = [r for r in w.get("results") or [] if isinstance(r, dict)]
        if not results:
            continue
        out.append({"name": str(w.get("name", "")), "kind": str(w.get("kind", "")),
                    "table": generic_table(results)})
    return out


def port_totals(run: RunData, idx: PlanIndex) -> dict | None:
    ports = [p for p in run.summary.get("ports") or [] if isinstance(p, dict)]
    if not ports:
        return None
    busy = sorted((p for p in ports if (p.get("tx_bytes") or 0) > 0),
                  key=lambda p: (-p["tx_bytes"], p["node"], p["port"], p["tclass"]))
    chosen = busy[:TOP_PORTS]
    chosen += [p for p in ports if (p.get("drops") or 0) > 0 and p not in chosen]
    if not chosen:
        return {"table": None, "text": f"no egress port sent anything ({len(ports)} port classes)"}
    optional = [("ecn_marks", "ECN marks", fmt_int), ("trims", "trims", fmt_int),
                ("pause_tx", "PFC tx", fmt_int),
                ("pause_rx", "PFC rx", fmt_int), ("paused_ns", "paused for", fmt_duration)]
    present = [o for o in optional if any((p.get(o[0]) or 0) > 0 for p in ports)]
    columns = ["port", "class", "bytes sent", "packets sent", "drops",
               *[o[1] for o in present], "peak queue"]
    rows = []
    for p in chosen:
        rows.append([idx.port_label(p["node"], p["port"]), idx.tclass(p["tclass"]),
                     fmt_int(p.get("tx_bytes") or 0), fmt_int(p.get("tx_packets") or 0),
                     fmt_int(p.get("drops") or 0),
                     *[fmt(p.get(key) or 0) for key, _, fmt in present],
                     fmt_bytes(p.get("max_queue_bytes") or 0)])
    numeric = [False, False] + [True] * (len(columns) - 2)
    absent = [o[1] for o in optional if o not in present]
    text = (f"{len(chosen)} of {len(ports)} egress port classes: the {min(TOP_PORTS, len(busy))} "
            f"that sent the most bytes, plus every one that dropped.")
    if absent:
        text += " All zero, not shown: " + ", ".join(absent) + "."
    return {"table": Table(columns, rows, numeric), "text": text}


def invariants(run: RunData) -> Table | None:
    """The run's invariant checks (testbed/run/invariants.py), one row each: held or not,
    what was measured, how many places broke it."""
    inv = run.summary.get("invariants")
    if not inv:
        return None
    checks = inv.get("checks") or {}
    violations = inv.get("violations") or []
    rows = []
    for name, check in sorted(checks.items(), key=lambda kv: kv[1].get("label", kv[0])):
        held = check.get("held")
        mine = [v for v in violations if v.get("invariant") == name]
        measured = ""
        if name == "queue" and check.get("samples"):
            measured = (f"largest |vq - backlog| {fmt_bytes(check.get('max_abs_diff_bytes') or 0)}"
                        f" at {check.get('max_abs_diff_at') or '-'} over {check['samples']} "
                        f"samples (tolerance {fmt_bytes(check.get('tolerance_bytes') or 0)})")
        elif name == "conservation":
            streams = inv.get("streams") or []
            lost = sum(s.get("sent", 0) - s.get("received", 0) for s in streams)
            counted = sum(s.get("fabric_drops", 0) for s in streams)
            measured = (f"{len(streams)} streams: {fmt_int(lost)} packets not received, "
                        f"{fmt_int(counted)} of them dropped by the fabric")
            sockets = sum((inv.get("host_socket_drops") or {}).values())
            if sockets:
                measured += f", {fmt_int(sockets)} by the receivers' sockets"
        elif name == "lossless_drop" and check.get("unprotected_drops"):
            unprotected = check["unprotected_drops"]
            measured = (f"{fmt_int(sum(unprotected.values()))} drops in lossless classes with "
                        f"PFC off ({', '.join(sorted(unprotected)[:3])}): not charged")
        if mine:
            worst = max(mine, key=lambda v: v.get("amount") or 0)
            measured = (measured + "; " if measured else "") + (
                f"worst: {worst.get('where')}: {worst.get('detail')}")
        rows.append([check.get("label", name),
                     "n/a" if held is None else ("held" if held else "VIOLATED"),
                     str(len(mine)), measured])
    return Table(["invariant", "verdict", "places", "measured"], rows,
                 [False, False, True, False])


def fidelity(run: RunData) -> dict:
    notes = [str(n) for n in run.summary.get("fidelity") or []]
    # What the reader found missing, damaged or inconsistent limits what the report can
    # say, so it is a fidelity note too (docs/report.md, "Damaged run directories").
    notes += [f"run directory: {n}" for n in run.notes]
    warnings = list(run.plan.warnings) if run.plan else []
    return {"notes": notes, "plan_warnings": warnings, "invariants": invariants(run)}


def build_context(run: RunData) -> dict:
    from testbed.report.fct import fct_section  # it builds on this module's tables

    idx = PlanIndex(run.plan)
    faults = fault_events(run)
    marks = fault_marks(faults)
    return {
        "run": header(run),
        "totals": totals(run),
        "verdict": verdict(run, marks),
        "faults": fault_timeline(run, faults),
        "fabric": fabric(run),
        "fct": fct_section(run),
        "queues": queues(run, idx, marks),
        "ecn": ecn(run, idx, marks),
        "trims": trims(run, idx, marks),
        "pfc": pfc(run, idx, marks),
        "rates": agent_rates(run, marks),
        "dcqcn": dcqcn_rates(run, marks),
        "collectives": collectives(run, marks),
        "workloads": workloads(run),
        "ports": port_totals(run, idx),
        "fidelity": fidelity(run),
    }
