"""Per-packet cost of `port_egress`, the lab build against the per-port build.

Builds configs/default.yaml (one instance per port with `per-port`, the lab's one
instance with `lab`), then runs h1's egress program on a 1000-byte UDP frame 200,000
times with BPF_PROG_TEST_RUN inside h1's namespace, the frame's device being h1's port
(the lab build finds the port by it), five times, and prints the kernel's ns per run.
The queue fills in the first runs, so the figure is mostly the tail-drop path (verdict
2, TC_ACT_SHOT). Needs root.

    sudo .venv/bin/python bench/portprog_perpacket.py lab
    sudo .venv/bin/python bench/portprog_perpacket.py per-port
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

from agents.portmaps import _Bpf, obj_get
from testbed.net import apply_plan, batch, destroy_lab, namespaces, portprog
from tests.integration.bpfrun import SKB_SIZE, frame
from tests.integration.conftest import plan_from_file

BPF_PROG_TEST_RUN = 10
SKB_IFINDEX = 40            # __u32 ifindex in struct __sk_buff
REPEAT = 200_000


def run(fd: int, data: bytes, ifindex: int) -> tuple[int, int]:
    """(verdict, ns per run) of REPEAT runs."""
    din = ctypes.create_string_buffer(data, len(data))
    ctx = ctypes.create_string_buffer(SKB_SIZE)
    struct.pack_into("=I", ctx, SKB_IFINDEX, ifindex)
    b = _Bpf()
    b.clear()
    # prog_fd, retval, data_size_in, data_size_out, data_in, data_out, repeat, duration,
    # ctx_size_in, ctx_size_out, ctx_in, ctx_out
    struct.pack_into("=IIIIQQIIIIQQ", b.attr, 0, fd, 0, len(data), 0, ctypes.addressof(din),
                     0, REPEAT, 0, SKB_SIZE, 0, ctypes.addressof(ctx), 0)
    b.call(BPF_PROG_TEST_RUN, "PROG_TEST_RUN")
    (verdict,) = struct.unpack_from("=I", b.attr, 4)
    (duration_ns,) = struct.unpack_from("=I", b.attr, 36)
    return verdict, duration_ns


def main(mode: str) -> None:
    if mode not in ("lab", "per-port"):
        raise SystemExit("usage: portprog_perpacket.py lab|per-port")
    if mode == "per-port":
        os.environ["TESTBED_PORTPROG"] = "per-port"
    plan = plan_from_file("configs/default.yaml", "pp" + mode[:3])
    apply_plan(plan)
    try:
        h1 = plan.node("h1")
        ifname = h1.interfaces[0].ifname
        fd = obj_get(portprog.pin_dir_of(plan.lab, "h1", ifname) / "progs" / "port_egress")
        try:
            with namespaces.inside(h1.netns):
                sock = batch.open_route_socket()
                try:
                    ifindex = batch.dump_link_indexes(sock, "h1")[ifname]
                finally:
                    sock.close()
                runs = [run(fd, frame(1000, dscp=0, ecn=0), ifindex) for _ in range(5)]
        finally:
            os.close(fd)
        print(f"{mode}: h1:{ifname} ifindex {ifindex}, verdicts {sorted({v for v, _ in runs})}, "
              f"ns per run {sorted(ns for _, ns in runs)}")
    finally:
        destroy_lab(plan.lab)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lab")
