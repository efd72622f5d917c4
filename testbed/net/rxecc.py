"""The rxe congestion counters: compile, load, attach and detach them.

`testbed/net/bpf/rxe_cc.bpf.c` counts, at the clsact ingress of an rxe host's
NIC, the RoCEv2 packets per BTH DestQP that arrive CE-marked and the CNPs that
arrive (agents/rxe_cc reads the counts: its notification point sends CNPs, its
reaction point cuts the host class's rate). It sits at prio FILTER_PRIO - 1,
before the port program's departure filter, and returns TC_ACT_UNSPEC, so the
filters after it run as before. One instance per NIC, pinned under
/sys/fs/bpf/tb/<lab>/<node>/_rxe_cc/{progs,maps}; `portprog.detach_lab` removes
it with the lab's other pins.

The object is compiled and cached like the port program (`portprog.ensure_object`
with this source; `python -m testbed.net.portprog build` builds both).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

from agents.rxe_cc.maps import PIN_NAME, RxeCcMaps, pin_dir_of
from testbed.net.bpf import RXE_CC_SOURCE
from testbed.net.portprog import (
    CLSACT_INGRESS,
    ETH_P_ALL,
    FILTER_HANDLE,
    FILTER_PRIO,
    PortProgError,
    _bpftool,
    _check_name,
    _forget,
    _rmtree,
    ensure_bpffs,
    ensure_object,
    obj_get,
)

__all__ = ["PIN_NAME", "PROG_NAME", "RXE_CC_FILTER_PRIO", "attach_rxe_cc", "detach_rxe_cc",
           "ensure_rxe_cc_object", "open_rxe_cc", "pin_dir_of"]

PROG_NAME = "rxe_cc_ingress"
RXE_CC_FILTER_PRIO = FILTER_PRIO - 1
assert RXE_CC_FILTER_PRIO >= 1, "tc priority 0 means 'let the kernel pick'"


def ensure_rxe_cc_object(cache_dir: Path | None = None) -> Path:
    """The compiled counter program (clang on first use, cached by source hash)."""
    return ensure_object(cache_dir, RXE_CC_SOURCE)


def _load(obj: Path, pin_dir: Path) -> None:
    _forget(pin_dir)
    _rmtree(pin_dir)
    pin_dir.mkdir(parents=True)
    argv = [_bpftool(), "prog", "loadall", str(obj), str(pin_dir / "progs"), "type",
            "classifier", "pinmaps", str(pin_dir / "maps")]
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0 or not (pin_dir / "progs" / PROG_NAME).exists():
        tail = "\n".join(res.stderr.strip().splitlines()[-25:])
        raise PortProgError(f"bpftool prog loadall {obj.name} failed for {pin_dir} "
                            f"(exit {res.returncode}):\n{tail}")


def attach_rxe_cc(lab: str, node: str, netns: str, ifname: str, *,
                  obj: Path | None = None) -> Path:
    """Load an instance for the NIC `ifname` of host `node` (in `netns`) and attach it at
    the NIC's clsact ingress, prio RXE_CC_FILTER_PRIO; returns its pin directory.
    Attaching again replaces the program and its counts."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    for kind, name in (("lab", lab), ("node", node)):
        _check_name(kind, name)
    pin_dir = pin_dir_of(lab, node)
    ensure_bpffs()
    _load(obj or ensure_rxe_cc_object(), pin_dir)
    with IPRoute(netns=netns) as ipr:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            raise PortProgError(f"no interface {ifname!r} in namespace {netns!r}")
        fd = obj_get(pin_dir / "progs" / PROG_NAME)
        try:
            with contextlib.suppress(NetlinkError):
                ipr.tc("add", "clsact", found[0])
            try:
                ipr.tc("replace-filter", "bpf", found[0], FILTER_HANDLE, fd=fd, name=PROG_NAME,
                       parent=CLSACT_INGRESS, prio=RXE_CC_FILTER_PRIO, protocol=ETH_P_ALL,
                       classid=1, direct_action=True)
            except NetlinkError as exc:
                raise PortProgError(f"attaching {PROG_NAME} to {netns}/{ifname} failed: "
                                    f"{exc}") from None
        finally:
            os.close(fd)
    return pin_dir


def detach_rxe_cc(lab: str, node: str, netns: str, ifname: str) -> None:
    """Take the filter off the NIC (best effort: the namespace may be gone) and unpin."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with contextlib.suppress(NetlinkError, OSError):
        with IPRoute(netns=netns) as ipr:
            found = ipr.link_lookup(ifname=ifname)
            if found:
                ipr.tc("del-filter", "bpf", found[0], FILTER_HANDLE, parent=CLSACT_INGRESS,
                       prio=RXE_CC_FILTER_PRIO, protocol=ETH_P_ALL)
    pin_dir = pin_dir_of(lab, node)
    _forget(pin_dir)
    _rmtree(pin_dir)


def open_rxe_cc(lab: str, node: str) -> RxeCcMaps:
    """The counter maps of a host's NIC (close() when done); OSError(ENOENT) if none."""
    pin_dir = pin_dir_of(lab, node)
    if not (pin_dir / "maps").exists():
        raise OSError(errno.ENOENT, f"no rxe_cc program pinned at {pin_dir}")
    return RxeCcMaps(pin_dir)
