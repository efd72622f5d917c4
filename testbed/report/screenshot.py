"""A PNG screenshot of a run's report.html in headless Chromium (for docs and tests).

    python -m testbed.report.screenshot RUN_DIR OUT.png [--width 1280] [--height 2000]

Writes the report first when the run directory has none (or with --rebuild). The
page opens from the file, offline, in a throw-away profile, with the flags the
browser test uses (COMMON_FLAGS), so a screenshot in the docs is what that test sees.
Exit codes: 0 written, 1 Chromium failed or wrote nothing, 2 not a run directory or
no Chromium.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
#: Headless, no network, no GPU, nothing shown besides the page.
COMMON_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--hide-scrollbars"]


class ScreenshotError(RuntimeError):
    """Chromium did not write the screenshot; the message holds the end of its stderr."""


def run_chromium(page: Path, extra: list[str], profile: Path,
                 chromium: Path = CHROMIUM, timeout_s: float = 120.0
                 ) -> subprocess.CompletedProcess:
    """Chromium on one local page with COMMON_FLAGS, a profile directory and `extra`."""
    return subprocess.run(
        [str(chromium), *COMMON_FLAGS, f"--user-data-dir={profile}", *extra,
         Path(page).resolve().as_uri()],
        capture_output=True, text=True, timeout=timeout_s, check=False)


def screenshot(page: Path, out: Path, width: int = 1280, height: int = 2000,
               chromium: Path = CHROMIUM) -> Path:
    """Write a width x height PNG of the top of `page` to `out`; raises ScreenshotError."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="testbed-chromium-") as profile:
        res = run_chromium(page, [f"--screenshot={out}", f"--window-size={width},{height}"],
                           Path(profile), chromium)
    if not out.is_file() or out.stat().st_size == 0:
        raise ScreenshotError(f"chromium wrote no screenshot (exit {res.returncode}): "
                              f"{res.stderr[-1500:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.report.screenshot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1280, help="window width (px)")
    parser.add_argument("--height", type=int, default=2000,
                        help="window height (px): the screenshot shows the page's top this tall")
    parser.add_argument("--rebuild", action="store_true",
                        help="write report.html again even if the run directory has one")
    parser.add_argument("--chromium", type=Path, default=CHROMIUM, help="the browser binary")
    args = parser.parse_args(argv)

    from testbed.report import RunDirError, build_report

    if not args.chromium.exists():
        print(f"{args.chromium}: not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    page = args.run_dir / "report.html"
    try:
        if args.rebuild or not page.exists():
            page = build_report(args.run_dir).html
    except RunDirError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        out = screenshot(page, args.out, args.width, args.height, args.chromium)
    except (ScreenshotError, subprocess.TimeoutExpired) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
