"""Port program parameters, fixed-point encodings and C/Python layouts (no root needed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agents import portmaps
from testbed.net import portprog
from testbed.net.bpf import PORT_SOURCE
from testbed.plan.model import Plan
from tests.conftest import REPO


def golden_plan() -> Plan:
    return Plan.model_validate_json((REPO / "tests/golden/default.plan.json").read_text())


def golden_egress():
    return golden_plan().nodes[0].interfaces[0].egress


def test_params_from_egress_maps_classes_dscp_and_default():
    egress = golden_egress()
    params = portprog.params_from_egress(egress, drop_probability=1e-6, port_slot=3)
    assert params.port_slot == 3
    assert params.dscp_to_tc == {26: 3, 48: 6}
    assert params.default_tc == 0                      # classid 1:10 is TC0
    roce = params.classes[3]
    assert (roce.kmin_bytes, roce.kmax_bytes, roce.pmax) == (100_000, 400_000, 0.2)
    assert roce.limit_bytes == 2_000_000
    # a spine's lossless queue under egress protection (per-port buffers)
    assert roce.egress_xoff_bytes == 1_000_000 and 0 < roce.egress_xon_bytes < 1_000_000
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


def test_a_host_nic_never_marks_and_a_shared_class_has_no_port_limit():
    plan = golden_plan()
    host = plan.node("h1").interfaces[0]
    params = portprog.params_from_egress(host.egress)
    assert all(c.pmax is None for c in params.classes.values())
    assert params.classes[3].egress_xoff_bytes == 0        # hosts send no PFC
    shared = host.egress.model_copy(update={"classes": [
        c.model_copy(update={"shared": True}) if c.tc == 3 else c
        for c in host.egress.classes]})
    assert portprog.params_from_egress(shared).classes[3].limit_bytes == 0


def test_node_params_number_the_ports_and_take_the_links_thresholds():
    plan = golden_plan()
    leaf = plan.node("leaf1")
    ifindex = {i.ifname: 10 + k for k, i in enumerate(leaf.interfaces)}
    params = portprog.node_params_from_plan(leaf, ifindex)
    params.check()
    assert params.mode == "static" and params.tracked == (3,)
    assert params.slots == {10 + k: k + 1 for k in range(len(leaf.interfaces))}
    for k, iface in enumerate(leaf.interfaces, start=1):
        pfc = next(c.pfc for c in iface.egress.classes if c.tc == 3)
        got = params.ingress[(3, k)]
        assert (got.xoff_bytes, got.xon_bytes, got.headroom_bytes) == (
            pfc.xoff_bytes, pfc.xon_bytes, pfc.headroom_bytes)
    host = portprog.node_params_from_plan(plan.node("h1"), {})
    assert host.mode == "none" and host.tracked == () and not host.ingress


def test_invalid_params_are_all_reported():
    params = portprog.PortParams(
        dscp_to_tc={64: 1}, default_tc=9, port_slot=-1,
        classes={3: portprog.ClassParams(kmin_bytes=5, kmax_bytes=4, pmax=0.5),
                 4: portprog.ClassParams(pmax=1.5, drop_probability=-0.1,
                                         egress_xoff_bytes=1, egress_xon_bytes=2)})
    problems = params.problems()
    assert len(problems) == 7, problems
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


def test_alpha_is_fixed_point_and_the_threshold_is_alpha_times_the_free_pool():
    assert portmaps.alpha_fp(0.125) == 8192
    assert portmaps.alpha_fp(1.0) == 1 << 16
    # HPCC's GetPfcThreshold: (buffer - headroom - reserve - shared used) x alpha
    assert portmaps.shared_threshold(2_000_000, 9 * 25_000, 9 * 4096, 400_000, 0.125) == (
        (2_000_000 - 225_000 - 36_864 - 400_000) * 8192 >> 16)
    assert portmaps.shared_threshold(100, 200, 0, 0, 0.5) == 0          # nothing free


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
    (kmin, kmax, pmax_fp, drop_fp, limit, exoff, exon, ecn, trim_len, *_trim
     ) = portprog.CLASS_CFG.unpack(lossy)
    assert (kmin, kmax, pmax_fp, ecn) == (0, 0, 0, 0)        # no pmax: no ECN
    assert drop_fp == 1 << 30 and limit == 0 and exoff == exon == 0
    assert trim_len == 0                                      # no trim: trim_len 0 is off
    ecn_cls = portprog.ClassParams(kmin_bytes=10, kmax_bytes=20, pmax=1.0, limit_bytes=99,
                                   egress_xoff_bytes=50, egress_xon_bytes=40)
    assert portprog.CLASS_CFG.unpack(portprog.encode_class_cfg(ecn_cls)) == (
        10, 20, 1 << 32, 0, 99, 50, 40, 1, 0, 0, 0, 0)


def test_class_cfg_encodes_trimming_as_the_program_reads_it():
    trim = portmaps.TrimParams(threshold_bytes=30_000, size_bytes=128, tc=6, dscp=48)
    raw = portprog.encode_class_cfg(portprog.ClassParams(limit_bytes=100_000), trim)
    got = dict(zip(portmaps.CLASS_CFG_FIELDS, portprog.CLASS_CFG.unpack(raw), strict=True))
    assert (got["trim_len"], got["trim_threshold_bytes"], got["trim_tc"], got["trim_dscp"]) == (
        128, 30_000, 6, 48)
    assert got["limit_bytes"] == 100_000


def test_trim_params_are_checked():
    ok = portmaps.TrimParams(threshold_bytes=1, size_bytes=88, tc=6, dscp=48)
    params = portprog.PortParams(dscp_to_tc={48: 6, 10: 1}, classes={1: portprog.ClassParams()},
                                 trims={1: ok})
    assert params.problems() == []
    bad = portprog.PortParams(dscp_to_tc={48: 6, 10: 1}, classes={1: portprog.ClassParams()},
                              trims={1: portmaps.TrimParams(threshold_bytes=-1, size_bytes=87,
                                                            tc=6, dscp=10)})
    problems = bad.problems()
    assert len(problems) == 3, problems       # size below 88, dscp not of tc 6, threshold
    same = portprog.PortParams(classes={1: portprog.ClassParams()},
                               trims={1: portmaps.TrimParams(0, 128, 1, 0)})
    assert any("another class" in p for p in same.problems())


def test_node_head_encoding_maps_tracked_classes_to_their_index():
    params = portmaps.NodeParams(mode="shared", tracked=(3, 5), buffer_bytes=2_000_000,
                                 reserve_bytes=4096, alpha=0.25, resume_offset_bytes=3072,
                                 total_hdrm_bytes=100, total_rsrv_bytes=200)
    v = portmaps.NODE_HEAD.unpack(portmaps.encode_node_head(params))
    assert v[:7] == (2, 16384, 2_000_000, 4096, 3072, 100, 200)
    tracked = v[7:15]
    assert tracked[3] == 0 and tracked[5] == 1
    assert {tracked[tc] for tc in (0, 1, 2, 4, 6, 7)} == {portmaps.NO_TRACK}
    bad = portmaps.NodeParams(mode="pool", tracked=(1, 2, 3),
                              ingress={(4, 0): portmaps.IngressParams(xoff_bytes=1,
                                                                      xon_bytes=2)})
    assert len(bad.problems()) == 4, bad.problems()


def test_event_records_decode():
    raw = portmaps.EVENT.pack(123, portmaps.EV_XOFF, 3, 7, 2, 4096)
    ev = portmaps.decode_event(raw)
    assert ev == portmaps.Event(123, "xoff", 3, 7, 2, 4096)


def test_python_layouts_match_the_static_asserts_in_the_c_source():
    text = PORT_SOURCE.read_text()
    sizes = dict(re.findall(r"_Static_assert\(sizeof\(struct (\w+)\) == (\d+)", text))
    want = {name: layout.size for name, (layout, _fields) in portprog.LAYOUTS.items()}
    want["node_acct"] = portmaps.NODE_SIZE
    assert {name: int(size) for name, size in sizes.items()} == want
    for name in portprog.MAPS:
        assert re.search(rf"\}} {name} SEC\(\"\.maps\"\)|DEFINE_(MAP|RINGBUF)\({name},",
                         text), name
    for const in ("NUM_TC", "NUM_DSCP", "MAX_SLOTS", "MAX_TRACKED", "RING"):
        assert re.search(rf"#define {const} {getattr(portmaps, const)}\b", text), const
    assert re.search(rf"DEFINE_RINGBUF\(events, 1 << {portmaps.EVENTS_BYTES.bit_length() - 1}\)",
                     text)
    # the lab build's bounds, on both sides
    for const in ("MAX_IFINDEX", "MAX_NODES"):
        assert re.search(rf"#define {const} {getattr(portprog, const)}\b", text), const


_SIZES = {"B": 1, "H": 2, "I": 4, "Q": 8}


def _offsets(layout) -> list[int]:
    out, off = [], 0
    for code in re.findall(r"(\d*)([BHIQ])", layout.format):
        count, kind = int(code[0] or 1), code[1]
        for _ in range(count):
            out.append(off)
            off += _SIZES[kind]
    return out


@pytest.mark.skipif(not (shutil.which("clang") and shutil.which("bpftool")),
                    reason="needs clang and bpftool")
def test_compiled_object_btf_matches_python_layouts(tmp_path):
    obj = portprog.ensure_object(cache_dir=tmp_path)
    res = subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(obj)],
                         capture_output=True, text=True, check=True)
    structs = {t["name"]: t for t in json.loads(res.stdout)["types"] if t["kind"] == "STRUCT"}
    for name, (layout, fields) in portprog.LAYOUTS.items():
        if name == "event":
            continue        # a ring buffer record: no map type names it, so no BTF (its
            #                 size is _Static_assert-ed in the C source)
        btf = structs[name]
        assert btf["size"] == layout.size, name
        got = [(m["name"], m["bits_offset"] // 8) for m in btf["members"]]
        assert got == list(zip(fields, _offsets(layout), strict=True)), name
    # node_acct: the head (its u8 tracked[8] is eight B fields in Python), then in[][]
    node = structs["node_acct"]
    assert node["size"] == portmaps.NODE_SIZE
    offsets = _offsets(portmaps.NODE_HEAD)
    names = list(portmaps.NODE_HEAD_FIELDS)
    head = [(n, offsets[i if i <= 7 else i + 7]) for i, n in enumerate(names)]
    got = [(m["name"], m["bits_offset"] // 8) for m in node["members"]]
    assert got == head + [("in", portmaps.NODE_HEAD.size)]


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


def _btf_map_templates(obj: Path) -> dict[str, dict[str, int]]:
    """name -> {type, max_entries, map_flags, key_size, value_size} of each inner map
    template `struct <name>_inner` of the lab build (libbpf's __uint(): a pointer to an
    array of that many elements)."""
    res = subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(obj)],
                         capture_output=True, text=True, check=True)
    types = {t["id"]: t for t in json.loads(res.stdout)["types"]}
    out = {}
    for t in types.values():
        if t["kind"] == "STRUCT" and t["name"].endswith("_inner"):
            fields = {}
            for m in t["members"]:
                arr = types[types[m["type_id"]]["type_id"]]
                fields[m["name"]] = arr["nr_elems"]
            out[t["name"].removesuffix("_inner")] = fields
    return out


@pytest.mark.skipif(not (shutil.which("clang") and shutil.which("bpftool")),
                    reason="needs clang and bpftool")
def test_lab_build_declares_the_inner_maps_portprog_makes(tmp_path):
    obj = portprog.ensure_object(cache_dir=tmp_path, defines=portprog.LAB_DEFINES)
    assert re.fullmatch(r"port-lab-[0-9a-f]{16}\.o", obj.name)
    assert obj != portprog.ensure_object(cache_dir=tmp_path)
    templates = _btf_map_templates(obj)
    assert set(templates) == set(portprog.INNER_SPECS)
    for name, spec in portprog.INNER_SPECS.items():
        t = templates[name]
        got = portprog.MapSpec(t["type"], t.get("key_size", 0), t.get("value_size", 0),
                               t["max_entries"], t.get("map_flags", 0))
        assert got == spec, name


def test_lab_ifindexes_number_every_interface_once_in_plan_order(monkeypatch):
    plan = golden_plan()
    index = portprog.lab_ifindexes(list(plan.nodes))
    assert list(index) == [(n.name, i.ifname) for n in plan.nodes for i in n.interfaces]
    assert sorted(index.values()) == list(range(portprog.FIRST_IFINDEX,
                                                portprog.FIRST_IFINDEX + len(index)))
    monkeypatch.setattr(portprog, "MAX_IFINDEX", portprog.FIRST_IFINDEX + len(index) - 1)
    with pytest.raises(portprog.PortProgError, match="raise MAX_IFINDEX"):
        portprog.lab_ifindexes(list(plan.nodes))


def test_the_builder_loads_one_instance_per_lab_unless_told_or_too_big(monkeypatch):
    from testbed.net import builder

    plan = golden_plan()
    monkeypatch.setattr(portprog, "ensure_object",
                        lambda cache_dir=None, source=None, defines=(): Path(f"obj{defines}"))
    monkeypatch.setattr(portprog, "start_loading", lambda dirs, obj: ("per-port", obj))
    monkeypatch.setattr(portprog, "start_lab_loading", lambda lab, ports, obj: ("lab", ports))
    monkeypatch.delenv("TESTBED_PORTPROG", raising=False)
    scope = builder.Scope.of(plan)
    loading, why, index = builder._start_loading(plan, scope)
    assert loading[0] == "lab" and why == ""
    assert index == portprog.lab_ifindexes(list(plan.nodes))
    by_ifindex = {p.ifindex: p for p in loading[1]}
    assert len(by_ifindex) == len(index)
    for p in loading[1]:        # a port's departures are keyed by its peer, and back
        assert by_ifindex[p.peer_ifindex].peer_ifindex == p.ifindex != p.peer_ifindex
    monkeypatch.setenv("TESTBED_PORTPROG", "per-port")
    assert builder._start_loading(plan, scope) == (("per-port", Path("obj()")), "", {})
    monkeypatch.delenv("TESTBED_PORTPROG")
    monkeypatch.setattr(portprog, "MAX_IFINDEX", portprog.FIRST_IFINDEX + 1)
    assert builder._start_loading(plan, scope) == (("per-port", Path("obj()")), "", {})
