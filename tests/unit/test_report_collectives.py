"""The report's Collectives section, from a synthetic run directory (no root): three ranks
of an all-reduce that wrote collective_phase events and sampled counters, and an
in-network aggregator whose slots_in_use rose and fell. Missing data leaves the section
out; too many phases shrink the timeline to the last size, and the caption says so."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from testbed.report import build_report, content, load_run, plots
from testbed.results.store import Event, Sample, Store

RANKS = [("h1", "ar-r0"), ("h2", "ar-r1"), ("h3", "ar-r2")]
AGG = ("sw1", "ar-agg-sw1")
SIZES = (4096, 65536)
WARMUP, ITERATIONS = 1, 2
PHASES = (("reduce_scatter", 3_000), ("all_gather", 2_000))   # fabric ns each
PERIOD_NS = 5_000
N_SAMPLES = 40
POOL = 32
SLOTS_IN_USE = [0, 0, 2, 3, 3, 1, 0]        # the aggregator's first samples, then 0


def _phase_events() -> list[Event]:
    """Every rank: per size, warm-up then timed iterations, each phase after a 1 us
    barrier; a rank is 100 ns behind the one before it."""
    out = []
    for r, (node, agent) in enumerate(RANKS):
        t = 10_000 + 100 * r
        for nbytes in SIZES:
            for it in range(WARMUP + ITERATIONS):
                t += 1_000
                for phase, ns in PHASES:
                    out.append(Event(t, 10**12 + t, "collective_phase", node, agent, -1, {
                        "rank": r, "phase": phase, "bytes": nbytes, "iteration": it,
                        "warmup": it < WARMUP, "end_mono_ns": 10**12 + t + ns,
                        "duration_ns": ns}))
                    t += ns
    return out


def make_run(root: Path, *, events: bool = True, ranks: bool = True,
             aggregator: bool = True) -> Path:
    run_dir = root / "20261129T120501Z-coll"
    run_dir.mkdir()
    store = Store(run_dir / "counters.sqlite", create=True)
    store.set_meta("dilation", "1000")
    for i in range(N_SAMPLES):
        ts = i * PERIOD_NS
        samples = [Sample("sw1", "swp1", 3, "class_bytes", i * 1000)]
        done = min(i, 30) / 30
        for r, (node, agent) in enumerate(RANKS if ranks else []):
            samples += [Sample(node, agent, -1, "collective.rank", r),
                        Sample(node, agent, -1, "collective.bytes_sent", int(done * 9e5)),
                        Sample(node, agent, -1, "collective.bytes_received", int(done * 9e5)),
                        Sample(node, agent, -1, "collective.retransmissions", r),
                        Sample(node, agent, -1, "collective.phase_reduce_scatter_ns",
                               int(done * 18_000)),
                        Sample(node, agent, -1, "collective.phase_all_gather_ns",
                               int(done * 12_000))]
        if aggregator:
            used = SLOTS_IN_USE[i] if i < len(SLOTS_IN_USE) else 0
            samples += [Sample(*AGG, -1, "aggregator.slots_in_use", used),
                        Sample(*AGG, -1, "aggregator.slots", POOL),
                        Sample(*AGG, -1, "aggregator.slots_in_use_max",
                               max(SLOTS_IN_USE[:i + 1]) + 1),   # a peak between samples
                        Sample(*AGG, -1, "aggregator.drops_stale", 0)]
        store.add_samples(ts, 10**12 + ts * 1000, samples, final=i == N_SAMPLES - 1)
    if events:
        store.add_events(_phase_events())
    store.close()
    (run_dir / "summary.json").write_text(json.dumps({
        "format_version": 1, "name": "coll", "lab": "coll", "dilation": 1000,
        "duration_fabric_ns": (N_SAMPLES - 1) * PERIOD_NS, "duration_wall_s": 1.0,
        "interrupted": False, "ports": [], "workloads": [], "totals": {}, "fidelity": []}))
    return run_dir


@pytest.fixture
def captured(monkeypatch) -> list[dict]:
    """The timeline_plot calls the section makes (its rows and x range)."""
    calls: list[dict] = []
    real = plots.timeline_plot

    def spy(rows, prefix, title, x_max_ns, x_min_ns=0.0, categories=(), faults=()):
        calls.append({"rows": rows, "x_min": x_min_ns, "x_max": x_max_ns,
                      "categories": list(categories), "faults": list(faults)})
        return real(rows, prefix, title, x_max_ns, x_min_ns=x_min_ns, categories=categories,
                    faults=faults)
    monkeypatch.setattr(plots, "timeline_plot", spy)
    return calls


def test_the_section_has_a_phase_timeline_per_rank_an_occupancy_plot_and_a_rank_table(
        tmp_path, captured) -> None:
    with load_run(make_run(tmp_path)) as run:
        section = content.collectives(run)
    assert section is not None
    (call,) = captured
    assert [label for label, _ in call["rows"]] == [
        "ar-r0 rank 0 (h1)", "ar-r1 rank 1 (h2)", "ar-r2 rank 2 (h3)"]
    per_rank = len(SIZES) * (WARMUP + ITERATIONS) * len(PHASES)
    assert all(len(bars) == per_rank for _, bars in call["rows"])
    assert call["categories"] == ["reduce_scatter", "all_gather"]
    first = call["rows"][0][1][0]
    assert first == (11_000, 3_000, "reduce_scatter")           # start, fabric length, phase
    assert call["x_min"] == 11_000
    svg = section["timeline"]["svg"]
    # coloured by phase, with a legend naming each
    assert "reduce_scatter" in svg and "all_gather" in svg
    assert plots.SERIES_COLORS[0] in svg and plots.SERIES_COLORS[1] in svg
    assert section["timeline"]["caption"] == (
        f"{3 * per_rank} phase bars: every phase of every iteration, warm-ups included.")

    occ = section["occupancy"]
    assert len(occ["svgs"]) == 1 and "pool 32 slots" in occ["svgs"][0]
    assert "ar-agg-sw1 (sw1)" in occ["svgs"][0]
    assert occ["table"].rows == [["ar-agg-sw1", "sw1", "3", "4", "32"]]

    table = section["ranks"]
    assert table.columns == ["rank agent", "node", "rank", "bytes sent", "bytes received",
                             "retransmissions", "reduce_scatter time", "all_gather time"]
    assert table.rows[2] == ["ar-r2", "h3", "2", "900,000", "900,000", "2", "18 us", "12 us"]


def test_too_many_phases_show_the_last_sizes_timed_iterations_and_say_so(
        tmp_path, captured, monkeypatch) -> None:
    monkeypatch.setattr(content, "MAX_TIMELINE_BARS", 20)
    with load_run(make_run(tmp_path)) as run:
        section = content.collectives(run)
    assert section is not None
    (call,) = captured
    bars = [b for _, bs in call["rows"] for b in bs]
    assert len(bars) == 3 * ITERATIONS * len(PHASES)
    events = [e for e in _phase_events() if e.detail["bytes"] == SIZES[-1]
              and not e.detail["warmup"]]
    assert call["x_min"] == min(e.ts_fabric_ns for e in events)     # zoomed on them
    assert section["timeline"]["caption"] == (
        "12 of 36 phase bars: the timed iterations of each rank's last size (65.54 KB).")


def test_still_too_many_keeps_each_ranks_last_phases(tmp_path, captured, monkeypatch) -> None:
    monkeypatch.setattr(content, "MAX_TIMELINE_BARS", 6)
    with load_run(make_run(tmp_path)) as run:
        section = content.collectives(run)
    assert section is not None
    assert [len(bars) for _, bars in captured[0]["rows"]] == [2, 2, 2]
    assert captured[0]["rows"][0][1][-1][2] == "all_gather"        # the very last phase
    assert section["timeline"]["caption"].endswith(", the last 2 phases of each rank.")


def test_no_collective_data_means_no_section(tmp_path) -> None:
    run_dir = make_run(tmp_path, events=False, ranks=False, aggregator=False)
    with load_run(run_dir) as run:
        assert content.collectives(run) is None
    html = build_report(run_dir).html.read_text()
    assert 'id="collectives"' not in html and 'href="#collectives"' not in html


def test_without_events_the_section_keeps_what_the_counters_show(tmp_path) -> None:
    with load_run(make_run(tmp_path, events=False, aggregator=False)) as run:
        section = content.collectives(run)
    assert section is not None
    assert section["timeline"] is None and section["occupancy"] is None
    assert len(section["ranks"].rows) == 3


def test_without_a_counters_database_there_is_no_section(tmp_path) -> None:
    run_dir = make_run(tmp_path)
    (run_dir / "counters.sqlite").unlink()
    with load_run(run_dir) as run:
        assert content.collectives(run) is None


def test_the_report_files_carry_the_section(tmp_path) -> None:
    paths = build_report(make_run(tmp_path))
    html, md = paths.html.read_text(), paths.md.read_text()
    section = html[html.index('<section id="collectives">'):]
    section = section[:section.index("</section>")]
    assert section.count("<svg") == 2 and 'href="#collectives"' in html
    assert "Aggregator slot occupancy" in section and "ar-r1" in section
    assert "## Collectives" in md and "| ar-r0 " in md
    assert re.search(r"\| ar-agg-sw1 +\| sw1 +\| +3 \| +4 \| +32 \|", md)


def test_a_timeline_without_categories_draws_as_before() -> None:
    svg = plots.timeline_plot([("a", [(0, 10), (50, 5)]), ("b", [(20, 30)])], "t",
                              "pauses", 100)
    assert plots.SERIES_COLORS[1] in svg and plots.SERIES_COLORS[0] not in svg
    assert "<g id=\"t-legend" not in svg
