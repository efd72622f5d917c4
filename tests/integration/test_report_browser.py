"""The report opens in a real browser, offline: headless Chromium renders it.

No root needed. Chromium is installed by `make test`; without it the test
skips on a workstation, but fails under CI (env CI set), where a silent skip
would hide a missing dependency.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from testbed.report import build_report
from testbed.report.screenshot import CHROMIUM, run_chromium
from testbed.report.screenshot import main as screenshot_main
from tests.unit.test_report import HOT_BYTES_PER_SAMPLE, N_SAMPLES, make_run_dir
from tests.unit.test_report_incident import VERDICT, add_faults, set_verdict


@pytest.fixture(scope="module")
def chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing under CI; `make test` installs the chromium package")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    run_dir = make_run_dir(tmp_path_factory.mktemp("runs"))
    return build_report(run_dir).html


@pytest.fixture(scope="module")
def incident_run(tmp_path_factory) -> Path:
    """An incident run: three faults in its store, a verdict in its summary."""
    run_dir = make_run_dir(tmp_path_factory.mktemp("runs"), name="incast-hol")
    add_faults(run_dir)
    set_verdict(run_dir, VERDICT)
    return run_dir


def _chromium(chromium: Path, profile: Path, extra: list[str], page: Path
              ) -> subprocess.CompletedProcess:
    return run_chromium(page, extra, profile, chromium)


def test_report_renders_in_chromium_without_errors(chromium: Path, report: Path,
                                                   tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    res = _chromium(chromium, tmp_path / "profile",
                    [f"--screenshot={shot}", "--window-size=1280,2000",
                     "--enable-logging=stderr", "--v=0"], report)
    assert shot.is_file(), f"no screenshot; chromium said:\n{res.stderr[-2000:]}"
    page_errors = [line for line in res.stderr.splitlines()
                   if "Uncaught" in line or ("CONSOLE" in line and report.name in line)]
    assert not page_errors, "\n".join(page_errors)
    pixels = mpimg.imread(shot)
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1000
    rgb = (pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 50, f"screenshot looks blank: {len(colours)} distinct colours"
    ink = np.mean(rgb.min(axis=1) < 200)           # pixels clearly darker than the page
    assert ink > 0.01, f"screenshot is almost empty: {ink:.2%} ink"


def test_key_numbers_read_back_from_the_rendered_page(chromium: Path, report: Path,
                                                      tmp_path: Path) -> None:
    res = _chromium(chromium, tmp_path / "profile", ["--dump-dom"], report)
    dom = res.stdout
    assert "<svg" in dom, f"no DOM dumped; chromium said:\n{res.stderr[-2000:]}"
    busiest = (N_SAMPLES - 1) * HOT_BYTES_PER_SAMPLE
    ports = dom[dom.index('id="ports"'):]
    row = re.search(r"<tr><td>leaf2:swp4</td><td>TC3 roce</td>"
                    r'<td class="num">([0-9,]+)</td>', ports)
    assert row, "per-port row of leaf2:swp4 not found in the rendered page"
    assert int(row.group(1).replace(",", "")) == busiest
    assert "D = 2000" in dom
    results = re.findall(r"<tr><td>(h\d)</td><td>h8</td>", dom)
    assert results == [f"h{i}" for i in range(1, 8)]
    assert 'id="queues"' in dom and 'id="pfc"' in dom and 'id="fabric"' in dom


def test_incident_report_shows_the_verdict_banner_and_fault_markers(
        chromium: Path, incident_run: Path, tmp_path: Path) -> None:
    page = build_report(incident_run).html
    dom = _chromium(chromium, tmp_path / "profile", ["--dump-dom"], page).stdout
    assert "<svg" in dom, "no DOM dumped"
    banner = re.search(r'<section id="verdict" class="verdict-banner ok"[^>]*>(.*?)</section>',
                       dom, re.S)
    assert banner, "verdict banner missing from the rendered page"
    assert dom.index('id="verdict"') < dom.index("<nav>")      # at the very top
    assert re.search(r'id="verdict-status"[^>]*>REPRODUCED, as expected<', banner.group(1))
    assert 'id="verdict-predicates"' in banner.group(1) and "victim starved" in banner.group(1)
    evidence = re.search(r'<div id="evidence">.*?<svg[^>]*aria-label="pauses spread to the '
                         r'spine".*?</svg>', banner.group(1), re.S)
    assert evidence, "evidence plot missing from the banner"
    assert len(re.findall(r'class="fault-marker"', evidence.group(0))) == 3
    # every time plot of the page carries the three faults
    svgs = re.findall(r"<svg[^>]*>.*?</svg>", dom, re.S)
    timed = [svg for svg in svgs if "fabric time" in svg]
    assert len(timed) >= 5
    for svg in timed:
        assert sorted(set(re.findall(r'class="fault-marker" data-fault="(\d+)"', svg))) == \
            ["1", "2", "3"]
    faults = re.search(r'<section id="faults">.*?</section>', dom, re.S)
    assert faults and "link leaf2-spine1 down (both directions)" in faults.group(0)


def test_screenshot_command_writes_a_png_of_the_incident_report(
        chromium: Path, incident_run: Path, tmp_path: Path) -> None:
    shot = tmp_path / "incident.png"
    assert screenshot_main([str(incident_run), str(shot), "--height", "1400", "--rebuild",
                            "--chromium", str(chromium)]) == 0
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (1400, 1280)
    rgb = (pixels[..., :3] * 255).astype(np.uint8)
    # the banner of a verdict that held as expected is green (#dafbe1) near the top
    top = rgb[:700].reshape(-1, 3)
    green = np.mean(np.all(np.abs(top.astype(int) - [0xda, 0xfb, 0xe1]) <= 3, axis=1))
    assert green > 0.05, f"no green verdict banner in the screenshot ({green:.1%})"
    # and the fault markers' colour is drawn (the evidence plot is in the top 1400 px)
    marker = np.mean(np.all(np.abs(rgb.reshape(-1, 3).astype(int) - [0x7a, 0x01, 0x77]) <= 40,
                            axis=1))
    assert marker > 0.0002, f"no fault marker pixels ({marker:.3%})"
