"""Reports from a run directory alone: HTML + Markdown + Prometheus (no root).

A synthetic run of the default fabric (7-to-1 incast onto h8) is written the
way `testbed run` writes one (docs/run-format.md): plan, metadata, summary
and a counters database with a backlog ramp on leaf2:swp4, ECN marks, PFC
pauses and agent byte counters.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import re
import shutil
import sqlite3
import stat
from pathlib import Path

import pytest

from testbed.config import load_config, load_config_text
from testbed.plan import compile_plan
from testbed.report import (
    ReportPaths,
    RunDirError,
    RunFormatError,
    build_report,
    load_run,
    plots,
    write_prometheus,
)
from testbed.report.plots import Series, fabric_layers
from testbed.report.prometheus import escape_label, prometheus_text
from testbed.results.store import Sample, Store
from tests.conftest import REPO
from tests.unit.v1_store import V1Store

BUDGET_BPS = 200_000_000          # pinned: D = 2000 for the default fabric
PERIOD_NS = 5_000                 # fabric sample period
N_SAMPLES = 300                   # 1.5 ms of fabric time
PACKET_BYTES = 1086
HOT = ("leaf2", "swp4", 3)        # the incast victim port: leaf2 -> h8, RoCE class
HOT_BYTES_PER_SAMPLE = 62_500     # 100 Gb/s over 5 us
RECV_H8_PER_SAMPLE = 58_000       # 92.8 Gb/s fabric
RECV_H5_PER_SAMPLE = 6_250        # exactly 10 Gb/s fabric
PAUSERS = [("leaf2", "swp5", 3), ("leaf2", "swp1", 3)]
# leaf2 -> h7 holds 50 KB over 750..1000 us while it sends nothing (h7 paused it): none of
# that port's counters move then, so counters format 2 writes no row for it in between.
HELD = ("leaf2", "swp3", 3)
HELD_SAMPLES = range(150, 200)
# burst-h6 receives 10 Gb/s over 250..500 us and 1000..1250 us, nothing in between.
BURSTS = (range(50, 100), range(200, 250))


def _plan():
    # The per-port rule, pinned as a config pins it, keeps this fixture at D = 2000 (the
    # capacity rule would pick D from the workload and the machine).
    text = (REPO / "configs/default.yaml").read_text()
    return compile_plan(load_config_text(text + f"max_wall_port_rate: {BUDGET_BPS}bps\n",
                                         str(REPO / "configs/default.yaml")))


def _tx_per_sample(key: tuple[str, str, int]) -> int:
    node, port, tc = key
    if key == HOT:
        return HOT_BYTES_PER_SAMPLE
    share = HOT_BYTES_PER_SAMPLE // 7
    if tc == 3 and node in {f"h{i}" for i in range(1, 8)}:
        return share
    if tc == 3 and (node, port) in {("leaf1", "swp5"), ("leaf1", "swp6"),
                                    ("spine1", "swp2"), ("spine2", "swp2")}:
        return 2 * share
    return 0


def _backlog(key: tuple[str, str, int], i: int, ramp: bool) -> int:
    if not ramp:
        return 0
    if key == HOT:
        if 100 <= i < 200:
            return (i - 100) * 4_000          # up to 396 KB
        if 200 <= i < 250:
            return max(0, 396_000 - (i - 200) * 8_000)
    if key == ("spine1", "swp2", 3) and 120 <= i < 140:
        return 30_000
    if key == HELD and i in HELD_SAMPLES:
        return 50_000
    return 0


def _burst_bytes(i: int) -> int:
    """burst-h6's received bytes after sample i: 6,250 B a sample (10 Gb/s) in BURSTS."""
    return RECV_H5_PER_SAMPLE * sum(1 for burst in BURSTS for j in burst if j <= i)


def make_run_dir(root: Path, *, backlog: bool = True, interrupted: bool = False,
                 summary: bool = True, name: str = "incast", store_format: int = 2,
                 died: bool = False, trims: bool = False) -> Path:
    """A run directory as `testbed run` leaves it (with a counters database of
    `store_format`: 1 as testbeds before format 2 wrote it; `died`: as a writer killed
    before it closed the store leaves it, points in time order; `trims`: HOT's class
    trimmed 2 packets per sample while its queue was above 100 KB); returns its path."""
    plan = _plan()
    d = plan.dilation.factor
    run_dir = root / f"20261129T120501Z-{name}"
    run_dir.mkdir(mode=0o700)
    (run_dir / "plan.json").write_text(plan.to_json())
    (run_dir / "metadata.json").write_text(json.dumps({
        "format_version": 1, "testbed_version": "0.1.0", "created_utc": "20261129T120501Z",
        "kernel": "6.1.0-test-amd64", "machine": "x86_64", "hostname": "vm1",
        "python": "3.11.2", "cpus": 4, "dilation": d, "packages": {"numpy": "2.0"},
        "argv": ["testbed", "run"], "fidelity_budget_bps": BUDGET_BPS,
        "probe": {"kernel": "6.1.0-test-amd64", "machine": "x86_64",
                  "features": {"netem": {"name": "netem", "present": False,
                                         "detail": "kernel: not supported",
                                         "disables": "propagation/FEC delay in the kernel"},
                               "htb": {"name": "htb", "present": True, "detail": "ok",
                                       "disables": "per-port rates"}},
                  "missing": ["netem"]}}))

    keys = [(n.name, i.ifname, c.tc) for n in plan.nodes for i in n.interfaces
            for c in i.egress.classes]
    path = run_dir / ("live.sqlite" if died else "counters.sqlite")
    store = Store(path, create=True) if store_format == 2 else V1Store(path)
    store.set_meta("lab", plan.lab)
    store.set_meta("dilation", str(d))
    store.set_meta("sample_period_fabric_ns", str(PERIOD_NS))
    store.add_event(0, 10**12, "phase", phase="workload")
    last: dict[str, dict] = {c: {} for c in ("class_bytes", "class_packets", "class_drops",
                                             "ecn_marks", "pause_tx", "pause_rx", "paused_ns",
                                             "trims")}
    max_queue: dict = {}
    for i in range(N_SAMPLES):
        ts = i * PERIOD_NS
        samples = []
        for key in keys:
            tx = i * _tx_per_sample(key)
            drops = 3 if key == ("leaf1", "swp1", 0) and i >= 250 else 0
            q = _backlog(key, i, backlog)
            max_queue[key] = max(max_queue.get(key, 0), q)
            for counter, value in (("class_bytes", tx), ("class_packets", tx // PACKET_BYTES),
                                   ("class_drops", drops), ("backlog_bytes", q)):
                samples.append(Sample(*key, counter, value))
                if counter in last:
                    last[counter][key] = value
        marks = 0
        if backlog:
            marks = 5 * sum(1 for j in range(i + 1) if _backlog(HOT, j, True) > 100_000)
        samples.append(Sample(*HOT, "ecn_marks", marks))
        last["ecn_marks"][HOT] = marks
        if trims:
            trimmed = 2 * sum(1 for j in range(i + 1) if _backlog(HOT, j, backlog) > 100_000)
            samples.append(Sample(*HOT, "trims", trimmed))
            last["trims"][HOT] = trimmed
        pauses = 0 if i < 120 else min(i - 120, 20)      # frames sent 600 us .. 700 us
        for key in PAUSERS:
            samples.append(Sample(*key, "pause_tx", pauses))
            last["pause_tx"][key] = pauses
        samples.append(Sample("spine1", "swp2", 3, "pause_rx", pauses))
        paused = min(max(ts - 600_000, 0), 100_000)        # paused 600 us .. 700 us
        samples.append(Sample("spine1", "swp2", 3, "paused_ns", paused))
        last["pause_rx"][("spine1", "swp2", 3)] = pauses
        samples.append(Sample("h8", "incast-h8", -1, "recv.bytes", i * RECV_H8_PER_SAMPLE))
        samples.append(Sample("h5", "bg-h5", -1, "recv.bytes", i * RECV_H5_PER_SAMPLE))
        samples.append(Sample("h6", "burst-h6", -1, "recv.bytes", _burst_bytes(i)))
        store.add_samples(ts, 10**12 + ts * d, samples, final=i == N_SAMPLES - 1)
    last["paused_ns"][("spine1", "swp2", 3)] = paused
    for key in PAUSERS:
        store.add_event(600_000, 0, "pfc_xoff", *key, quanta=65535)
        store.add_event(700_000, 0, "pfc_xon", *key, quanta=0)
    store.add_event(900_000, 0, "fidelity",
                    message="leaf2:swp4 delivered 97.1% of 100Gbps while backlogged")
    if interrupted:
        store.add_event(1_400_000, 0, "interrupted", signal="SIGINT")
    rows = []
    for h in range(1, 8):
        tx = (N_SAMPLES - 1) * (HOT_BYTES_PER_SAMPLE // 7)
        rows.append({"src": f"h{h}", "dst": "h8", "tx_packets": tx // PACKET_BYTES,
                     "tx_bytes": tx, "rx_packets": tx // PACKET_BYTES - h,
                     "rx_bytes": tx - h * PACKET_BYTES, "lost": h,
                     "rx_fabric_bps": 13_250_000_000.0 + h})
        store.add_result("incast", "udp_incast", rows[-1])
    if died:
        with sqlite3.connect(run_dir / "counters.sqlite") as copy:
            store.db.backup(copy)        # the database as it is before close()
        store.close()
        path.unlink()
    else:
        store.close()

    ports = []
    for key in sorted(keys):
        ports.append({"node": key[0], "port": key[1], "tclass": key[2],
                      "tx_bytes": last["class_bytes"][key],
                      "tx_packets": last["class_packets"][key],
                      "drops": last["class_drops"][key],
                      "queue_drops": last["class_drops"][key], "phy_drops": 0,
                      "ecn_marks": last["ecn_marks"].get(key, 0),
                      "trims": last["trims"].get(key, 0),
                      "pause_tx": last["pause_tx"].get(key, 0),
                      "pause_rx": last["pause_rx"].get(key, 0),
                      "paused_ns": last["paused_ns"].get(key, 0),
                      "max_queue_bytes": max_queue[key]})
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({
            "format_version": 1, "name": name, "lab": plan.lab,
            "run_dir": f"runs/{run_dir.name}", "dilation": d,
            "duration_fabric_ns": (N_SAMPLES - 1) * PERIOD_NS, "duration_wall_s": 3.1,
            "interrupted": interrupted, "ports": ports,
            "workloads": [{"name": "incast", "kind": "udp_incast", "results": rows}],
            "totals": {"tx_bytes": sum(p["tx_bytes"] for p in ports),
                       "drops": sum(p["drops"] for p in ports),
                       "queue_drops": sum(p["drops"] for p in ports), "phy_drops": 0,
                       "ecn_marks": sum(p["ecn_marks"] for p in ports),
                       "trims": sum(p["trims"] for p in ports),
                       "pause_frames": sum(p["pause_tx"] for p in ports),
                       "delivered_bytes": sum(r["rx_bytes"] for r in rows)},
            "fidelity": ["leaf2:swp4 delivered 97.1% of 100Gbps while backlogged"],
            "verdict": None}, indent=2))
    return run_dir


@pytest.fixture(scope="module")
def template_run(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("runs"))


@pytest.fixture
def run_dir(template_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template_run, tmp_path / template_run.name))


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _hot_port(summary: dict) -> dict:
    return max(summary["ports"], key=lambda p: p["tx_bytes"])


# --- HTML and Markdown --------------------------------------------------------------------

def test_report_files_hold_the_key_numbers(run_dir: Path) -> None:
    paths = build_report(run_dir)
    assert paths == ReportPaths(run_dir / "report.html", run_dir / "report.md")
    html, md = paths.html.read_text(), paths.md.read_text()
    hot = _hot_port(_summary(run_dir))
    assert (hot["node"], hot["port"], hot["tclass"]) == HOT
    for text in (html, md):
        assert f"{hot['tx_bytes']:,}" in text            # busiest port's bytes
        assert "leaf2:swp4" in text
        assert "2000" in text                              # dilation
        assert "h8" in text and "udp_incast" in text
        for h in range(1, 8):                              # every workload row, with its loss
            assert re.search(rf"\bh{h}\b", text)
        assert f"{(N_SAMPLES - 1) * (HOT_BYTES_PER_SAMPLE // 7) - 7 * PACKET_BYTES:,}" in text
        assert "6.1.0-test-amd64" in text and "netem" in text   # kernel, missing feature
        assert "delivered 97.1%" in text                   # fidelity note
    assert 'class="banner interrupted"' not in html and "**INTERRUPTED**" not in md


def test_report_dilation_and_durations_in_header(run_dir: Path) -> None:
    html = build_report(run_dir).html.read_text()
    assert "D = 2000" in html
    assert "1.495 ms" in html                  # duration_fabric_ns 1,495,000
    assert "3.10 s" in html                    # wall
    assert "2026-11-29 12:05:01 UTC" in html


def test_html_is_self_contained(run_dir: Path) -> None:
    html = build_report(run_dir).html.read_text()
    assert 'src="http' not in html and 'href="http' not in html
    assert "http://" not in html and "https://" not in html   # not even SVG namespaces
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert html.count("<svg") >= 4            # fabric, queue, ECN, PFC, rates
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), "element ids collide between inline SVGs"


def test_report_files_are_private_and_written_atomically(run_dir: Path) -> None:
    paths = build_report(run_dir)
    for path in (paths.html, paths.md):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    build_report(run_dir)                      # rebuilding replaces, does not fail
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_queue_section_present_when_a_port_queued(run_dir: Path) -> None:
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    assert 'id="queues"' in html and "backlog (KB)" in html and "fabric time (us)" in html
    assert "## Queue depth" in md
    queue_md = md.split("## Queue depth")[1].split("\n## ")[0]
    assert "leaf2:swp4" in queue_md and "396 KB" in queue_md
    assert queue_md.index("leaf2:swp4") < queue_md.index("spine1:swp2")   # worst first
    assert "ECN Kmin 100 KB" in html            # threshold drawn on the worst port's plot


def test_queue_and_ecn_sections_absent_without_backlog(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path, backlog=False)
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    assert 'id="queues"' not in html and "## Queue depth" not in md
    assert 'id="ecn"' not in html and "## ECN marks" not in md
    assert 'id="pfc"' in html                   # still paused: that section stays


def test_trims_section_plots_trims_like_ecn_marks_only_when_a_port_trimmed(
        run_dir: Path, tmp_path: Path) -> None:
    paths = build_report(run_dir)
    assert 'id="trims"' not in paths.html.read_text()
    assert "## Packet trimming" not in paths.md.read_text()
    (tmp_path / "trimmed").mkdir()
    trimmed = make_run_dir(tmp_path / "trimmed", trims=True)
    paths = build_report(trimmed)
    html, md = paths.html.read_text(), paths.md.read_text()
    assert 'id="trims"' in html and "Trimmed packets (cumulative)" in html
    summary = _summary(trimmed)
    hot = next(p for p in summary["ports"] if (p["node"], p["port"], p["tclass"]) == HOT)
    assert hot["trims"] > 0 and summary["totals"]["trims"] == hot["trims"]
    assert "## Packet trimming" in md and f"{hot['trims']:,}" in md
    assert "PFC pause frames were sent" in md          # this run paused: the note says so
    metrics = parse_prometheus(prometheus_text(summary))
    assert ({"lab": summary["lab"], "node": HOT[0], "port": HOT[1], "tclass": str(HOT[2])},
            float(hot["trims"])) in metrics["testbed_port_trims_total"]


def test_pfc_section_shows_who_paused_whom(run_dir: Path) -> None:
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    assert 'id="pfc"' in html
    assert "leaf2:swp5 → spine1:swp2" in html
    pfc_md = md.split("## PFC pauses")[1].split("\n## ")[0]
    assert "leaf2:swp5" in pfc_md and "spine1:swp2" in pfc_md and "100 us" in pfc_md


def test_agent_rates_are_fabric_rates(run_dir: Path) -> None:
    md = build_report(run_dir).md.read_text()
    rates = md.split("## Receive rates")[1].split("\n## ")[0]
    # 6,250 bytes per 5 us of fabric time is 10 Gb/s in the fabric (5 Mb/s wall at D=2000).
    assert re.search(r"bg-h5 .*\| +10 Gb/s \| +10 Gb/s \|", rates)
    # From the sample before its first byte to the first that holds its last: 625 KB in
    # 1 ms (the idle stretch counts, at 0 b/s), and 10 Gb/s while a burst lasts.
    assert re.search(r"burst-h6 .*\| +625,000 \| +5 Gb/s \| +10 Gb/s \|", rates)
    assert re.search(r"incast-h8 .*92\.8 Gb/s", rates)


def _md_table(section: str) -> tuple[list[str], list[list[str]]]:
    """Header and body cells of the first pipe table in a Markdown section."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


def test_queue_means_are_over_samples_not_over_stored_changes(run_dir: Path) -> None:
    md = build_report(run_dir).md.read_text()
    queue_md = md.split("## Queue depth")[1].split("\n## ")[0]
    row = next(line for line in queue_md.splitlines() if line.startswith("| leaf2:swp4"))
    # sum of _backlog(HOT, i) over the 300 samples = 29.8 MB: 99.33 KB a sample
    assert re.search(r"\| +396 KB \| +995 us \| +99\.33 KB \|", row), row
    # 50 KB held over 50 of 300 samples (stored as two changes): 8.333 KB a sample
    row = next(line for line in queue_md.splitlines() if line.startswith("| leaf2:swp3"))
    assert re.search(r"\| +50 KB \| +750 us \| +8\.333 KB \|", row), row


@pytest.mark.parametrize("with_summary", [True, False], ids=["summary", "rebuilt"])
def test_report_of_a_v1_run_dir_equals_the_v2_one(tmp_path: Path, with_summary: bool) -> None:
    """The same run written in counters format 1 (a row per counter per sample) and 2
    (changes only; closed, or as a run that died left it) gives the same report: every
    reader reads steps, not rows."""
    texts = []
    for fmt, died in ((1, False), (2, False), (2, True)):
        root = tmp_path / f"v{fmt}{'-died' if died else ''}"
        root.mkdir()
        run_dir = make_run_dir(root, summary=with_summary, store_format=fmt, died=died)
        with sqlite3.connect(run_dir / "counters.sqlite") as db:
            assert db.execute("SELECT value FROM meta WHERE key = 'format_version'"
                              ).fetchone() == (str(fmt),)
            if fmt == 2:
                (points,) = db.execute("SELECT sql FROM sqlite_master WHERE name = 'points'"
                                       ).fetchone()
                assert ("WITHOUT ROWID" in points) is not died
        texts.append(build_report(run_dir).md.read_text().replace(str(run_dir), "RUN"))
    assert texts[0] == texts[1] == texts[2]
    assert "## Queue depth" in texts[1] and "## Receive rates" in texts[1]


def _series_paths(svg: str, color: str) -> list[list[tuple[float, float]]]:
    """Vertices of each path drawn in `color`: the series first, then its legend sample."""
    out = []
    for d, style in re.findall(r'<path d="([^"]+)"[^>]*style="([^"]*)"', svg):
        if f"stroke: {color}" in style:
            nums = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", d)]
            out.append(list(zip(nums[::2], nums[1::2], strict=True)))
    return out


def test_plots_draw_steps_that_hold_each_value_until_the_next_point() -> None:
    # A queue that jumps to 5 KB at 1 us, then to 2 KB at 3 us and stays to 10 us.
    svg = plots.line_plot([Series("q", [(0, 0), (1000, 5000), (3000, 2000), (10_000, 2000)])],
                          "t", "t", "KB", 1e3, 10_000)
    line = _series_paths(svg, plots.SERIES_COLORS[0])[0]
    # step-post: each point's value holds until the next point's time, so every
    # segment is horizontal or vertical, never a slope between two points
    assert len(line) == 7
    for (x0, y0), (x1, y1) in zip(line, line[1:], strict=False):
        assert x0 == x1 or y0 == y1, line
    assert line[-1][0] > line[0][0] and line[-1][1] == line[-2][1]


def test_reduced_points_keep_where_the_series_ends() -> None:
    pts = [(i, float(i % 7)) for i in range(5000)] + [(10_000, 3.0)]
    reduced = plots.reduce_points(pts, limit=100)
    assert len(reduced) < 120 and reduced[-1] == (10_000, 3.0)
    assert max(v for _, v in reduced) == 6.0


def test_ports_table_lists_busiest_first_and_every_port_that_dropped(run_dir: Path) -> None:
    md = build_report(run_dir).md.read_text()
    section = md.split("## Per-port totals")[1].split("\n## ")[0]
    header, rows = _md_table(section)
    drops = header.index("drops")
    assert rows[0][:3] == ["leaf2:swp4", "TC3 roce", f"{(N_SAMPLES - 1) * HOT_BYTES_PER_SAMPLE:,}"]
    assert ["leaf1:swp1", "TC0 default"] == rows[-1][:2] and rows[-1][drops] == "3"
    assert all(r[2] != "0" for r in rows[:-1])           # idle ports are left out
    assert len(rows) <= 21


def test_fidelity_says_none_when_empty(run_dir: Path) -> None:
    summary = _summary(run_dir)
    summary["fidelity"] = []
    (run_dir / "summary.json").write_text(json.dumps(summary))
    paths = build_report(run_dir)
    assert "No fidelity loss detected." in paths.html.read_text()
    assert "No fidelity loss detected." in paths.md.read_text()


def test_interrupted_run_has_a_banner(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path, interrupted=True)
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    banner = re.search(r'<div class="banner interrupted"[^>]*>(.*?)</div>', html, re.S)
    assert banner and "interrupted" in banner.group(1)
    assert "SIGINT" in banner.group(1)
    assert "**INTERRUPTED**" in md


def test_missing_summary_is_rebuilt_from_counters(run_dir: Path) -> None:
    written = _summary(run_dir)
    (run_dir / "summary.json").unlink()
    with load_run(run_dir) as run:
        assert run.rebuilt
        rebuilt = run.summary
    assert rebuilt["ports"] == written["ports"]
    assert {k: rebuilt["totals"][k] for k in written["totals"]} == written["totals"]
    # the links' bytes are the ports' bytes, regrouped by link
    assert (rebuilt["totals"]["host_link_bytes"] + rebuilt["totals"]["fabric_link_bytes"]
            == sum(p["tx_bytes"] for p in rebuilt["ports"]))
    assert rebuilt["dilation"] == 2000 and rebuilt["lab"] == written["lab"]
    assert rebuilt["name"] == "incast" and rebuilt["interrupted"] is True
    assert rebuilt["workloads"] == written["workloads"]
    assert rebuilt["fidelity"] == written["fidelity"]
    paths = build_report(run_dir)
    html, md = paths.html.read_text(), paths.md.read_text()
    for text in (html, md):
        assert "incomplete run: summary rebuilt from counters" in text
        assert f"{_hot_port(written)['tx_bytes']:,}" in text
    assert 'class="banner interrupted"' in html
    assert not (run_dir / "summary.json").exists()     # the report does not invent a summary


def test_a_run_that_died_lasts_to_its_last_sample_even_if_nothing_changed(
        run_dir: Path) -> None:
    (run_dir / "summary.json").unlink()
    end = N_SAMPLES * PERIOD_NS
    writer = Store(run_dir / "counters.sqlite")
    try:
        # Three more samples in which nothing moved, and no final one: the writer died.
        for n in range(3):
            ts = end + n * PERIOD_NS
            writer.add_samples(ts, 10**12 + ts * 2000, [Sample(*HOT, "class_bytes", 1.0)])
        with load_run(run_dir) as run:
            assert run.summary["duration_fabric_ns"] == end + 2 * PERIOD_NS
            assert run.summary["duration_wall_s"] == pytest.approx(
                (end + 2 * PERIOD_NS) * 2000 / 1e9, abs=1e-3)
        md = build_report(run_dir).md.read_text()
        assert "**duration (fabric)**: 1.51 ms" in md and "## Queue depth" in md
    finally:
        writer.close()


@pytest.mark.parametrize("which", ["summary.json", "metadata.json", "plan.json"])
def test_newer_json_format_is_refused(run_dir: Path, which: str) -> None:
    data = json.loads((run_dir / which).read_text())
    data["format_version"] = 7
    (run_dir / which).write_text(json.dumps(data))
    with pytest.raises(RunFormatError, match=r"newer testbed \(format 7\); upgrade to read it"):
        build_report(run_dir)
    assert not (run_dir / "report.html").exists()


def test_newer_counters_format_is_refused(run_dir: Path) -> None:
    store = Store(run_dir / "counters.sqlite")
    store.set_meta("format_version", "3")
    store.close()
    (run_dir / "summary.json").unlink()
    with pytest.raises(RunFormatError, match=r"newer testbed \(format 3\)"):
        build_report(run_dir)


def test_not_a_run_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="not a run directory"):
        build_report(tmp_path)
    with pytest.raises(RunDirError, match="not a directory"):
        build_report(tmp_path / "nope")


def test_report_without_counters_uses_summary_alone(run_dir: Path) -> None:
    (run_dir / "counters.sqlite").unlink()
    paths = build_report(run_dir)
    html = paths.html.read_text()
    assert f"{_hot_port(_summary(run_dir))['tx_bytes']:,}" in html
    assert 'id="queues"' in html                # from max_queue_bytes, as a table
    assert 'id="rates"' not in html             # no time series


# --- pieces -------------------------------------------------------------------------------

def test_templates_ship_with_the_package() -> None:
    templates = importlib.resources.files("testbed.report") / "templates"
    assert (templates / "report.html.j2").is_file()
    assert (templates / "report.md.j2").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"*.j2"' in pyproject


def test_fabric_layers_leaf_spine_and_ring() -> None:
    layers = fabric_layers(_plan())
    assert layers is not None
    assert {layers[h] for h in ("h1", "h8")} == {0}
    assert layers["leaf1"] == layers["leaf2"] == 1
    assert layers["spine1"] == layers["spine2"] == 2
    ring = compile_plan(load_config(REPO / "tests/golden/ring.yaml"),
                        max_wall_port_rate_bps=BUDGET_BPS)
    assert fabric_layers(ring) is None          # drawn as a circle


# --- Prometheus ---------------------------------------------------------------------------

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
                   r'(?:\{(?P<labels>(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\})?'
                   r' (?P<value>[-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|NaN|Inf))$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A tiny parser of the text format: every non-comment line is `name{labels} value`."""
    out: dict[str, list] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            assert line.startswith("# HELP ") or not line, line
            continue
        m = _LINE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = {k: re.sub(r"\\(.)", lambda g: {"n": "\n"}.get(g.group(1), g.group(1)), v)
                  for k, v in _LABEL.findall(m.group("labels") or "")}
        assert m.group("name") in typed, f"{m.group('name')} has no TYPE line before it"
        out.setdefault(m.group("name"), []).append((labels, float(m.group("value"))))
    return out


def test_prometheus_values_equal_the_summary(run_dir: Path) -> None:
    out = run_dir / "metrics.prom"
    write_prometheus(run_dir, out)
    text = out.read_text()
    assert "# HELP testbed_port_tx_bytes_total " in text
    assert "# TYPE testbed_port_tx_bytes_total counter" in text
    metrics = parse_prometheus(text)
    summary = _summary(run_dir)
    by_port = {(p["node"], p["port"], str(p["tclass"])): p for p in summary["ports"]}
    for metric, field, scale in (("testbed_port_tx_bytes_total", "tx_bytes", 1),
                                 ("testbed_port_drops_total", "drops", 1),
                                 ("testbed_port_max_queue_bytes", "max_queue_bytes", 1),
                                 ("testbed_port_ecn_marks_total", "ecn_marks", 1),
                                 ("testbed_pfc_pause_tx_total", "pause_tx", 1),
                                 ("testbed_pfc_paused_fabric_seconds_total", "paused_ns", 1e-9)):
        samples = metrics[metric]
        assert len(samples) == len(summary["ports"])
        for labels, value in samples:
            assert labels["lab"] == summary["lab"]
            port = by_port[(labels["node"], labels["port"], labels["tclass"])]
            assert value == pytest.approx(port[field] * scale), (metric, labels)
    assert metrics["testbed_run_dilation"] == [({"lab": summary["lab"]}, 2000.0)]
    assert metrics["testbed_run_interrupted"] == [({"lab": summary["lab"]}, 0.0)]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert not out.with_name("metrics.prom.tmp").exists()


def test_prometheus_outside_the_run_dir_is_world_readable(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "textfile" / "testbed.prom"
    out.parent.mkdir()
    write_prometheus(run_dir, out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert parse_prometheus(out.read_text())["testbed_run_dilation"][0][1] == 2000


def test_prometheus_escapes_label_values() -> None:
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    summary = {"lab": 'we"ird\\lab', "name": "x\ny", "dilation": 10, "ports": [
        {"node": "n1", "port": 'p"1', "tclass": 3, "tx_bytes": 5, "drops": 0}]}
    metrics = parse_prometheus(prometheus_text(summary))
    (labels, value), = metrics["testbed_port_tx_bytes_total"]
    assert labels == {"lab": 'we"ird\\lab', "node": "n1", "port": 'p"1', "tclass": "3"}
    assert value == 5
    assert metrics["testbed_run_info"][0][0]["name"] == "x\ny"


# --- CLI ----------------------------------------------------------------------------------

def _cli(monkeypatch, argv: list[str]) -> int:
    import testbed.cli

    monkeypatch.setattr(testbed.cli, "VERBS", [*testbed.cli.VERBS, "report"]
                        if "report" not in testbed.cli.VERBS else testbed.cli.VERBS)
    return testbed.cli.main(argv)


def test_cli_writes_html_and_markdown(run_dir: Path, monkeypatch, capsys) -> None:
    assert _cli(monkeypatch, ["report", str(run_dir)]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(run_dir / "report.html"), str(run_dir / "report.md")]


def test_cli_prometheus_default_and_out(run_dir: Path, tmp_path: Path, monkeypatch,
                                        capsys) -> None:
    assert _cli(monkeypatch, ["report", str(run_dir), "--format", "prometheus"]) == 0
    assert (run_dir / "metrics.prom").is_file()
    target = tmp_path / "m.prom"
    assert _cli(monkeypatch, ["report", str(run_dir), "--format", "prometheus",
                              "--out", str(target)]) == 0
    assert target.read_text() == (run_dir / "metrics.prom").read_text()


def test_cli_refuses_non_run_dir_and_newer_format(run_dir: Path, tmp_path: Path,
                                                  monkeypatch, capsys) -> None:
    from testbed.cli import report

    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.run(argparse.Namespace(run_dir=str(empty), format="html", out=None)) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and len(err.strip().splitlines()) == 1
    data = _summary(run_dir)
    data["format_version"] = 2
    (run_dir / "summary.json").write_text(json.dumps(data))
    assert _cli(monkeypatch, ["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "upgrade to read it" in err and len(err.strip().splitlines()) == 1


def test_dcqcn_section_plots_each_qps_rate_only_when_roce_ran(run_dir: Path) -> None:
    build_report(run_dir)
    assert "DCQCN rates" not in (run_dir / "report.html").read_text()
    store = Store(run_dir / "counters.sqlite")
    # A RoCE client's Rc: line rate, cut twice by CNPs, then recovering.
    for i, rc in enumerate([100e9, 50e9, 25e9, 37.5e9, 68.75e9]):
        store.add_samples(i * 10_000, i, [Sample("h1", "roce-h1-h8", -1, "send.qp0.rc_bps", rc),
                                          Sample("h1", "roce-h1-h8", -1, "send.qp0.cnps", i)])
    store.close()
    build_report(run_dir)
    html = (run_dir / "report.html").read_text()
    md = (run_dir / "report.md").read_text()
    assert 'id="dcqcn"' in html and 'aria-label="DCQCN rate Rc per QP"' in html
    assert "&lt;svg" not in html          # the plot is markup, not escaped text
    assert "## DCQCN rates" in md
    row = next(line for line in md.splitlines() if "roce-h1-h8" in line and "|" in line)
    assert "25" in row and "68.75" in row    # lowest and final Rc, Gb/s


def test_the_invariants_table_names_each_verdict_and_the_worst_place(run_dir: Path) -> None:
    summary = _summary(run_dir)
    summary["invariants"] = {
        "checks": {
            "queue": {"label": "(a) the queue ECN and PFC decide on is the real queue",
                      "held": True, "samples": 300, "max_abs_diff_bytes": 9014,
                      "max_abs_diff_at": "leaf2:swp4 TC3", "tolerance_bytes": 18048},
            "lossless_drop": {"label": "(c) lossless classes lose nothing in a queue",
                              "held": False, "unprotected_drops": {}},
        },
        "violations": [{"invariant": "lossless_drop", "where": "spine1:swp2 TC3",
                        "amount": 17, "unit": "packets", "detail": "17 packets dropped (17 tail)",
                        "ts_fabric_ns": 812_000, "count": 1}],
        "streams": [],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    paths = build_report(run_dir)
    for text in (paths.html.read_text(), paths.md.read_text()):
        assert "VIOLATED" in text and "spine1:swp2 TC3" in text
        assert "17 packets dropped (17 tail)" in text
        assert "9.014 KB at leaf2:swp4 TC3 over 300 samples" in text
        # (a) before (c): rows in the invariants' order
        assert text.index("(a) the queue") < text.index("(c) lossless")
