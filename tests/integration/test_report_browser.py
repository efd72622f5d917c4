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
from tests.unit.test_report import HOT_BYTES_PER_SAMPLE, N_SAMPLES, make_run_dir

CHROMIUM = Path("/usr/bin/chromium")
COMMON_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--hide-scrollbars"]


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


def _chromium(chromium: Path, profile: Path, extra: list[str], page: Path
              ) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(chromium), *COMMON_FLAGS, f"--user-data-dir={profile}", *extra,
         page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)


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
