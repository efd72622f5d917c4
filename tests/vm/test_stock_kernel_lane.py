"""The stock-kernel lane: the integration tests marked `stock_kernel` (rxe endpoints,
netem delay, the RED marker), run inside a qemu VM booting Debian's stock kernel when
this kernel lacks what they need. On a kernel that has it all they ran natively with
the rest of the suite and this test skips; it skips with the named reason only when
qemu cannot run here. What the lane covered is printed as a table.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.root, pytest.mark.slow]

LANE_FEATURES = ("rdma_rxe", "netem", "red")
LANE_TIMEOUT_S = 15 * 60


def _host_has_everything() -> tuple[bool, list[str]]:
    from testbed.net.probe import probe

    found = {f.name: f.present for f in probe()}
    missing = [f for f in LANE_FEATURES if not found.get(f)]
    return not missing, missing


def _outcomes(junit: Path) -> list[tuple[str, str, float, str]]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error"}.get(tag, tag)
                detail = el.get("message") or ""
        rows.append((name, outcome, float(case.get("time", 0) or 0), detail))
    return rows


def test_stock_kernel_lane(tmp_path, request, monkeypatch):
    if os.environ.get("TESTBED_VM") == "1":
        pytest.skip("this is the VM: the stock_kernel tests run here directly")
    complete, missing = _host_has_everything()
    if complete:
        pytest.skip("this kernel has rdma_rxe, netem and red: the stock_kernel tests ran "
                    "natively in this session")
    # The BPF objects are compiled here, once: clang under TCG would take minutes.
    from testbed.net.portprog import ensure_object
    from testbed.net.rxecc import ensure_rxe_cc_object
    from testbed.vm.kernel import VmSetupError
    from testbed.vm.runner import run_in_vm

    ensure_object()
    ensure_rxe_cc_object()
    junit = tmp_path / "lane.xml"
    log = tmp_path / "console.txt"
    # Only the modules that hold stock_kernel tests: collecting the rest costs a minute
    # and more under TCG, for nothing.
    modules = sorted(str(p.relative_to(REPO))
                     for p in (REPO / "tests/integration").glob("test_*.py")
                     if "stock_kernel" in p.read_text())
    assert modules, "no integration module marks a test stock_kernel"
    argv = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
            "-m", "stock_kernel", f"--junitxml={junit}", *modules]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    said: list[str] = []          # the VM's own lines (accelerator, vCPUs) for a failure

    def say(msg: str) -> None:
        said.append(msg)
        if reporter is not None:
            reporter.write_line(msg)

    say(f"\nVM lane: this kernel lacks {', '.join(missing)}; running the stock_kernel "
        "tests inside a VM (Debian's stock kernel, qemu)")
    monkeypatch.chdir(REPO)
    try:
        with open(log, "w") as out:
            rc = run_in_vm(argv, rw=[tmp_path], out=out, say=say, label="lane",
                           timeout_s=LANE_TIMEOUT_S)
    except VmSetupError as exc:
        pytest.skip(f"qemu cannot run here: {exc}")
    text = log.read_text(errors="replace")
    assert junit.exists(), f"the lane wrote no results (exit {rc}); console:\n{text[-4000:]}"
    rows = _outcomes(junit)
    say(f"VM lane covered {len(rows)} test(s) on the stock kernel:")
    for name, outcome, seconds, detail in rows:
        short = detail.splitlines()[0][:120] if detail else ""
        say(f"  {outcome:7s} {seconds:7.1f}s  {name}" + (f"  ({short})" if short else ""))
    assert rc != 5 and rows, "the VM lane collected no stock_kernel test"
    bad = [r for r in rows if r[1] in ("failed", "error")]
    # each failure's own message last, where CI's log tail keeps it
    why = "\n".join(f"--- {name}:\n{detail[-2500:]}" for name, _o, _s, detail in bad)
    assert rc == 0 and not bad, (f"VM lane failures; console tail:\n{text[-3000:]}\n"
                                 f"{chr(10).join(m for m in said if m.startswith('vm:'))}"
                                 f"\nfailures (exit {rc}):\n{why}")
    # inside the VM every feature is there: a skip there means a test could not run
    skipped = [r for r in rows if r[1] == "skipped"]
    assert not skipped, f"tests skipped inside the VM: {skipped}"
