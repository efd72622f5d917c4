"""ansible/: lint-clean, provision idempotent on this machine, a one-VM run end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from testbed.config.vms import load_vms_text
from testbed.net import destroy_lab
from testbed.net.namespaces import list_testbed_namespaces
from tests.conftest import REPO, unique_lab
from tests.integration.conftest import UNDERLAY_ADDRESSES, underlay_pair

ANSIBLE = REPO / "ansible"
VENV_BIN = REPO / ".venv" / "bin"
LOCAL = ANSIBLE / "inventories" / "local"
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)",
                   re.M)

SMALL = """\
name: {lab}
dilation: 1000
topology:
  kind: single_switch
  hosts: 3
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
    - name: incast
      kind: udp_incast
      senders: [h1, h2]
      receiver: h3
      tclass: roce
      duration: 1ms
"""


def _tool(name: str) -> Path:
    path = VENV_BIN / name
    if not path.exists():
        pytest.skip(f"{path} is missing: run `make setup` (the dev extra installs it)")
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", NO_COLOR="1")
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    return env


def _playbook(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ansible-playbook from the checkout; (result, {host: recap counts})."""
    res = subprocess.run([str(_tool("ansible-playbook")), *args], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=timeout)
    recap = {m[1]: {"ok": int(m[2]), "changed": int(m[3]), "unreachable": int(m[4]),
                    "failed": int(m[5])} for m in RECAP.finditer(res.stdout)}
    return res, recap


def _recap_line(out: str) -> str:
    return next((line for line in out.splitlines() if RECAP.match(line)), "<no recap>")


def _makefile_list(name: str) -> list[str]:
    """The words of a Makefile variable, with its `+=` lines and continuations."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    words: list[str] = []
    for m in re.finditer(rf"^{name}\s*(:=|\+=)(.*)$", text, re.M):
        words = (words if m[1] == "+=" else []) + m[2].split()
    return words


def test_role_apt_packages_are_the_makefiles():
    defaults = yaml.safe_load(
        (ANSIBLE / "roles/testbed_provision/defaults/main.yml").read_text())
    assert defaults["testbed_provision_apt_packages"] == _makefile_list("APT_PACKAGES")
    assert defaults["testbed_provision_apt_optional"] == _makefile_list("APT_OPTIONAL")


@pytest.mark.slow
def test_ansible_lint_production_profile():
    res = subprocess.run([str(_tool("ansible-lint"))], cwd=ANSIBLE, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Profile 'production' was required, and it passed" in res.stdout + res.stderr


@pytest.mark.root
@pytest.mark.slow
def test_provision_local_twice_second_changes_nothing(capsys):
    stamps_before = set((REPO / ".venv").glob(".testbed-ansible-*"))
    try:
        t0 = time.monotonic()
        first, recap1 = _playbook("-i", str(LOCAL), str(ANSIBLE / "playbooks/provision.yml"))
        t1 = time.monotonic()
        second, recap2 = _playbook("-i", str(LOCAL), str(ANSIBLE / "playbooks/provision.yml"))
        t2 = time.monotonic()
    finally:
        # the install stamp is the provision's; one this test made goes again
        for stamp in set((REPO / ".venv").glob(".testbed-ansible-*")) - stamps_before:
            stamp.unlink()
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr
    assert recap1["localhost"]["failed"] == 0 and recap1["localhost"]["unreachable"] == 0
    assert recap2["localhost"] == {**recap2["localhost"], "failed": 0, "changed": 0}, \
        _recap_line(second.stdout) + "\n" + second.stdout[-4000:]
    with capsys.disabled():
        print(f"\nprovision 1 ({t1 - t0:.1f} s): {_recap_line(first.stdout)}"
              f"\nprovision 2 ({t2 - t1:.1f} s): {_recap_line(second.stdout)}")


@pytest.mark.root
@pytest.mark.slow
def test_run_on_one_vm_fetches_the_run_directory(tmp_path, capsys):
    lab = unique_lab("ansrun")
    config = tmp_path / "small.yaml"
    config.write_text(SMALL.format(lab=lab))
    fetch, work, calibration = tmp_path / "fetch", tmp_path / "work", tmp_path / "cal.json"
    extra = {"testbed_config": str(config), "testbed_fetch_dir": str(fetch),
             "testbed_work_dir": str(work), "testbed_calibration_file": str(calibration),
             # a short calibration: 2 hosts (4 ports), 0.5 s per trial
             "testbed_run_calibrate_args": ["--hosts", "2", "--seconds", "0.5"]}
    t0 = time.monotonic()
    try:
        res, recap = _playbook("-i", str(LOCAL), str(ANSIBLE / "playbooks/run.yml"),
                               "-e", json.dumps(extra))
    finally:
        destroy_lab(lab)
    seconds = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr
    assert recap["localhost"]["failed"] == 0
    assert not [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}")]

    runs = [d for d in fetch.iterdir() if d.is_dir()]
    assert len(runs) == 1 and runs[0].name.endswith(f"-{lab}"), runs
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["name"] == lab and summary["interrupted"] is False
    assert (runs[0] / "counters.sqlite").stat().st_size > 0

    # The VMs file: valid, one VM, its budget from the calibration this run stored.
    cal = json.loads(calibration.read_text())
    vms_text = (fetch / f"{lab}.vms.yaml").read_text()
    vms = load_vms_text(vms_text, "vms.yaml").vms_file.vms
    cpus = sum(line.startswith("processor") for line in open("/proc/cpuinfo"))
    assert [vm.name for vm in vms] == ["localhost"]
    assert vms[0].cores == cpus
    assert vms[0].wall_rate_budget_bps == cal["max_wall_port_rate_bps"] * 2 * cal["hosts"]
    assert vms[0].mtu_bytes is None or vms[0].mtu_bytes >= 576
    with capsys.disabled():
        print(f"\nrun.yml, one VM ({seconds:.1f} s): {_recap_line(res.stdout)}; calibrated "
              f"{cal['max_wall_port_rate_bps'] / 1e6:g} Mb/s per port\n{vms_text}")


@pytest.mark.root
@pytest.mark.slow
def test_run_on_two_vms_runs_each_part_and_merges_them_into_one_run_directory(tmp_path):
    """Two inventory hosts on this machine stand in for two VMs: each its own state
    directory, calibration and underlay namespace (joined by a veth, MTU 9100). run.yml
    writes the VMs file from them, runs each VM's part of the default fabric's workload
    from one common start (`testbed run --vms --vm`), stops both once both VMs' senders
    are done, fetches both part run directories and merges them on the controller; the
    merged run covers all 12 nodes and every stream, and nothing is left up."""
    lab = unique_lab("ans2vm")
    doc = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    doc["name"] = lab      # dilation: auto, pinned by run.yml to the slowest VM's budget
    config = tmp_path / "split.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    hosts = {}
    fetch = tmp_path / "fetch"
    port_bps = {"vm1": 250_000_000, "vm2": 150_000_000}     # each VM's calibration
    try:
        with underlay_pair(lab) as underlay:
            for vm, netns in underlay.items():
                calibration = tmp_path / f"{vm}-cal.json"   # present: run.yml won't calibrate
                calibration.write_text(json.dumps({"max_wall_port_rate_bps": port_bps[vm],
                                                   "hosts": 4}))
                hosts[vm] = {"ansible_connection": "local",
                             "ansible_python_interpreter": "/usr/bin/python3",
                             "testbed_dir": str(REPO), "testbed_venv": str(REPO / ".venv"),
                             "testbed_work_dir": str(tmp_path / f"{vm}-work"),
                             "testbed_calibration_file": str(calibration),
                             "testbed_state_dir": str(tmp_path / f"{vm}-state"),
                             "testbed_underlay_interface": "none",
                             "testbed_underlay_address": UNDERLAY_ADDRESSES[vm][1],
                             "testbed_run_underlay_netns": netns}
            inventory = tmp_path / "hosts.yml"
            inventory.write_text(yaml.safe_dump({"testbed_vms": {"hosts": hosts}}))
            res, recap = _playbook("-i", str(inventory), str(ANSIBLE / "playbooks/run.yml"),
                                   "-e", json.dumps({"testbed_config": str(config),
                                                     "testbed_fetch_dir": str(fetch),
                                                     "testbed_run_start_margin_s": 12}),
                                   timeout=600)
    finally:
        for vm in ("vm1", "vm2"):
            subprocess.run([str(VENV_BIN / "testbed"), "down", lab], capture_output=True,
                           env=dict(os.environ, TESTBED_STATE_DIR=str(tmp_path / f"{vm}-state")))
    out = res.stdout
    assert res.returncode == 0, out[-6000:] + res.stderr
    assert recap["vm1"]["failed"] == recap["vm2"]["failed"] == 0, recap
    assert not [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}-")]
    parts = sorted(p.name for p in (fetch / "parts").iterdir())
    assert parts == ["vm1", "vm2"]
    merged = [d for d in fetch.iterdir() if d.is_dir() and d.name.endswith(f"-{lab}")]
    assert len(merged) == 1, list(fetch.iterdir())
    summary = json.loads((merged[0] / "summary.json").read_text())
    assert len({p["node"] for p in summary["ports"]}) == 12
    assert [p["vm"] for p in summary["parts"]] == ["vm1", "vm2"]
    rows = [r for w in summary["workloads"] for r in w["results"]]
    assert sorted(r["src"] for r in rows) == ["h1", "h2", "h5", "h6"]
    assert all(r["rx_packets"] == r["tx_packets"] > 0 for r in rows), rows
    assert (merged[0] / "report.html").exists()
    # auto took the slower VM's 150 Mb/s per port for both: a 400G port at D = 5000
    assert summary["dilation"] == 5000
    pinned = yaml.safe_load((fetch / f"{lab}.fabric.yaml").read_text())
    assert pinned["max_wall_port_rate"] == 150_000_000 and pinned["dilation"] == "auto"
    vms = load_vms_text((fetch / f"{lab}.vms.yaml").read_text(), "vms.yaml")
    assert [(v.name, str(v.underlay)) for v in vms.vms_file.vms] == [
        ("vm1", "192.0.2.11"), ("vm2", "192.0.2.12")]
