"""Under Debian's Mininet the exported default fabric starts and every host reaches
every other host (`testbed mininet configs/default.yaml --batch`'s runner, under
/usr/bin/python3). Skips only where Mininet is not installed (`make test` installs it).

Mininet's nodes are shells in unnamed namespaces: the runner records every shell and
kills any left after net.stop(), and reports how many survived; `mn -c` (which kills
by name and touches global state) is never used. This kernel may lack sch_netem: the
test runs with netem=0 there, as `testbed mininet` does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from testbed.cli.mininet import MININET_PYTHON, RUNNER, mininet_available
from testbed.config import load_config
from testbed.export.mininet_topo import export_mininet, topo_name
from testbed.net.probe import kernel_config_has
from testbed.plan import compile_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.root
def test_exported_default_fabric_reaches_every_host(tmp_path: Path) -> None:
    why = mininet_available()
    if why:
        pytest.skip(why)
    plan = compile_plan(load_config(REPO / "configs/default.yaml"))
    topo = tmp_path / "topo.py"
    topo.write_text(export_mininet(plan))
    netem = kernel_config_has("netem") is not False
    cmd = [MININET_PYTHON, str(RUNNER), str(topo), topo_name(plan), "--batch"]
    proc = subprocess.Popen(cmd + ([] if netem else ["--no-netem"]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:     # the runner tears its network down on SIGTERM
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result = json.loads(out.strip().splitlines()[-1])
    hosts = len(plan.hosts())
    assert result["leftover_shells"] == 0, err
    assert result["netem"] == netem
    assert result["pairs"] == hosts * (hosts - 1) and result["failed"] == [], err
    assert proc.returncode == 0, err
