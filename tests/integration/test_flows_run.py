"""`kind: flows` end to end on real namespaces: one flow at a time on an idle fabric
completes in its ideal time (slowdown 1.0-1.1), an 8:1 incast of 1 MB flows on one
100G switch finishes with PFC holding the lossless class, and a generated web-search
workload writes flows.csv, HPCC's fct.txt, the database's flows table and the report's
FCT section, with every packet accounted for."""

from __future__ import annotations

import csv

import pytest

from testbed.config import load_config_text
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import compile_plan
from testbed.results.flows import FLOWS_CSV_HEADER
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

SINGLE = """\
name: {lab}
dilation: {dilation}
topology:
  kind: single_switch
  hosts: {hosts}
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
{traffic}
"""


def _run(tmp_path, name: str, traffic: str, hosts: int = 4, dilation: int = 1000):
    lab = unique_lab(name)
    loaded = load_config_text(SINGLE.format(lab=lab, hosts=hosts, dilation=dilation,
                                            traffic=traffic), f"{name}.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path, say=lambda _m: None))
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
    return result


def _rows(run_dir) -> list[dict]:
    with open(run_dir / "results" / "flows.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_flow_alone_on_an_idle_fabric_takes_its_ideal_time(tmp_path) -> None:
    """Flows of 256 KB to 4 MB, one at a time, each well after the previous one ended:
    each completes within 10 % of its ideal FCT (the base RTT plus its wire bytes at
    line rate)."""
    sizes = ["256KB", "1MB", "4MB"]
    flows = "\n".join(f"        - {{src: h1, dst: h2, size: {s}, start: {100 + 800 * i}us}}"
                      for i, s in enumerate(sizes))
    result = _run(tmp_path, "flalone", f"    - name: alone\n      kind: flows\n"
                                       f"      flows:\n{flows}", hosts=2, dilation=2000)
    rows = _rows(result.run_dir)
    assert [int(r["size_bytes"]) for r in rows] == [256_000, 1_000_000, 4_000_000]
    for r in rows:
        assert r["fct_ns"], r
        assert 1.0 <= float(r["slowdown"]) <= 1.1, rows
        assert int(r["fct_ns"]) <= 1.1 * int(r["ideal_fct_ns"])
    assert result.summary["invariants"]["checks"]["conservation"]["held"] is not False


def test_an_8_to_1_incast_of_1mb_flows_finishes_under_pfc(tmp_path) -> None:
    result = _run(tmp_path, "flincast", """\
    - name: incast
      kind: flows
      incast:
        - {senders: [h1, h2, h3, h4, h5, h6, h7, h8], receiver: h9, size: 1MB,
           start: 10us}""", hosts=9)
    rows = _rows(result.run_dir)
    assert len(rows) == 8 and all(r["fct_ns"] for r in rows), rows
    fcts = sorted(int(r["fct_ns"]) for r in rows)
    # 8 MB through one 100G port take at least 8 x the wire bytes of 1 MB at line rate
    one_ns = min(int(r["ideal_fct_ns"]) for r in rows)
    assert fcts[-1] >= 7 * one_ns
    summary = result.summary
    assert summary["invariants"]["checks"]["lossless_drop"]["held"] is not False
    with Store(result.run_dir / "counters.sqlite") as store:
        assert len(store.flows()) == 8
        pauses = sum(store.last_values("pause_tx").values())
    assert pauses > 0
    fct_txt = (result.run_dir / "results" / "fct.txt").read_text().splitlines()
    assert len(fct_txt) == 8
    for line in fct_txt:
        sip, dip, sport, dport, size, start, fct, ideal = line.split()
        assert len(sip) == len(dip) == 8 and int(size) == 1_000_000
        assert int(fct) in fcts and int(ideal) > 0 and int(dport) == 6400


def test_generated_web_search_flows_write_every_result_form(tmp_path) -> None:
    result = _run(tmp_path, "flgen", """\
    - name: web
      kind: flows
      cc: dcqcn
      generate: {distribution: web_search, load: 0.3, duration: 1ms, seed: 3}""", hosts=4)
    run_dir = result.run_dir
    header = (run_dir / "results" / "flows.csv").read_text().splitlines()[0]
    assert header == ",".join(FLOWS_CSV_HEADER)
    rows = _rows(run_dir)
    assert len(rows) >= 20
    finished = [r for r in rows if r["fct_ns"]]
    assert len(finished) == len(rows), [r for r in rows if not r["fct_ns"]]
    with Store(run_dir / "counters.sqlite") as store:
        assert len(store.flows()) == len(rows)
    summary = result.summary
    assert summary["invariants"]["checks"]["conservation"]["held"] is not False
    assert not [v for v in summary["invariants"]["violations"]], summary["invariants"]
    report = (run_dir / "report.md").read_text()
    assert "FCT" in report


HPCC_CONFIG = """\
ENABLE_QCN 1
USE_DYNAMIC_PFC_THRESHOLD 1
PACKET_PAYLOAD_SIZE 4096
TOPOLOGY_FILE mix/topology.txt
FLOW_FILE mix/flow.txt
FCT_OUTPUT_FILE mix/fct.txt
SIMULATOR_STOP_TIME 4.00
CC_MODE 1
ALPHA_RESUME_INTERVAL 1
RATE_DECREASE_INTERVAL 4
CLAMP_TARGET_RATE 0
RP_TIMER 300
EWMA_GAIN 0.00390625
FAST_RECOVERY_TIMES 1
RATE_AI 20Mb/s
RATE_HAI 200Mb/s
MIN_RATE 100Mb/s
ERROR_RATE_PER_LINK 0.0000
KMAX_MAP 1 100000000000 1600
KMIN_MAP 1 100000000000 400
PMAX_MAP 1 100000000000 0.2
BUFFER_SIZE 32
"""
HPCC_TOPOLOGY = "4 1 3\n0\n0 1 100Gbps 0.001ms 0\n0 2 100Gbps 0.001ms 0\n0 3 100Gbps 0.001ms 0\n"
HPCC_FLOWS = "3\n1 3 3 100 1000000 2.000001\n2 3 3 100 1000000 2.000001\n1 2 3 100 64000 2.0001\n"


def test_an_imported_hpcc_scenario_runs_and_writes_hpccs_fct_txt(tmp_path, monkeypatch) -> None:
    """`testbed import hpcc-ns3` of a three-host HPCC scenario (its files relative to the
    working directory, as third.cc opens them), then the run: fct.txt has a line per
    flow in HPCC's columns, with HPCC's absolute start times and its dport."""
    from testbed.interop.hpcc_ns3 import translate

    mix = tmp_path / "mix"
    mix.mkdir()
    (mix / "config.txt").write_text(HPCC_CONFIG)
    (mix / "topology.txt").write_text(HPCC_TOPOLOGY)
    (mix / "flow.txt").write_text(HPCC_FLOWS)
    monkeypatch.chdir(tmp_path)
    lab = unique_lab("flhpcc")
    translation = translate("mix/config.txt", lab=lab)
    text = translation.to_yaml().replace("dilation: auto", "dilation: 2000")
    loaded = load_config_text(text, "hpcc.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path / "runs", say=lambda _m: None))
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
    lines = (result.run_dir / "results" / "fct.txt").read_text().splitlines()
    assert len(lines) == 3, lines
    starts = sorted(int(line.split()[5]) for line in lines)
    assert starts == [2_000_001_000, 2_000_001_000, 2_000_100_000]
    assert {line.split()[3] for line in lines} == {"100"}
    assert {int(line.split()[4]) for line in lines} == {1_000_000, 64_000}
    assert result.summary["invariants"]["checks"]["lossless_drop"]["held"] is not False
