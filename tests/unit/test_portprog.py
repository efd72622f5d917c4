"""Port program parameters, fixed-point encodings and C/Python layouts (no root needed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agents.portmaps import MAX_INGRESS
from testbed.net import portprog
from testbed.net.bpf import PORT_SOURCE
from testbed.plan.model import Plan
from tests.conftest import REPO


def golden_egress():
    plan = Plan.model_validate_json((REPO / "tests/golden/default.plan.json").read_text())
    return plan.nodes[0].interfaces[0].egress


def test_params_from_egress_maps_classes_dscp_and_default():
    egress = golden_egress()
    params = portprog.params_from_egress(egress, drop_probability=1e-6)
    assert params.wall_rate_bps == egress.wall_rate_bps
    assert params.overhead_bytes == egress.overhead_bytes == 24
    assert params.dscp_to_tc == {26: 3, 48: 6}
    assert params.default_tc == 0                      # classid 1:10 is TC0
    roce = params.classes[3]
    assert (roce.kmin_bytes, roce.kmax_bytes, roce.pmax) == (100_000, 400_000, 0.2)
    assert roce.limit_bytes == 2_000_000
    assert params.classes[0].pmax is None and params.classes[6].pmax is None
    assert all(c.drop_probability == 1e-6 for c in params.classes.values())
    table = portprog.dscp_table(params)
    assert len(table) == 64 and table[26] == 3 and table[48] == 6
    assert {table[d] for d in range(64) if d not in (26, 48)} == {0}
    params.check()


def test_params_from_egress_needs_the_default_class_among_the_classes():
    egress = golden_egress().model_copy(update={"default_classid": "1:77"})
    with pytest.raises(ValueError, match="default class 1:77"):
        portprog.params_from_egress(egress)


def test_invalid_params_are_all_reported():
    params = portprog.PortParams(
        wall_rate_bps=0, dscp_to_tc={64: 1}, default_tc=9,
        classes={3: portprog.ClassParams(kmin_bytes=5, kmax_bytes=4, pmax=0.5),
                 4: portprog.ClassParams(pmax=1.5, drop_probability=-0.1)})
    problems = params.problems()
    assert len(problems) == 6, problems
    with pytest.raises(ValueError, match="kmin_bytes <= kmax_bytes"):
        params.check()


def test_probability_fixed_point_compares_against_a_u32_random():
    assert portprog.probability_fp(0.0) == 0                 # r < 0 never
    assert portprog.probability_fp(1.0) == 1 << 32           # every u32 r is below
    assert portprog.probability_fp(0.5) == 1 << 31
    assert portprog.probability_fp(0.01) == round(0.01 * 2**32)
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError):
            portprog.probability_fp(bad)


def test_rate_is_bytes_per_ns_in_32_32_fixed_point():
    assert portprog.rate_fp(8_000_000_000) == 1 << 32        # 1 byte per ns
    assert portprog.rate_fp(20_000_000) == round(0.0025 * 2**32)
    # relative error of the encoding stays far below HTB's own at 1 Mbit/s
    assert abs(portprog.rate_fp(1_000_000) / 2**32 / 0.000125 - 1) < 1e-5


def test_mark_probability_is_the_dcqcn_curve():
    kmin, kmax, pmax = 100_000, 400_000, 0.2
    assert portprog.mark_probability(kmin, kmin, kmax, pmax) == 0.0
    assert portprog.mark_probability(kmin + 1, kmin, kmax, pmax) > 0.0
    for vq in (150_000, 250_000, 399_999, 400_000):
        exact = pmax * (vq - kmin) / (kmax - kmin)
        assert portprog.mark_probability(vq, kmin, kmax, pmax) == pytest.approx(exact, abs=2**-31)
    assert portprog.mark_probability(kmax + 1, kmin, kmax, pmax) == 1.0
    # Kmin = Kmax: a step, mark iff vq > K
    assert portprog.mark_probability(50_000, 50_000, 50_000, 0.3) == 0.0
    assert portprog.mark_probability(50_001, 50_000, 50_000, 0.3) == 1.0


def test_class_cfg_encoding():
    none = portprog.encode_class_cfg(None)
    assert none == bytes(portprog.CLASS_CFG.size)
    lossy = portprog.encode_class_cfg(portprog.ClassParams(kmin_bytes=1, kmax_bytes=2,
                                                           drop_probability=0.25))
    kmin, kmax, pmax_fp, drop_fp, limit, ecn, _ = portprog.CLASS_CFG.unpack(lossy)
    assert (kmin, kmax, pmax_fp, ecn) == (0, 0, 0, 0)        # no pmax: no ECN
    assert drop_fp == 1 << 30 and limit == 0
    ecn_cls = portprog.ClassParams(kmin_bytes=10, kmax_bytes=20, pmax=1.0, limit_bytes=99)
    assert portprog.CLASS_CFG.unpack(portprog.encode_class_cfg(ecn_cls)) == (
        10, 20, 1 << 32, 0, 99, 1, 0)


def test_python_layouts_match_the_static_asserts_in_the_c_source():
    text = PORT_SOURCE.read_text()
    sizes = dict(re.findall(r"_Static_assert\(sizeof\(struct (\w+)\) == (\d+)", text))
    assert {name: int(size) for name, size in sizes.items()} == {
        name: layout.size for name, (layout, _fields) in portprog.LAYOUTS.items()}
    for name, (value_size, entries) in portprog.MAPS.items():
        assert re.search(rf"\}} {name} SEC\(\"\.maps\"\)", text), name
        assert value_size in {layout.size for layout, _ in portprog.LAYOUTS.values()} | {4, 8}
        assert entries in (1, portprog.NUM_TC, portprog.NUM_SLOTS, portprog.NUM_DSCP,
                           portprog.NUM_TC * MAX_INGRESS)
    assert re.search(rf"#define MAX_INGRESS {MAX_INGRESS}\b", text)


def _offsets(layout) -> list[int]:
    out, off = [], 0
    for code in re.findall(r"(\d*)([IQ])", layout.format):
        count, kind = int(code[0] or 1), code[1]
        for _ in range(count):
            out.append(off)
            off += 4 if kind == "I" else 8
    return out


@pytest.mark.skipif(not (shutil.which("clang") and shutil.which("bpftool")),
                    reason="needs clang and bpftool")
def test_compiled_object_btf_matches_python_layouts(tmp_path):
    obj = portprog.ensure_object(cache_dir=tmp_path)
    res = subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(obj)],
                         capture_output=True, text=True, check=True)
    structs = {t["name"]: t for t in json.loads(res.stdout)["types"] if t["kind"] == "STRUCT"}
    for name, (layout, fields) in portprog.LAYOUTS.items():
        btf = structs[name]
        assert btf["size"] == layout.size, name
        got = [(m["name"], m["bits_offset"] // 8) for m in btf["members"]]
        assert got == list(zip(fields, _offsets(layout), strict=True)), name


@pytest.mark.skipif(not shutil.which("clang"), reason="needs clang")
def test_object_is_compiled_once_per_source_hash(tmp_path):
    first = portprog.ensure_object(cache_dir=tmp_path)
    assert first.parent == tmp_path and re.fullmatch(r"port-[0-9a-f]{16}\.o", first.name)
    stamp = first.stat().st_mtime_ns
    assert portprog.ensure_object(cache_dir=tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    edited = tmp_path / "edited.bpf.c"
    edited.write_text(PORT_SOURCE.read_text() + "\n/* edit */\n")
    assert portprog.object_path(tmp_path, edited) != first


def test_missing_clang_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(portprog.shutil, "which", lambda _name: None)
    with pytest.raises(portprog.PortProgError, match="install clang; `make setup` does"):
        portprog.ensure_object(cache_dir=tmp_path)


def test_build_command_prints_the_object_path(tmp_path, capsys):
    if not shutil.which("clang"):
        pytest.skip("needs clang")
    assert portprog.main(["build", "--cache-dir", str(tmp_path)]) == 0
    assert Path(capsys.readouterr().out.strip()).exists()


@pytest.mark.parametrize("lab,node,ifname", [("../x", "n", "e"), ("lab", "a/b", "e"),
                                              ("lab", "n", ".."), ("", "n", "e")])
def test_pin_paths_stay_under_the_lab_directory(lab, node, ifname):
    with pytest.raises(ValueError):
        portprog.pin_dir_of(lab, node, ifname)


def test_pin_dir_layout():
    assert portprog.pin_dir_of("lab1", "leaf1", "swp3") == Path("/sys/fs/bpf/tb/lab1/leaf1/swp3")
