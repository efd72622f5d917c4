"""`testbed run` end to end: counters agree with agents, interrupts and kills leave no trace."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.config import load_config_text
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import REPO, unique_lab

pytestmark = pytest.mark.root

INCAST = """\
name: {lab}
dilation: 1000
topology:
  kind: single_switch
  hosts: 5
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
    - name: incast
      kind: udp_incast
      senders: [h1, h2, h3, h4]
      receiver: h5
      tclass: roce
      duration: {duration}
"""


def _incast(duration: str = "2ms") -> tuple:
    lab = unique_lab("inc")
    loaded = load_config_text(INCAST.format(lab=lab, duration=duration), "incast.yaml")
    return loaded, compile_plan(loaded)


def _netns_of(lab: str) -> list[str]:
    return [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]


def test_incast_counters_agree_with_the_agents(tmp_path):
    loaded, plan = _incast()
    result = run_config(loaded, plan, RunOptions(runs_root=tmp_path, say=lambda _m: None))
    run_dir = result.run_dir
    assert not _netns_of(plan.lab)
    for name in ("config.yaml", "plan.json", "metadata.json", "counters.sqlite",
                 "summary.json"):
        assert (run_dir / name).exists(), name
    assert oct((run_dir).stat().st_mode & 0o777) == "0o700"
    assert oct((run_dir / "counters.sqlite").stat().st_mode & 0o777) == "0o600"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is False
    rows = summary["workloads"][0]["results"]
    assert len(rows) == 4
    store = Store(run_dir / "counters.sqlite")
    last = store.last_values("class_bytes")
    packets = store.last_values("class_packets")
    # Each sender's NIC class counted exactly what its agent sent (+42 B of
    # UDP/IP/Ethernet headers per packet, which the kernel counts in skb->len).
    for row in rows:
        nic = (row["src"], "eth0", 3)
        assert packets[nic] == pytest.approx(row["tx_packets"], rel=0.01)
        assert last[nic] == pytest.approx(row["tx_bytes"] + 42 * row["tx_packets"], rel=0.01)
    # The switch port to the receiver dequeued what the receiver got.
    rx_packets = sum(r["rx_packets"] for r in rows)
    rx_bytes = sum(r["rx_bytes"] for r in rows)
    assert packets[("sw1", "swp5", 3)] == pytest.approx(rx_packets, rel=0.01)
    assert last[("sw1", "swp5", 3)] == pytest.approx(rx_bytes + 42 * rx_packets, rel=0.01)
    # 4:1 at line rate: the receiver's switch port queued; PFC (on by default
    # for the lossless class) kept it from dropping.
    backlog = store.series("backlog_bytes", node="sw1", port="swp5", tclass=3)
    assert max(v for _, v in backlog[("sw1", "swp5", 3)]) > 100_000
    assert summary["totals"]["drops"] == 0
    assert summary["totals"]["pause_frames"] > 0
    # summary.json's totals are the database's.
    assert summary["totals"]["tx_bytes"] == sum(int(v) for v in last.values())
    drops = sum(int(v) for c in ("class_drops", "tail_drops", "mmu_drops", "desc_drops",
                                 "bpf_drops") for v in store.last_values(c).values())
    assert summary["totals"]["drops"] == drops
    port = next(p for p in summary["ports"] if (p["node"], p["port"], p["tclass"])
                == ("sw1", "swp5", 3))
    # the largest queue is the port program's exact peak; no sample of the kernel's
    # backlog can be above it
    peak = store.last_values("max_vq_bytes")[("sw1", "swp5", 3)]
    assert port["max_queue_bytes"] == peak >= max(int(v) for _, v in backlog[("sw1", "swp5", 3)])
    # The receiver's link ran at its line rate while backlogged.
    total_rx_bps = sum(r["rx_fabric_bps"] for r in rows)
    assert total_rx_bps == pytest.approx(100e9, rel=0.05)
    store.close()
    # timings.json: every stage of a whole run once, one after another, the builder's
    # steps of `up`, and no sender ready after the common start went unnamed
    timings = json.loads((run_dir / "timings.json").read_text())
    phases = [p["phase"] for p in timings["phases"]]
    assert phases == ["prepare", "up", "fabric_agents", "workload_agents", "start_margin",
                      "workload", "drain", "stop_agents", "results", "down", "summary",
                      "report"]
    for before, after in zip(timings["phases"], timings["phases"][1:], strict=False):
        assert before["start_mono_ns"] <= before["end_mono_ns"] <= after["start_mono_ns"]
    assert "port programs" in timings["up_steps"]
    assert timings["fixed_cost_s"] == pytest.approx(
        sum(v for k, v in timings["seconds"].items() if k != "workload"), abs=1e-5)
    # the senders got ready files and were ready by t0 (else a note names them)
    assert len(list((run_dir / "agents").glob("incast-*.ready"))) == 5


def _start_run(config: Path, runs: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "testbed", "run", str(config),
                             "--runs-dir", str(runs)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_samples(runs: Path, timeout_s: float = 30) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for db in runs.glob("*/counters.sqlite"):
            try:
                with sqlite3.connect(db) as con:
                    taken = con.execute("SELECT COUNT(*) FROM sample_times").fetchone()[0]
                    if taken >= 4:
                        return db.parent
            except sqlite3.Error:
                pass
        time.sleep(0.1)
    raise AssertionError("the run never wrote samples")


def test_sigint_stops_cleanly_and_reports_interrupted(tmp_path):
    lab = unique_lab("sint")
    config = tmp_path / "incast.yaml"
    config.write_text(INCAST.format(lab=lab, duration="20ms"))   # 20 s of wall time
    proc = _start_run(config, tmp_path / "runs")
    try:
        run_dir = _wait_for_samples(tmp_path / "runs")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert not _netns_of(lab)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["duration_fabric_ns"] < 20_000_000
    # No agent survived: nothing of ours runs in any namespace of the lab.
    leftovers = subprocess.run(["pgrep", "-f", f"agents.udp.*{run_dir.name}"],
                               capture_output=True, text=True).stdout.split()
    assert leftovers == []
    # agents forked from the run's zygote carry the zygote's command line (--lab=LAB)
    forked = subprocess.run(["pgrep", "-f", f"agents.runtime.zygote .*--lab={lab} "],
                            capture_output=True, text=True).stdout.split()
    assert forked == []
    report = run_dir / "report.html"
    if report.exists():
        assert "interrupted" in report.read_text().lower()


def test_sigkilled_run_is_cleaned_by_down_and_its_data_survives(tmp_path):
    # `down LAB`, not `down --all`: --all also removes every tb- namespace on the machine,
    # which would tear down labs of other runs going on beside this test
    lab = unique_lab("skil")
    config = tmp_path / "incast.yaml"
    config.write_text(INCAST.format(lab=lab, duration="20ms"))
    proc = _start_run(config, tmp_path / "runs")
    try:
        run_dir = _wait_for_samples(tmp_path / "runs")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _netns_of(lab), "the killed run should have left its fabric up"
    res = subprocess.run([sys.executable, "-m", "testbed", "down", lab], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert not _netns_of(lab)
    # Agents were recorded by pid and ended by `down`.
    time.sleep(0.2)
    leftovers = subprocess.run(["pgrep", "-f", f"agents.udp.*{run_dir.name}"],
                               capture_output=True, text=True).stdout.split()
    assert leftovers == []
    # agents forked from the run's zygote carry the zygote's command line (--lab=LAB)
    forked = subprocess.run(["pgrep", "-f", f"agents.runtime.zygote .*--lab={lab} "],
                            capture_output=True, text=True).stdout.split()
    assert forked == []
    store = Store(run_dir / "counters.sqlite")
    assert store.counters()
    assert len(store.sample_times()) >= 3
    store.close()
