"""Find out what this kernel and machine can do, by trying it.

Each kernel feature is exercised for real in a scratch namespace (`tb-probe-PID`) that
is removed afterwards; module lists are not trusted, because this project runs on
kernels with everything built in and no modules at all. The tools are looked up on PATH,
bpffs in /proc/self/mounts; rdma_rxe by loading it and adding an rxe link in a scratch
namespace, whose /proc/net/udp then says whether rxe is namespace aware
(testbed/net/rxe.py). Every feature is reported with what it is for and what its absence
costs (IMPACT); a few are probed for uses that are not built, and their absence costs
nothing today. README.md's feature table is IMPACT,
word for word (tests/unit/test_docs_readme.py).
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import asdict, dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from testbed.net import namespaces, rxe, steering


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
    "netem": "link propagation and FEC delay and PHY frame loss (a netem on an IFB at each "
             "port's peer ingress, testbed/net/netem.py); without it (or ifb) links carry no "
             "delay, the BPF port program applies the PHY loss and a run notes how short the "
             "base RTT is",
    "red": "the RED marker (qos.<class>.ecn.marker: red): sch_red holds a class's buffer and "
           "marks its queue with the class's curve; a config that asks for it stops before "
           "building without it (testbed run --vm runs it in a VM); the default BPF marker "
           "does not need it",
    "vxlan": "nothing yet: spreading a fabric over several VMs is planned, not built",
    "ifb": "the link delay stage: each port's arrivals are redirected to an IFB whose root "
           "is netem; without it links carry no delay (as without netem)",
    "rps": "keeping a flow in order when its packets are handled on several CPUs (RPS on "
           "every port, testbed/net/steering.py); without it the fabric can reorder a flow",
    "rdma_rxe": "kernel Soft-RoCE endpoints (hosts with endpoint: rxe, kind: perftest); "
                "without it a config with an rxe host is refused before anything is built "
                "(run it with --vm); the default RoCE endpoints are the user-space transport "
                "(agents/rdma) and need nothing",
    "rxe_netns": "an rxe device inside its host's namespace (Linux 7.1+); without it rxe "
                 "passes traffic only in the initial namespace, so rxe hosts are placed there "
                 "through an ipvlan slave of their NIC, which is allowed only in the VM "
                 "(--vm) and refused on a real host",
    "ipvlan": "the initial-namespace placement of rxe hosts on kernels whose rxe is not "
              "namespace aware (an ipvlan L2 slave of the host's NIC); without it such "
              "kernels cannot run rxe hosts",
    "perftest": "kind: perftest traffic between rxe hosts (ib_write_bw, ib_send_bw, "
                "ib_write_lat from the perftest package); without it such a config is refused "
                "before anything is built",
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
    from testbed.net import netem  # noqa: F401  (its netem plugin takes delay_ns)

    out["netem"] = _try(qdisc("netem", delay_ns=1000, limit=1000, loss=0.0))
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
    found_rxe = rxe.probe()
    found["rdma_rxe"] = found_rxe.rxe
    found["rxe_netns"] = found_rxe.netns_aware
    found["ipvlan"] = found_rxe.ipvlan
    missing = [t for t in ("ib_write_bw", "ib_send_bw", "ib_write_lat") if not shutil.which(t)]
    found["perftest"] = (not missing, "on PATH" if not missing else
                         f"not installed ({', '.join(missing)}; apt install perftest)")
    for tool in ("clang", "bpftool"):
        path = shutil.which(tool)
        found[tool] = (path is not None, path or "not installed")
    bpffs = _bpffs_mounted()
    found["bpffs"] = (bpffs, "mounted at /sys/fs/bpf" if bpffs else "not mounted (mounted on use)")
    order = list(IMPACT)
    return [Feature(name, *found.get(name, (False, "not probed")), IMPACT[name])
            for name in order]


# Kernel config options and module files of the features `testbed plan` can tell
# without root (kernel_config_has).
_CONFIG = {"netem": ("CONFIG_NET_SCH_NETEM", "sch_netem.ko"), "ifb": ("CONFIG_IFB", "ifb.ko")}


def kernel_config_has(feature: str, release: str | None = None) -> bool | None:
    """Whether the running kernel was built with `feature` (netem, ifb), read without
    root or a namespace: /proc/config.gz, /boot/config-RELEASE, else the module lists
    in /lib/modules/RELEASE. None when none of them can be read. The probe (which
    tries the feature for real) is what `up` trusts; this is for `testbed plan`."""
    import gzip

    option, module = _CONFIG[feature]
    release = release or platform.release()
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{release}", open)):
        try:
            with opener(path, "rt") as fh:
                return any(line.startswith((f"{option}=y", f"{option}=m")) for line in fh)
        except OSError:
            continue
    found = None
    for name in ("modules.builtin", "modules.dep"):
        try:
            with open(f"/lib/modules/{release}/{name}") as fh:
                found = bool(found) or any(f"/{module}" in line.split(":")[0] for line in fh)
        except OSError:
            continue
    return found


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
