"""The lab build of the port program: one instance serves every port of a built lab.

The builder gives every fabric interface a lab-unique ifindex and loads port.bpf.c
once (-DLAB_INSTANCE); each port's and node's maps are made by portprog (not libbpf),
pinned where the per-port build pins them, and reached through outer maps keyed by
(ifindex << 1 | direction). These tests check what that must keep: the maps are the
per-port build's, the departures of a port are counted on that port and no other, and
a lab costs one program load.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from pathlib import Path

import pytest

from agents.portmaps import BPF_OBJ_GET_INFO_BY_FD, NUM_TC, _Bpf, lookup_raw
from testbed.net import batch, namespaces, portprog
from testbed.run import smoke

pytestmark = pytest.mark.root


def _info(fd: int, size: int = 80) -> bytes:
    bpf = _Bpf()
    info = ctypes.create_string_buffer(size)
    struct.pack_into("=IIQ", bpf.attr, 0, fd, size, ctypes.addressof(info))
    bpf.call(BPF_OBJ_GET_INFO_BY_FD, "OBJ_GET_INFO_BY_FD")
    return info.raw


def _map_spec(path: Path) -> portprog.MapSpec:
    fd = portprog.obj_get(path)
    try:
        kind, _id, key, value, entries, flags = struct.unpack_from("=6I", _info(fd), 0)
    finally:
        os.close(fd)
    return portprog.MapSpec(kind, key, value, entries, flags)


def _prog_id(path: Path) -> int:
    fd = portprog.obj_get(path)
    try:
        return struct.unpack_from("=I", _info(fd), 4)[0]       # bpf_prog_info: type, id
    finally:
        os.close(fd)


def test_inner_map_specs_are_what_libbpf_makes_for_the_per_port_build():
    lab = f"bpfspec{os.getpid()}"
    pin_dir = portprog.pin_dir_of(lab, "n1", "eth0")
    try:
        portprog.load_programs([pin_dir])
        for name, spec in portprog.INNER_SPECS.items():
            where = pin_dir / "maps" if name in portprog.INNER_PORT_MAPS else \
                portprog.node_dir_of(lab, "n1")
            assert _map_spec(where / name) == spec, name
    finally:
        portprog.detach_lab(lab)


def test_lab_ifindexes_are_unique_and_bounded(default_fabric):
    index = portprog.lab_ifindexes(list(default_fabric.nodes))
    ports = [(n.name, i.ifname) for n in default_fabric.nodes for i in n.interfaces]
    assert list(index) == ports
    assert len(set(index.values())) == len(ports)
    assert min(index.values()) == portprog.FIRST_IFINDEX
    assert max(index.values()) < portprog.MAX_IFINDEX


def test_a_built_lab_runs_one_instance_keyed_by_its_lab_unique_ifindexes(default_fabric,
                                                                         tmp_path):
    plan = default_fabric
    lab_progs = portprog.lab_dir_of(plan.lab) / "progs"
    # one program load for the whole lab: every port's pins are the lab's two programs
    for prog in ("port_egress", "port_departure"):
        ids = {_prog_id(portprog.pin_dir_of(plan.lab, n.name, i.ifname) / "progs" / prog)
               for n in plan.nodes for i in n.interfaces}
        assert ids == {_prog_id(lab_progs / prog)}, prog
    # every interface has the ifindex the instance keys it by
    want = portprog.lab_ifindexes(list(plan.nodes))
    for node in plan.nodes:
        with namespaces.inside(node.netns):
            sock = batch.open_route_socket()
        try:
            got = batch.dump_link_indexes(sock, node.name)
        finally:
            sock.close()
        for iface in node.interfaces:
            assert got[iface.ifname] == want[(node.name, iface.ifname)]

    # traffic between every pair of hosts: each port's departures must match its own
    # admissions exactly; a departure counted on the wrong port would leave its port's
    # queue standing and show up as unmatched or mismatched on the other
    results = smoke.reachability(plan, str(tmp_path), count=2)
    assert all(r["replies"] == 2 for r in results.values())
    time.sleep(0.2)
    seen = 0
    for node in plan.nodes:
        for iface in node.interfaces:
            counters = portprog.read_counters(portprog.pin_dir_of(plan.lab, node.name,
                                                                  iface.ifname))
            for tc in range(NUM_TC):
                c = counters[tc]
                where = f"{node.name}:{iface.ifname} class {tc}"
                assert (c.enq_packets, c.enq_bytes) == (c.dep_packets, c.dep_bytes), where
                assert c.dep_unmatched == 0 and c.dep_mismatch == 0, where
                seen += c.enq_packets
            if node.role == "host":
                assert sum(counters[tc].enq_packets for tc in range(NUM_TC)) > 0, iface
    assert seen > 0


def test_write_params_writes_every_dscp_and_class_in_its_batches():
    lab = f"bpfbatchw{os.getpid()}"
    pin_dir = portprog.pin_dir_of(lab, "n1", "eth0")
    params = portprog.PortParams(
        dscp_to_tc={d: d % NUM_TC for d in range(0, 64, 3)}, default_tc=5, port_slot=2,
        classes={tc: portprog.ClassParams(kmin_bytes=1000 * (tc + 1), kmax_bytes=9000 * (tc + 1),
                                          pmax=0.1) for tc in range(NUM_TC)})
    try:
        portprog.load_programs([pin_dir])
        maps = portprog.PortMaps(pin_dir)
        try:
            maps.write_params(params)
            got_dscp = [struct.unpack("=I", lookup_raw(maps.dscp_tc.fd, struct.pack("=I", d),
                                                       4))[0] for d in range(64)]
            assert got_dscp == portprog.dscp_table(params)
            for tc in range(NUM_TC):
                raw = lookup_raw(maps.class_cfg.fd, struct.pack("=I", tc),
                                 portprog.CLASS_CFG.size)
                assert raw == portprog.encode_class_cfg(params.classes[tc]), tc
        finally:
            maps.close()
    finally:
        portprog.detach_lab(lab)
