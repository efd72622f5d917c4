"""Find out what this kernel and machine can do, by trying it.

Each kernel feature is exercised for real in a scratch namespace
(`tb-probe-PID`) that is removed afterwards; module lists are not trusted,
because this project runs on kernels with everything built in and no modules
at all. The tools are looked up on PATH, rdma_rxe in /sys/module, bpffs in
/proc/self/mounts. Every feature is reported with what it is for and what its
absence costs (IMPACT); a few are probed for uses that are not built, and
their absence costs nothing today. README.md's feature table is IMPACT,
word for word (tests/unit/test_docs_readme.py).
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
    disables: str      # what the feature is for, and what its absence costs


IMPACT = {
    "netns": "everything: the fabric is built from network namespaces",
    "veth": "everything: links are veth pairs",
    "htb": "per-port rates and traffic classes (an HTB tree on every port); up fails "
           "without it",
    "bfifo": "the byte-limited buffers of the classes without PFC (bfifo leaves); up fails "
             "without it",
    "tbf": "PFC pause gates (a TBF leaf per PFC class, closed and opened by the PFC agents); "
           "up fails without it on a fabric with PFC",
    "u32": "DSCP classification into traffic classes (u32 filters); up fails without it",
    "clsact": "attaching the tc-BPF port program (queue accounting, ECN marking, tail drop, "
              "PHY loss, PFC decisions); up fails without it",
    # The builder installs no netem on any kernel (yet): link delay is never emulated
    # and the port program always applies the PHY's frame loss.
    "netem": "nothing yet: no netem is installed on any kernel, so link propagation and FEC "
             "delay are not emulated and PHY loss is applied by the BPF port program; a run "
             "on a kernel without it notes how short the base RTT is",
    "red": "the RED marker (qos.<class>.ecn.marker: red): sch_red holds a class's buffer and "
           "marks its queue with the class's curve; a config that asks for it stops before "
           "building without it (testbed run --vm runs it in a VM); the default BPF marker "
           "does not need it",
    "vxlan": "nothing yet: spreading a fabric over several VMs is planned, not built",
    "ifb": "nothing: IFB devices are not used",
    "rps": "keeping a flow in order when its packets are handled on several CPUs (RPS on "
           "every port, testbed/net/steering.py); without it the fabric can reorder a flow",
    "rdma_rxe": "nothing: RoCE endpoints are the user-space transport (agents/rdma), not "
                "Soft-RoCE",
    "clang": "compiling the tc-BPF port program (once per source version, then cached); "
             "without it and a cached object the fabric is built without port programs: no "
             "ECN marking, queue accounting, PHY loss or PFC (the run says so)",
    "bpftool": "loading the tc-BPF port program (bpftool batch, prog loadall); up fails "
               "without it",
    "bpffs": "pinning the port programs and their maps; mounted on use when it is not "
             "(mount -t bpf bpf /sys/fs/bpf)",
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

    from testbed.net.qdisc import red_options  # (importing it registers bfifo and red)
    from testbed.plan.model import RedPlan
    from testbed.plan.red import red_params

    out["htb"] = _try(qdisc("htb", default=0x10))
    out["bfifo"] = _try(qdisc("bfifo", limit=10_000))
    out["tbf"] = _try(qdisc("tbf", rate="8mbit", burst=10_000, limit=100_000))
    out["netem"] = _try(qdisc("netem", delay=1000))
    # what the builder sends for the RED marker (testbed/net/sched_red.py): Wlog 0, the
    # idle table, max_p given, flags ecn + nodrop (TCA_RED_FLAGS, Linux 5.7 and later)
    red = red_params(10_000, 30_000, 0.1, 100_000)
    out["red"] = _try(qdisc("red", **{**red_options(RedPlan(
        handle="1:", parent="ffff:ffff", limit_bytes=red.limit_bytes,
        qth_min_bytes=red.qth_min_bytes, qth_max_bytes=red.qth_max_bytes,
        max_p_fp=red.max_p_fp, plog=red.plog)), "parent": 0xFFFFFFFF}))

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
