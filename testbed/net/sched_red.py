"""A pyroute2 tc plugin for sch_red, registered as "red" (testbed/net/qdisc.py does).

pyroute2 (0.9.x) has no red plugin: `ipr.tc("add", "red", ...)` sends a qdisc with no
options, which the kernel refuses (EINVAL: TCA_RED_PARMS and TCA_RED_STAB are
required; this is what `testbed probe` reported as "kernel: Invalid argument"). Its
choke plugin is RED-like but computes Wlog, Plog and the idle table from iproute2's
heuristics (an EWMA from `burst`, Stab from a bandwidth) and has no TCA_RED_FLAGS,
so it cannot express what the RED marker needs: Wlog 0 (the instantaneous queue), an
idle table that empties the average, max_p given exactly, and the nodrop flag (which
exists only as a TCA_RED_FLAGS bit). This plugin describes the message as data (the
kernel's structs, <linux/pkt_sched.h>) and takes every value as given, so IPRoute,
IPBatch and the builder's batched netlink (testbed/net/batch.py) all encode it, with no
tc strings. Its values come from testbed/plan/red.py (a RedPlan).

    ipr.tc("add", "red", ifindex, handle, parent=parent, limit=..., qth_min=...,
           qth_max=..., max_p=..., plog=..., wlog=0, scell_log=0, red_stab=bytes(256),
           flags=TC_RED_ECN | TC_RED_NODROP)
"""

from __future__ import annotations

import struct

from pyroute2.netlink import nla, nla_string
from pyroute2.netlink.rtnl import TC_H_ROOT
from pyroute2.netlink.rtnl.tcmsg.common import stats2 as _stats2

from testbed.plan.red import RED_STAB_SIZE, TC_RED_HISTORIC_FLAGS, TC_RED_NODROP

parent = TC_H_ROOT
#: the flags this plugin lets the kernel change (TCA_RED_FLAGS selector)
FLAGS_SELECTOR = TC_RED_HISTORIC_FLAGS | TC_RED_NODROP
# `red_stab`, not `stab`: pyroute2 sends a `stab` argument as the qdisc-level size table
# (TCA_STAB), which the kernel then refuses ("Size table base attribute is missing").
REQUIRED = ("limit", "qth_min", "qth_max", "max_p", "red_stab", "flags")


def get_parameters(kwarg: dict) -> dict:
    """TCA_OPTIONS of a red qdisc from explicit values (nothing is derived here)."""
    missing = [k for k in REQUIRED if k not in kwarg]
    if missing:
        raise ValueError(f"red qdisc: {', '.join(missing)} not given")
    stab = bytes(kwarg["red_stab"])
    if len(stab) != RED_STAB_SIZE:
        raise ValueError(f"red qdisc: stab has {len(stab)} entries, not {RED_STAB_SIZE}")
    return {"attrs": [
        # the flags byte of tc_red_qopt stays 0: the kernel refuses flags given both there
        # and in TCA_RED_FLAGS, and nodrop exists only in the latter
        ["TCA_RED_PARMS", {"limit": kwarg["limit"], "qth_min": kwarg["qth_min"],
                           "qth_max": kwarg["qth_max"], "Wlog": kwarg.get("wlog", 0),
                           "Plog": kwarg.get("plog", 0),
                           "Scell_log": kwarg.get("scell_log", 0), "flags": 0}],
        ["TCA_RED_STAB", stab],
        ["TCA_RED_MAX_P", kwarg["max_p"]],
        ["TCA_RED_FLAGS", {"bits": kwarg["flags"], "selector": FLAGS_SELECTOR}],
    ]}


class options(nla):
    nla_map = (
        ("TCA_RED_UNSPEC", "none"),
        ("TCA_RED_PARMS", "qopt"),
        ("TCA_RED_STAB", "stab"),
        ("TCA_RED_MAX_P", "uint32"),
        ("TCA_RED_FLAGS", "bitfield32"),
        ("TCA_RED_EARLY_DROP_BLOCK", "uint32"),
        ("TCA_RED_MARK_BLOCK", "uint32"),
    )

    class qopt(nla):
        fields = (
            ("limit", "I"),
            ("qth_min", "I"),
            ("qth_max", "I"),
            ("Wlog", "B"),
            ("Plog", "B"),
            ("Scell_log", "B"),
            ("flags", "B"),
        )

    class stab(nla_string):
        def encode(self):
            self["value"] = struct.pack("256B", *bytes(self.value))
            nla_string.encode(self)

    class bitfield32(nla):
        # not "value": pyroute2 treats that key as the payload of a one-value nla
        fields = (("bits", "I"), ("selector", "I"))


class stats(nla):
    """struct tc_red_xstats (TCA_XSTATS): marked = probabilistic + forced marks."""

    fields = (("early", "I"), ("pdrop", "I"), ("other", "I"), ("marked", "I"))


class stats2(_stats2):
    class stats_app(stats):
        pass
