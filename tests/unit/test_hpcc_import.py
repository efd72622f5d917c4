"""`testbed import hpcc-ns3`: HPCC's example experiments translate to configs our loader takes.

Fixtures in tests/unit/data/hpcc/<case>/ reproduce HPCC's shipped files (each names its
source path and commit on its first line) laid out as HPCC's run.py runs them: the case
directory is the working directory and the config names mix/... relative to it. Goldens
sit beside them; regenerate after an intended change with
`UPDATE_GOLDEN=1 pytest tests/unit/test_hpcc_import.py` and review the diff like code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from testbed.cli import main
from testbed.config import ConfigError, load_config_text
from testbed.interop.hpcc_ns3 import HpccImportError, ns3_rate_bps, ns3_time_ns, translate
from testbed.workloads.registry import REGISTRY

DATA = Path(__file__).resolve().parent / "data" / "hpcc"
SIM = DATA / "simulation-mix-9f4be2a"

# (case directory, config relative to it, --cc, golden file in the case directory)
CASES = [
    ("mix-7813df4", "mix/config.txt", "dcqcn", "config.dcqcn.expected.yaml"),
    ("simulation-mix-9f4be2a", "mix/config.txt", "dcqcn", "config.dcqcn.expected.yaml"),
    ("simulation-mix-9f4be2a", "mix/config.txt", "dctcp", "config.dctcp.expected.yaml"),
    ("run-py-9f4be2a", "mix/config_fat_flow_dcqcn.txt", None,
     "config_fat_flow_dcqcn.expected.yaml"),
    ("run-py-9f4be2a", "mix/config_fat_flow_dctcp.txt", None,
     "config_fat_flow_dctcp.expected.yaml"),
    ("run-py-9f4be2a", "mix/config_ali_32host_10rack_flow_dcqcn.txt", None,
     "config_ali_32host_10rack_flow_dcqcn.expected.yaml"),
]
IDS = [f"{case}:{golden.removesuffix('.expected.yaml')}" for case, _, _, golden in CASES]
FLOWS_PENDING = "kind: flows is not registered yet (the lead's testbed/workloads/flows.py)"


def _translate(case: str, config: str, cc: str | None) -> str:
    return translate(config, cwd=DATA / case, cc_override=cc).to_yaml()


@pytest.mark.parametrize(("case", "config", "cc", "golden"), CASES, ids=IDS)
def test_import_matches_golden(case: str, config: str, cc: str | None, golden: str) -> None:
    got = _translate(case, config, cc)
    path = DATA / case / golden
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got)
    assert path.exists(), f"no golden for {case}; run with UPDATE_GOLDEN=1 and review it"
    assert got == path.read_text(), (
        f"import of {case}/{config} changed; if intended: UPDATE_GOLDEN=1 pytest {__file__}")


@pytest.mark.parametrize(("case", "config", "cc", "golden"), CASES, ids=IDS)
def test_golden_without_its_workload_loads_with_our_loader(case: str, config: str,
                                                           cc: str | None, golden: str) -> None:
    """Everything but the flows entry validates today, kind: flows or not."""
    data = yaml.safe_load((DATA / case / golden).read_text())
    data.pop("workload")
    data.pop("events", None)
    loaded = load_config_text(yaml.safe_dump(data, sort_keys=False), f"{case}/{golden}")
    assert loaded is not None


@pytest.mark.skipif("flows" not in REGISTRY, reason=FLOWS_PENDING)
@pytest.mark.parametrize(("case", "config", "cc", "golden"), CASES, ids=IDS)
def test_golden_loads_with_our_loader(case: str, config: str, cc: str | None,
                                      golden: str) -> None:
    path = DATA / case / golden
    try:
        load_config_text(path.read_text(), str(path))
    except ConfigError as exc:
        pytest.fail("\n".join(exc.lines()))


def test_import_is_deterministic() -> None:
    assert _translate(*CASES[3][:3]) == _translate(*CASES[3][:3])


def test_shipped_config_keys_land_in_the_fields_they_name() -> None:
    cfg = translate("mix/config.txt", cwd=SIM, cc_override="dcqcn").config
    entry = cfg["workload"]["traffic"][0]
    assert entry["kind"] == "flows" and entry["cc"] == "dcqcn"
    # RP_TIMER 900 (us), RATE_AI 50Mb/s, MIN_RATE 100Mb/s, EWMA_GAIN 0.00390625, CLAMP 0
    assert entry["cc_params"] == {
        "alpha_timer": "1us", "increase_timer": "900us", "rate_decrease_interval": "4us",
        "g": 0.00390625, "fast_recovery_steps": 1, "rai": "50Mbps", "rhai": "100Mbps",
        "min_rate": "100Mbps", "target_clamp": "after_increase"}
    # flow.txt says 2 flows (and carries 254 more lines third.cc never reads), both at 2 s
    assert entry["flows"] == [{"src": "h2", "dst": "h1", "size": 200000000, "start": "0ns"},
                              {"src": "h3", "dst": "h1", "size": 200000000, "start": "0ns"}]
    assert entry["time_offset"] == "2000000000ns"
    # KMIN/KMAX at 100G: 400 / 1600 KB of 1000 bytes; BUFFER_SIZE 32 is MiB
    assert cfg["qos"] == {"r100g": {"ecn": {"kmin": "400KB", "kmax": "1600KB", "pmax": 0.2},
                                    "pfc": {"mode": "dynamic", "alpha": 0.125}}}
    assert cfg["switch_buffer"] == {"size": "32MiB"}
    assert cfg["roce_mtu"] == 512                     # PACKET_PAYLOAD_SIZE 1000
    assert {"name": "s0", "role": "switch"} in cfg["nodes"]
    assert cfg["links"][0] == {"a": "s0", "b": "h1", "port": "100GBASE-DR",
                               "length": "181.63m", "qos": "r100g"}


def test_fat_tree_fabric_ports_get_their_own_ecn_curve_and_pfc_alpha() -> None:
    cfg = translate("mix/config_fat_flow_dcqcn.txt", cwd=DATA / "run-py-9f4be2a").config
    assert cfg["qos"]["r400g"] == {"ecn": {"kmin": "1600KB", "kmax": "6400KB", "pmax": 0.2},
                                   "pfc": {"mode": "dynamic", "alpha": 0.5}}
    assert cfg["qos"]["r100g"]["ecn"] == {"kmin": "400KB", "kmax": "1600KB", "pmax": 0.2}
    assert {x["port"] for x in cfg["links"]} == {"100GBASE-DR", "400GBASE-DR4"}


def test_dctcp_equal_kmin_kmax_becomes_a_step_at_k() -> None:
    cfg = translate("mix/config_fat_flow_dctcp.txt", cwd=DATA / "run-py-9f4be2a").config
    assert cfg["qos"]["r100g"]["ecn"] == {"k": "300KB"}
    assert cfg["workload"]["traffic"][0]["cc_params"] == {
        "g": 0.0625, "rai": "615Mbps", "min_rate": "1Gbps", "mss": "512B"}


def test_every_unmapped_key_of_the_shipped_config_is_in_the_header() -> None:
    text = translate("mix/config.txt", cwd=SIM, cc_override="dcqcn").to_yaml()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for line in (SIM / "mix" / "config.txt").read_text().splitlines()[1:]:
        if line.split():
            assert re.search(rf"\b{line.split()[0]}\b", header), line.split()[0]
    assert "delay" in header and "netem" in header and "roce_mtu" in header


@pytest.mark.parametrize(("mode", "meaning"), [(3, "HPCC"), (7, "TIMELY"), (10, "HPCC-PINT")])
def test_unsupported_cc_mode_is_refused_naming_file_key_value_and_meaning(
        tmp_path: Path, mode: int, meaning: str) -> None:
    (tmp_path / "mix").mkdir()
    text = (SIM / "mix" / "config.txt").read_text().replace("CC_MODE 3", f"CC_MODE {mode}")
    (tmp_path / "mix" / "config.txt").write_text(text)
    with pytest.raises(HpccImportError) as err:
        translate("mix/config.txt", cwd=tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"mix/config.txt:16: CC_MODE {mode}: CC_MODE {mode} is {meaning} ")
    assert "supported: 1 (DCQCN" in msg and "8 (DCTCP)" in msg and "--cc dcqcn" in msg


def test_cli_refuses_the_shipped_config_with_exit_2(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(SIM)
    assert main(["import", "hpcc-ns3", "mix/config.txt"]) == 2
    err = capsys.readouterr().err
    assert "CC_MODE 3 is HPCC in HPCC's ns-3" in err and "\n" == err[-1]


def test_cli_writes_the_golden_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(SIM)
    out = tmp_path / "fabric.yaml"
    assert main(["import", "hpcc-ns3", "mix/config.txt", "--cc", "dcqcn", "-o", str(out)]) == 0
    assert out.read_text() == (SIM / "config.dcqcn.expected.yaml").read_text()


def test_files_are_resolved_against_the_working_directory_not_the_config(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(SIM / "mix")           # the config's own directory: mix/mix/... is absent
    assert main(["import", "hpcc-ns3", "config.txt", "--cc", "dcqcn"]) == 2
    err = capsys.readouterr().err
    assert "config.txt:7: TOPOLOGY_FILE mix/topology.txt: no such file" in err
    assert str(SIM / "mix" / "mix" / "topology.txt") in err
    assert "run the import from the directory HPCC's run.py runs in" in err


def test_missing_flow_file_names_key_and_path(tmp_path: Path) -> None:
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "topology.txt").write_text((SIM / "mix" / "topology.txt").read_text())
    (tmp_path / "c.txt").write_text("CC_MODE 1\nTOPOLOGY_FILE mix/topology.txt\n"
                                    "FLOW_FILE mix/nope.txt\n")
    with pytest.raises(HpccImportError, match=r"c.txt:3: FLOW_FILE mix/nope.txt: no such file "
                                              r"'.*/mix/nope.txt'"):
        translate("c.txt", cwd=tmp_path)


def _mini(tmp_path: Path, config: str, topo: str, flows: str) -> Path:
    (tmp_path / "t.txt").write_text(topo)
    (tmp_path / "f.txt").write_text(flows)
    (tmp_path / "c.txt").write_text("TOPOLOGY_FILE t.txt\nFLOW_FILE f.txt\n" + config)
    return tmp_path


_TOPO = "3 1 2\n0\n0 1 100Gbps 1us 0\n0 2 100Gbps 0.001ms 0.01\n"
_MAPS = ("KMAX_MAP 1 100000000000 1600\nKMIN_MAP 1 100000000000 400\n"
         "PMAX_MAP 1 100000000000 0.2\n")


def test_error_rates_become_loss_and_late_flows_are_dropped(tmp_path: Path) -> None:
    cwd = _mini(tmp_path, "CC_MODE 1\nERROR_RATE_PER_LINK 0.001\nSIMULATOR_STOP_TIME 2.5\n"
                          "LINK_DOWN 100 0 1\n" + _MAPS,
                _TOPO, "3\n1 2 3 100 5000 2.0\n2 1 3 100 7000 2.000001\n1 2 3 100 1 3\n")
    result = translate("c.txt", cwd=cwd)
    cfg = result.config
    assert cfg["impairments"] == [{"link": ["s0", "h1"], "direction": "both", "loss": 0.001},
                                  {"link": ["s0", "h2"], "direction": "both", "loss": 0.01}]
    assert [f["start"] for f in cfg["workload"]["traffic"][0]["flows"]] == ["0ns", "1us"]
    assert cfg["events"] == [{"at": "100us", "kind": "link_down", "link": ["s0", "h1"]}]
    assert "1 flow(s) starting at or after it dropped" in " ".join(result.notes)


@pytest.mark.parametrize(("config", "topo", "flows", "message"), [
    ("CC_MODE 1\n", _TOPO, "1\n1 2 3 100 10 2\n", r"c.txt: no KMIN_MAP"),
    ("CC_MODE 1\nKMAX_MAP 1 25000000000 400\nKMIN_MAP 1 25000000000 100\n"
     "PMAX_MAP 1 25000000000 0.2\n", _TOPO, "1\n1 2 3 100 10 2\n",
     r"c.txt:5: KMIN_MAP 1 25000000000 100: no entry for 100000000000 bit/s"),
    ("CC_MODE 1\n" + _MAPS.replace("100000000000", "50000000000"),
     "3 1 1\n0\n0 1 50Gbps 1us 0\n", "1\n1 2 3 100 10 2\n",
     r"t.txt: link 1 \(0 1\): no port type runs at 50Gbps"),
    ("CC_MODE 1\n" + _MAPS, _TOPO, "1\n1 0 3 100 10 2\n",
     r"f.txt: flow 1: node 0 is not a linked host"),
    ("CC_MODE 1\n" + _MAPS, _TOPO, "1\n1 2 0 100 10 2\n", r"priority group 0; only 3"),
    ("CC_MODE 1\n" + _MAPS, _TOPO, "2\n1 2 3 100 10 2\n", r"f.txt: ends before flow 2 of 2"),
    ("CC_MODE 1\n" + _MAPS, "3 1 2\n0\n0 1 100Gbps 1us 0\n", "0\n",
     r"t.txt: ends before link 2 of 2"),
    ("CC_MODE 1\n" + _MAPS, _TOPO, "0\n", r"f.txt: no flow starts before SIMULATOR_STOP_TIME"),
    ("CC_MODE 1\nKMAX_MAP 2 1\n", _TOPO, "0\n", r"c.txt:4: KMAX_MAP: expected 5 value"),
    ("CC_MODE 1\n" + _MAPS, "3 1 2\n0\n0 1 100Gbits 1us 0\n", "0\n",
     r"t.txt: link 1 of 2: unknown rate unit in '100Gbits'"),
])
def test_input_errors_say_where_and_what(tmp_path: Path, config: str, topo: str, flows: str,
                                         message: str) -> None:
    with pytest.raises(HpccImportError, match=message):
        translate("c.txt", cwd=_mini(tmp_path, config, topo, flows))


def test_ns3_units_follow_ns3() -> None:
    assert ns3_rate_bps("100Gbps", "x") == 100 * 10**9
    assert ns3_rate_bps("50Mb/s", "x") == 50 * 10**6
    assert ns3_rate_bps("1GBps", "x") == 8 * 10**9          # ns-3: upper-case B is bytes
    assert ns3_time_ns("0.001ms", "x") == 1000
    assert ns3_time_ns("1000ns", "x") == 1000
    assert ns3_time_ns("2", "x") == 2 * 10**9                # a bare ns-3 time is seconds
    assert ns3_time_ns("2.000000001", "x") == 2_000_000_001
