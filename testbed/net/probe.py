"""Find out what this kernel and machine can do, by trying it.

Each feature is exercised for real in a scratch namespace (`tb-probe-PID`)
that is removed afterwards; module lists are not trusted, because this
project runs on kernels with everything built in and no modules at all.
Every missing feature is reported with what it disables and the fallback.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import asdict, dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from testbed.net import namespaces, steering


@dataclass(frozen=True)
class Feature:
    name: str
    present: bool
    detail: str
    disables: str      # what a missing feature costs, and the fallback


IMPACT = {
    "netns": "everything: the fabric is built from network namespaces",
    "veth": "everything: links are veth pairs",
    "htb": "per-port rates and traffic classes",
    "bfifo": "byte-limited class buffers (packet-limited pfifo would be used)",
    "tbf": "PFC pause gates (per-class TBF leaves)",
    "u32": "DSCP classification into traffic classes",
    "clsact": "the tc-BPF port program (queue accounting, ECN marking, tail drop, PFC)",
    "netem": "propagation/FEC delay and PHY loss in the kernel; delay is not emulated and "
             "loss is applied by the BPF port program",
    "red": "the RED-based ECN marker alternative; the BPF marker is used",
    "vxlan": "stitching links across VMs (scale-out)",
    "ifb": "ingress shaping through IFB devices",
    "rps": "keeping a flow in order when its packets are handled on several CPUs (RPS on "
           "every port, testbed/net/steering.py); without it the fabric can reorder a flow",
    "rdma_rxe": "kernel Soft-RoCE endpoints; the user-space RoCE transport is used",
    "clang": "compiling the tc-BPF port program",
    "bpftool": "inspecting pinned BPF maps from the shell (the testbed reads maps itself)",
    "bpffs": "pinning BPF maps (mount -t bpf bpf /sys/fs/bpf)",
}


def _try(fn) -> tuple[bool, str]:
    try:
        fn()
        return True, "ok"
    except NetlinkError as exc:
        return False, f"kernel: {os.strerror(exc.code) if exc.code else exc}"
    except Exception as exc:   # a probe reports, it does not crash
        return False, str(exc)


def _probe_tc(ipr: IPRoute, idx: int) -> dict[str, tuple[bool, str]]:
    out: dict[str, tuple[bool, str]] = {}

    def clear_root() -> None:
        # Delete by handle without a kind: pyroute2's tbf plugin cannot build
        # a delete request without the rate it was created with.
        try:
            ipr.tc("del", index=idx, handle=0x10000, parent=0xFFFFFFFF)
        except NetlinkError:
            pass

    def qdisc(kind: str, **kw):
        def run():
            try:
                ipr.tc("add", kind, idx, 0x10000, **kw)
            finally:
                clear_root()
        return run

    from testbed.net.qdisc import _tc_plugins  # noqa: F401  (registers bfifo)

    out["htb"] = _try(qdisc("htb", default=0x10))
    out["bfifo"] = _try(qdisc("bfifo", limit=10_000))
    out["tbf"] = _try(qdisc("tbf", rate="8mbit", burst=10_000, limit=100_000))
    out["netem"] = _try(qdisc("netem", delay=1000))
    out["red"] = _try(qdisc("red", limit=100_000, min=10_000, max=30_000, avpkt=1000,
                            burst=20, probability=0.02, ecn=True))

    def u32():
        ipr.tc("add", "htb", idx, 0x10000, default=0x10)
        try:
            ipr.tc("add-filter", "u32", idx, parent=0x10000, prio=10, protocol=0x0800,
                   target=0x10010, keys=["0x00680000/0x00fc0000+0"])
        finally:
            clear_root()
    out["u32"] = _try(u32)

    def clsact():
        ipr.tc("add", "clsact", idx)
        ipr.tc("del", "clsact", idx)
    out["clsact"] = _try(clsact)
    return out


def probe() -> list[Feature]:
    found: dict[str, tuple[bool, str]] = {}
    scratch = f"{namespaces.PREFIX}probe-{os.getpid()}"
    ok, detail = _try(lambda: namespaces.create(scratch))
    found["netns"] = (ok, detail)
    if ok:
        try:
            with IPRoute(netns=scratch) as ipr:
                found["veth"] = _try(lambda: ipr.link("add", ifname="p0", kind="veth",
                                                      peer="p1"))
                if found["veth"][0]:
                    idx = ipr.link_lookup(ifname="p0")[0]
                    found.update(_probe_tc(ipr, idx))
                found["vxlan"] = _try(lambda: ipr.link("add", ifname="vx0", kind="vxlan",
                                                       vxlan_id=42, vxlan_port=4789))
                found["ifb"] = _try(lambda: ipr.link("add", ifname="ifb0", kind="ifb"))
        finally:
            namespaces.remove(scratch)
    found["rps"] = _probe_rps()
    rxe = os.path.exists("/sys/module/rdma_rxe")
    found["rdma_rxe"] = (rxe, "loaded" if rxe else "not in this kernel (no /sys/module/rdma_rxe)")
    for tool in ("clang", "bpftool"):
        path = shutil.which(tool)
        found[tool] = (path is not None, path or "not installed")
    bpffs = _bpffs_mounted()
    found["bpffs"] = (bpffs, "mounted at /sys/fs/bpf" if bpffs else "not mounted (mounted on use)")
    order = list(IMPACT)
    return [Feature(name, *found.get(name, (False, "not probed")), IMPACT[name])
            for name in order]


def _probe_rps() -> tuple[bool, str]:
    """How the builder will steer flows (the same decision `up` makes)."""
    steer = steering.choose()
    if steer.method == steering.NONE:
        # One CPU cannot reorder across CPUs: nothing is missing then.
        return len(steer.cpus) == 1, steer.reason
    return True, steer.describe()


def _bpffs_mounted() -> bool:
    try:
        with open("/proc/self/mounts") as fh:
            return any(line.split()[2] == "bpf" for line in fh if len(line.split()) > 2)
    except OSError:
        return False


def probe_report() -> dict:
    features = probe()
    return {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "features": {f.name: asdict(f) for f in features},
        "missing": [f.name for f in features if not f.present],
    }
