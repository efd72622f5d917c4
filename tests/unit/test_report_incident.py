"""Incident reports (issue 12), from hand-made run directories (no root): the fault
timeline's events drawn on every time plot and listed in a table, and the verdict
banner with its predicates and the evidence plot at the top of both reports.

The run directories are the synthetic incast run of test_report.py (and the
collectives run of test_report_collectives.py) with "fault" events added to their
counters databases and a `verdict` written into summary.json, in the shapes the
runtime and the incident runner write them (docs/run-format.md)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from testbed.report import build_report, content, load_run, plots
from testbed.report.plots import FaultMark, Series
from testbed.results.store import Store
from tests.unit import test_report_collectives
from tests.unit.test_report import PERIOD_NS, make_run_dir

#: The incast run's victim port starts queueing between samples 100 and 101 (_backlog):
#: a fault applied at sample 101's time sits exactly on that step of the queue plot.
STEP_NS = 101 * PERIOD_NS
FAULTS = [
    # (ts_fabric_ns, detail): applied events in time order, then a converged one
    (300_000, {"event_kind": "host_drain", "target": "h8", "index": 1, "late_ns": 1_200,
               "description": "h8 NIC drains TC3 at 0 b/s", "converge_ns": 0}),
    (STEP_NS, {"event_kind": "link_down", "target": "leaf2-spine1", "index": 0,
               "late_ns": 800, "converge_ns": 50_000,
               "description": "link leaf2-spine1 down (both directions)"}),
    (1_000_000, {"event_kind": "link_up", "target": "leaf2-spine1", "index": 2,
                 "late_ns": 0, "converge_ns": 0, "description": "link leaf2-spine1 up"}),
]
CONVERGED = (STEP_NS + 50_000, {"event_kind": "link_down", "target": "leaf2-spine1",
                                "index": 0, "phase": "converged", "late_ns": 0,
                                "description": "link leaf2-spine1 down: routes converged"})

VERDICT = {
    "incident": "incast-hol", "variant": "incident", "title": "Incast head-of-line blocking",
    "source": "DCQCN paper (SIGCOMM 2015), section 2",
    "description": "An N:1 incast on the lossless class pauses upstream ports; a victim "
                   "flow to an idle host loses most of its throughput.",
    "reproduced": True, "expected": True, "as_expected": True,
    "allowed": ["ecn-above-xoff"], "baseline_run": "runs/20261129T120000Z-incast-hol-control",
    "predicates": [
        {"name": "victim starved", "text": "victim goodput < 50 % of control",
         "value": 12.3, "threshold": 24.6, "op": "<", "unit": "Gb/s", "held": True,
         "detail": "control 49.2 Gb/s"},
        {"name": "pauses spread", "text": "spine pause frames received > 0",
         "value": 20, "threshold": 0, "op": ">", "unit": "frames", "held": True,
         "detail": ""}],
    "evidence": {"counter": "pause_rx", "node": "spine1", "port": "swp2", "tclass": 3,
                 "caption": "pauses spread to the spine"},
}


def add_faults(run_dir: Path, faults=FAULTS, converged=CONVERGED) -> None:
    """Write "fault" events into the run's counters database as the timeline thread does."""
    store = Store(run_dir / "counters.sqlite")
    try:
        for ts, detail in [*faults, *([converged] if converged else [])]:
            node, port = ("h8", "eth0") if detail["event_kind"] == "host_drain" \
                else ("leaf2", "swp5")
            store.add_event(ts, 10**12 + ts * 2000, "fault", node=node, port=port,
                            tclass=3 if detail["event_kind"] == "host_drain" else -1,
                            **detail)
    finally:
        store.close()


def set_verdict(run_dir: Path, verdict: object) -> None:
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    summary["verdict"] = verdict
    path.write_text(json.dumps(summary))


@pytest.fixture(scope="module")
def template_run(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("runs"), name="incast-hol")


@pytest.fixture
def run_dir(template_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template_run, tmp_path / template_run.name))


@pytest.fixture
def incident_run(run_dir: Path) -> Path:
    add_faults(run_dir)
    set_verdict(run_dir, VERDICT)
    return run_dir


def _svgs(html: str) -> dict[str, str]:
    """Every inline SVG of a page by its aria-label."""
    return {m.group(1): m.group(0) for m in re.finditer(
        r'<svg role="img" aria-label="([^"]*)".*?</svg>', html, re.S)}


def _marker_numbers(svg: str, what: str = "marker") -> list[int]:
    return [int(n) for n in re.findall(
        rf'<g id="[\w-]*fault-{what}-(\d+)" class="fault-{what}" data-fault="\1"', svg)]


def _marker_x(svg: str, number: int) -> float:
    m = re.search(rf'id="[\w-]*fault-marker-{number}"[^>]*>\s*<path d="M (-?[\d.]+) '
                  rf'(-?[\d.]+)\s+L (-?[\d.]+) (-?[\d.]+)', svg)
    assert m, f"no marker {number}"
    assert m.group(1) == m.group(3), "a marker is a vertical line"
    return float(m.group(1))


# --- fault markers ------------------------------------------------------------------------

def test_every_time_plot_carries_every_fault_marker(incident_run: Path) -> None:
    html = build_report(incident_run).html.read_text()
    svgs = _svgs(html)
    time_plots = {label: svg for label, svg in svgs.items() if "fabric time" in svg}
    assert not [label for label in svgs if label not in time_plots
                and not label.startswith("fabric drawing")]
    # queue depth, ECN marks, PFC timeline, receive rates, and the evidence plot
    assert len(time_plots) >= 5, list(time_plots)
    for label, svg in time_plots.items():
        assert sorted(_marker_numbers(svg)) == [1, 2, 3], label
        assert _marker_numbers(svg, "converged") == [2], label
        assert sorted(_marker_numbers(svg, "label")) == [1, 2, 3], label
    assert "fault-marker" not in svgs[next(k for k in svgs if k.startswith("fabric drawing"))]


def test_the_phase_timeline_and_slot_plot_of_collectives_carry_the_markers(tmp_path) -> None:
    run_dir = test_report_collectives.make_run(tmp_path)
    # the ranks' phases run from 11 us to ~45 us of fabric time
    add_faults(run_dir, faults=[(20_000, {**FAULTS[1][1], "late_ns": 0})], converged=None)
    html = build_report(run_dir).html.read_text()
    svgs = _svgs(html)
    assert _marker_numbers(svgs["collective phases per rank"]) == [1]
    assert _marker_numbers(svgs["aggregator slot occupancy"]) == [1]


def test_a_marker_sits_where_the_samples_put_the_same_fabric_time(incident_run: Path) -> None:
    """Fault events and samples are both fabric ns after t0 from the store: the marker of a
    fault applied at sample 101's time is on the queue plot's step at sample 101."""
    html = build_report(incident_run).html.read_text()
    svg = _svgs(html)["queue depth, worst port classes"]
    x = _marker_x(svg, 2)
    worst = [d for d, style in re.findall(r'<path d="([^"]+)"[^>]*style="([^"]*)"', svg)
             if f"stroke: {plots.SERIES_COLORS[0]}" in style][0]
    nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", worst)]
    xs = nums[::2]
    rises = [a for a, b in zip(xs, xs[1:], strict=False) if a == b]    # vertical steps
    assert min(abs(r - x) for r in rises) < 0.01, (x, rises[:5])


def test_line_plot_markers_use_the_plots_time_unit_and_origin() -> None:
    # 40 ms of fabric time is drawn in ms; the step at 12 ms and the fault at 12 ms coincide
    pts = [(0, 0.0), (12_000_000, 5.0), (40_000_000, 5.0)]
    svg = plots.line_plot([Series("q", pts)], "u", "u", "v", 1.0, 40_000_000,
                          faults=[FaultMark(1, 12_000_000, "one")])
    assert "fabric time (ms)" in svg
    nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", re.findall(
        r'<path d="([^"]+)"[^>]*style="[^"]*stroke: #1f77b4', svg)[0])]
    assert abs(nums[2] - _marker_x(svg, 1)) < 0.01


def test_no_faults_no_markers_and_no_fault_section(run_dir: Path) -> None:
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    assert "fault-marker" not in html and 'id="faults"' not in html
    assert "Fault timeline" not in md and 'id="verdict"' not in html and "Verdict" not in md


def test_twenty_faults_stay_readable(run_dir: Path) -> None:
    many = [(50_000 + 60_000 * i, {"event_kind": "loss", "target": "leaf1-spine1", "index": i,
                                    "late_ns": 0, "description": f"loss {i} % on leaf1-spine1"})
            for i in range(20)]
    add_faults(run_dir, faults=many, converged=None)
    html = build_report(run_dir).html.read_text()
    svg = _svgs(html)["queue depth, worst port classes"]
    assert sorted(_marker_numbers(svg)) == list(range(1, 21))
    assert "faults 1-20 (20): see the fault timeline" in svg   # no 20 names crammed in
    faults = html[html.index('id="faults"'):]
    assert all(f"loss {i} % on leaf1-spine1" in faults for i in range(20))


def test_a_fault_outside_a_plots_span_is_counted_not_drawn() -> None:
    svg = plots.timeline_plot([("a", [(10_000, 5_000)])], "t", "t", 20_000, x_min_ns=10_000,
                              faults=[FaultMark(1, 2_000, "early"), FaultMark(2, 15_000, "in")])
    assert _marker_numbers(svg) == [2]
    assert "1 outside this plot" in svg


# --- the fault timeline -------------------------------------------------------------------

def _md_section(md: str, title: str) -> str:
    start = md.index(f"## {title}")
    end = md.find("\n## ", start + 1)
    return md[start:end if end > 0 else None]


def test_fault_timeline_lists_each_fault_with_time_lateness_and_details(
        incident_run: Path) -> None:
    with load_run(incident_run) as run:
        faults = content.fault_events(run)
        section = content.fault_timeline(run, faults)
    assert [f.number for f in faults] == [1, 2, 3]
    assert faults[1].converged is not None and faults[0].converged is None
    assert section is not None
    table = section["table"]
    assert table.columns[:7] == ["#", "at (fabric)", "kind", "target", "description",
                                 "late by", "routes converged at"]
    one, two, three = table.rows
    assert one[:6] == ["1", "300 us", "host_drain", "h8", "h8 NIC drains TC3 at 0 b/s",
                       "1.2 us"]
    assert two[1:4] == ["505 us", "link_down", "leaf2-spine1"] and two[6] == "555 us"
    # link down: how long, and what the fabric's drop counters say it cost; leaf1:swp1
    # TC0 drops 3 from sample 250 (1.25 ms) on, after the link came back at 1 ms
    assert "down for 495 us (fault 3)" in two[7]
    assert "0 packets dropped in the fabric while down" in two[7]
    assert "routes converge after 50 us" in two[7]
    assert three[2] == "link_up"
    md = build_report(incident_run).md.read_text()
    section_md = _md_section(md, "Fault timeline")
    assert re.search(r"\|\s+2 \|", section_md)
    assert "link leaf2-spine1 down (both directions)" in section_md


def test_a_link_down_counts_the_drops_until_its_link_up(run_dir: Path) -> None:
    # leaf1:swp1 TC0 drops 3 packets at 1.25 ms (sample 250): a flap over it counts them
    add_faults(run_dir, faults=[
        (1_200_000, {"event_kind": "link_down", "target": "leaf1-spine1", "index": 0}),
        (1_300_000, {"event_kind": "link_up", "target": "leaf1-spine1", "index": 1})],
        converged=None)
    with load_run(run_dir) as run:
        faults = content.fault_events(run)
        row = content.fault_timeline(run, faults)["table"].rows[0]
    assert "3 packets dropped in the fabric while down" in row[7]
    assert row[4] == "link_down leaf1-spine1" and row[5] == "-"    # no description, no late_ns


def test_unknown_detail_keys_are_shown_not_lost(run_dir: Path) -> None:
    add_faults(run_dir, faults=[(100_000, {"event_kind": "rate", "target": "leaf1-spine1",
                                           "index": 0, "rate_bps": 50_000_000_000})],
               converged=None)
    with load_run(run_dir) as run:
        row = content.fault_timeline(run, content.fault_events(run))["table"].rows[0]
    assert "rate_bps 50 Gb/s" in row[7]


# --- the verdict banner -------------------------------------------------------------------

def test_verdict_banner_is_at_the_top_of_both_reports(incident_run: Path) -> None:
    paths = build_report(incident_run)
    html, md = paths.html.read_text(), paths.md.read_text()
    banner = html.index('id="verdict"')
    assert banner < html.index('class="facts"') and banner < html.index("<nav>")
    assert 'class="verdict-banner ok"' in html
    assert re.search(r'id="verdict-status"[^>]*>REPRODUCED, as expected<', html)
    assert "Incast head-of-line blocking" in html and ">incident</span>" in html
    assert "DCQCN paper (SIGCOMM 2015), section 2" in html
    assert "this fabric is misconfigured on purpose: ecn-above-xoff" in html
    assert "runs/20261129T120000Z-incast-hol-control" in html
    assert 'class="missing-keys"' not in html
    assert md.index("## Verdict: Incast head-of-line blocking (incident)") < md.index("- **lab**")
    assert "> **REPRODUCED, as expected**" in md
    assert "**this fabric is misconfigured on purpose: ecn-above-xoff**" in md
    for text in (html, md):
        assert "victim goodput &lt; 50 % of control" in text or \
            "victim goodput < 50 % of control" in text
        assert "12.3" in text and "24.6" in text and "Gb/s" in text
        assert "control 49.2 Gb/s" in text


def test_predicate_table_has_value_op_threshold_unit_held_detail(incident_run: Path) -> None:
    with load_run(incident_run) as run:
        v = content.verdict(run)
    assert v is not None
    table = v["predicates"]
    assert table.columns == ["predicate", "says", "measured", "op", "threshold", "unit",
                             "held", "detail"]
    assert table.rows[0] == ["victim starved", "victim goodput < 50 % of control", "12.3",
                             "<", "24.6", "Gb/s", "held", "control 49.2 Gb/s"]
    assert table.rows[1][2] == "20" and table.rows[1][-1] == "-"


@pytest.mark.parametrize(("variant", "reproduced", "state", "status"), [
    ("incident", True, "ok", "REPRODUCED, as expected"),
    ("control", False, "ok", "NOT REPRODUCED, as expected"),
    ("control", True, "fail", "REPRODUCED: FAILURE, a control run must not reproduce"),
    ("incident", False, "fail", "NOT REPRODUCED: FAILURE, the incident was expected"),
])
def test_a_control_that_reproduces_is_a_failure(run_dir: Path, variant: str,
                                                reproduced: bool, state: str,
                                                status: str) -> None:
    expected = variant == "incident"
    set_verdict(run_dir, {**VERDICT, "variant": variant, "reproduced": reproduced,
                          "expected": expected, "as_expected": reproduced == expected})
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    assert f'class="verdict-banner {state}"' in html
    assert status in html and status in md


def test_evidence_plot_is_annotated_and_carries_the_markers(incident_run: Path) -> None:
    html = build_report(incident_run).html.read_text()
    evidence = html[html.index('id="evidence"'):html.index("</section>")]
    svg = _svgs(evidence)["pauses spread to the spine"]
    assert sorted(_marker_numbers(svg)) == [1, 2, 3]
    # an arrow at the first fault and one where pause_rx starts to grow (sample 121)
    assert 'id="evidence-evidence-annotation-1"' in svg
    assert 'id="evidence-evidence-annotation-2"' in svg
    assert "fault 1: h8 NIC drains TC3" in svg
    assert "pause_rx starts rising at 605 us" in svg
    assert "spine1:swp2 TC3 roce" in svg
    assert "<figcaption>Evidence: pauses spread to the spine (pause_rx at spine1:swp2 " \
        "class 3)" in evidence
    md = build_report(incident_run).md.read_text()
    verdict_md = _md_section(md, "Verdict")
    # the same evidence in numbers, for the Markdown reader: 0 at the first fault, 20 at
    # its peak, reached at sample 140 (700 us)
    assert re.search(r"\| spine1:swp2 TC3 roce \|\s+0 \|\s+20 \|\s+700 us \|\s+20 \|",
                     verdict_md), verdict_md


def test_evidence_with_wildcards_is_thinned_to_the_series_that_moved(run_dir: Path) -> None:
    set_verdict(run_dir, {**VERDICT, "evidence": {"counter": "backlog_bytes", "node": "*",
                                                  "port": "*", "tclass": "*",
                                                  "caption": "the queues"}})
    with load_run(run_dir) as run:
        ev = content.evidence(run, run.summary["verdict"]["evidence"], [])
        n_series = len(run.store.series("backlog_bytes"))
    assert ev is not None and ev["svg"]
    assert n_series > content.EVIDENCE_SERIES
    assert ev["text"].startswith(f"{content.EVIDENCE_SERIES} of the {n_series} series")
    rows = ev["table"].rows
    assert len(rows) == content.EVIDENCE_SERIES
    assert rows[0][0] == "leaf2:swp4 TC3 roce"          # the deepest queue first
    assert "peak 396 KB" in ev["svg"]                    # a queue: its peak is annotated


def test_evidence_of_a_counter_the_run_did_not_record_says_so(run_dir: Path) -> None:
    set_verdict(run_dir, {**VERDICT, "evidence": {"counter": "no_such", "node": "x",
                                                  "port": "*", "tclass": "*"}})
    paths = build_report(run_dir)
    assert "no series of no_such at x:* class * in the counters database" in \
        paths.html.read_text()
    assert "no series of no_such" in paths.md.read_text()


# --- robustness ---------------------------------------------------------------------------

def test_a_malformed_verdict_shows_what_it_has_and_says_what_is_missing(
        run_dir: Path) -> None:
    set_verdict(run_dir, {"reproduced": True, "title": "half a verdict",
                          "predicates": [{"name": "victim starved", "value": 3.0}, "junk"],
                          "evidence": {"node": "spine1"}})
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    for text in (html, md):
        assert "half a verdict" in text and "REPRODUCED" in text
        assert "victim starved" in text
        assert "missing: incident; variant; source; description; expected; as_expected" \
            in text
        assert "predicate 1 lacks op, threshold, held" in text
        assert "predicate 2 is not an object" in text
        assert "evidence.counter" in text
    assert 'class="verdict-banner unknown"' in html      # expected unknown: no judgement


def test_a_verdict_without_expected_takes_it_from_the_variant(run_dir: Path) -> None:
    v = {k: val for k, val in VERDICT.items() if k not in ("expected", "as_expected")}
    set_verdict(run_dir, {**v, "variant": "control", "reproduced": True})
    html = build_report(run_dir).html.read_text()
    assert 'class="verdict-banner fail"' in html
    assert "missing: expected; as_expected" in html


@pytest.mark.parametrize("verdict", ["reproduced", 42, ["a"]])
def test_a_verdict_that_is_not_an_object_does_not_break_the_report(run_dir: Path,
                                                                   verdict) -> None:
    set_verdict(run_dir, verdict)
    paths = build_report(run_dir)
    # the run-directory check names it (and leaves the verdict out) before the report
    assert re.search(r"summary\.json: verdict is \w+, not an object", paths.html.read_text())
    assert "## Queue depth" in paths.md.read_text()


def test_a_verdict_without_a_counters_database_still_shows_its_predicates(
        incident_run: Path) -> None:
    (incident_run / "counters.sqlite").unlink()
    paths = build_report(incident_run)
    html = paths.html.read_text()
    assert "victim starved" in html and "REPRODUCED, as expected" in html
    assert "no counters database: pause_rx at spine1:swp2 class 3 cannot be drawn" in html
