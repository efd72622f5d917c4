"""`testbed mininet FILE [--batch]`: build a fabric with Debian's Mininet and open its CLI.

Exports the fabric (as `testbed export mininet`) to a temporary module and runs
testbed/export/mininet_runner.py under the system Python, where `mininet` imports.
Without sch_netem in the kernel the links keep their rates but lose their delay, loss
and queue (the Topo's netem=0), and this says so.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from testbed.cli.common import EXIT_FAIL, EXIT_OK, CliError, load_and_plan, require_root
from testbed.export.mininet_topo import export_mininet, topo_name
from testbed.net.probe import kernel_config_has

MININET_PYTHON = "/usr/bin/python3"
RUNNER = Path(__file__).resolve().parents[1] / "export" / "mininet_runner.py"


def add_parser(sub):
    p = sub.add_parser("mininet", help="build a fabric with Mininet and open its CLI (root)")
    p.add_argument("file", help="fabric YAML file")
    p.add_argument("--batch", action="store_true",
                   help="no CLI: check every host reaches every other, then exit")
    return p


def mininet_available() -> str | None:
    """None when the system Python imports mininet, else why not."""
    try:
        out = subprocess.run([MININET_PYTHON, "-c", "import mininet.net"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{MININET_PYTHON}: {exc}"
    return None if out.returncode == 0 else (
        f"{MININET_PYTHON} cannot import mininet (apt-get install mininet): "
        f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")


def run(args) -> int:
    try:
        require_root("mininet")
        _, plan = load_and_plan(args.file)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    missing = mininet_available()
    if missing:
        print(f"mininet: {missing}", file=sys.stderr)
        return EXIT_FAIL
    netem = kernel_config_has("netem") is not False
    if not netem:
        print("mininet: this kernel has no sch_netem: links keep their rates (HTB) but not "
              "their delay, loss or queue size (topology netem=0)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="testbed-mininet-") as tmp:
        topo = Path(tmp) / "topo.py"
        topo.write_text(export_mininet(plan, source=Path(args.file).name))
        cmd = [MININET_PYTHON, str(RUNNER), str(topo), topo_name(plan)]
        cmd += (["--batch"] if args.batch else []) + ([] if netem else ["--no-netem"])
        rc = subprocess.run(cmd).returncode
    return EXIT_OK if rc == 0 else EXIT_FAIL
