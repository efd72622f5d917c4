"""The port program: compile, load, attach, configure and read it.

`testbed/net/bpf/port.bpf.c` serves every fabric port: its `port_egress` program
at clsact egress of the port (admission, tail drop, ECN marking, counters) and
its `port_departure` program at clsact ingress of the port's veth peer (what
arrives there has left the port's queue), so the queue it decides on is
admitted - departed, the real one (docs/datapath.md). All ports of a node share
the node's maps (buffer model, PFC events, drops by flow). This module is the
only code that loads BPF:

    obj = ensure_object()                               # clang, cached by source hash
    handle = attach_port(lab, node, netns, ifname, params, peer=(peer_netns, peer_ifname))
    configure_node(lab, node, node_params)              # buffer model, thresholds, slots
    read_counters(handle)[3].vq_bytes                   # from memory, no syscall
    detach_lab(lab)                                     # rm -r /sys/fs/bpf/tb/<lab>

Two ways to load it, the same maps and pins either way:
- per port (`start_loading`, `attach_port`; a VM's part of a lab): each port
  loads its own instance (two verifier runs, ~4 ms of CPU), the node's first
  port makes the node's maps and the others reuse them;
- per lab (`start_lab_loading`; the builder, for a whole fabric): ONE instance of
  the lab build (`-DLAB_INSTANCE`, LAB_DEFINES) for every port, its map names
  outer ARRAY_OF_MAPS keyed by (ifindex << 1 | direction). The builder gives
  every fabric interface a lab-unique ifindex (`lab_ifindexes`); this module
  makes each port's and node's maps with the per-port build's types, sizes and
  flags (INNER_SPECS), pins them, and puts them into the outer maps under the
  port's ifindex (egress) and its peer's (departure). The nodes' spin locks are
  elements of the lab's `node_lock` array (Linux < 6.2 refuses a bpf_spin_lock in
  an inner map). At 128 hosts: 2 verifier runs instead of 640.

Either way a port's maps are pinned under /sys/fs/bpf/tb/<lab>/<node>/<ifname>/maps/
(its programs under .../progs/), the node's shared maps under
/sys/fs/bpf/tb/<lab>/<node>/_node/ (the lab instance's own pins under
/sys/fs/bpf/tb/<lab>/_lab/), so readers find them by path, and a lab's pins go
with one directory removal, even after the process that made them was killed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from agents.portmaps import (  # re-exported (see __all__): one module for the port program
    CLASS_CFG,
    FLOW_KEY,
    LAYOUTS,
    MAPS,
    MAX_SLOTS,
    MAX_TRACKED,
    NODE_DIR,
    NODE_MAPS,
    NUM_DSCP,
    NUM_SLOTS,
    NUM_TC,
    OTHER,
    PORT_MAPS,
    ClassCounters,
    ClassParams,
    IngressParams,
    NodeMaps,
    NodeParams,
    PortMapError,
    PortMaps,
    PortParams,
    TrimParams,
    _Bpf,
    _ino,
    dscp_table,
    encode_class_cfg,
    mark_probability,
    obj_get,
    probability_fp,
)
from testbed.net.bpf import PORT_SOURCE, RXE_CC_SOURCE
from testbed.plan.model import EgressPlan, NodePlan, Plan

__all__ = [
    "CLASS_CFG", "LAYOUTS", "MAPS", "MAX_SLOTS", "MAX_TRACKED", "NODE_DIR", "NODE_MAPS", "NUM_DSCP",
    "NUM_SLOTS", "NUM_TC", "OTHER", "PORT_MAPS", "ClassCounters", "ClassParams",
    "IngressParams", "NodeMaps", "NodeParams", "PortHandle", "PortMapError", "PortMaps",
    "PortParams", "PortProgError", "TrimParams", "attach_port", "configure_node", "detach_lab",
    "detach_port", "dscp_table", "encode_class_cfg", "ensure_object", "mark_probability",
    "node_dir_of", "node_params_from_plan", "obj_get", "object_path", "open_node",
    "open_node_ports", "open_port", "params_from_egress", "pin_dir_of", "pinned_labs",
    "probability_fp", "read_counters", "reset_state", "update_params",
    "Loading", "bpf_filter_message", "clsact_message", "start_loading",
]


class PortProgError(PortMapError):
    """Building, loading or attaching the port program failed; says what to do."""


BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "tb"
CACHE_DIR = Path("/var/cache/testbed/bpf")
CLSACT_EGRESS = 0xFFFFFFF3      # "ffff:fff3"
CLSACT_INGRESS = 0xFFFFFFF2     # "ffff:fff2"
# clsact filter priority of the port program. Other filters on the same hook sit around
# it: the rxe congestion counters at FILTER_PRIO - 1 (they run first), netem's redirect
# at FILTER_PRIO + 1. 2, not 1: a tc priority of 0 means "let the kernel pick".
FILTER_PRIO = 2
FILTER_HANDLE = 1
ETH_P_ALL = 0x0003
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")


def params_from_egress(egress: EgressPlan, drop_probability: float = 0.0,
                       port_slot: int = 0) -> PortParams:
    """Port program parameters of one planned egress port.

    `drop_probability` applies to every class (a link's frame-loss ratio hits
    all traffic alike). DSCPs no class lists go to the plan's default class,
    the one HTB's `default` sends unclassified traffic to. A class in the
    node's shared pool has no limit of its own (limit_bytes 0: the MMU admits).
    A class with a trim plan (switch ports only) trims UET packets into its trim class.
    """
    default_tc = next((c.tc for c in egress.classes if c.classid == egress.default_classid),
                      None)
    if default_tc is None:
        raise ValueError(f"default class {egress.default_classid} is not among the classes")
    return PortParams(
        dscp_to_tc={d: c.tc for c in egress.classes for d in c.dscp},
        default_tc=default_tc,
        port_slot=port_slot,
        classes={c.tc: ClassParams(
            kmin_bytes=c.ecn.kmin_bytes if c.ecn else 0,
            kmax_bytes=c.ecn.kmax_bytes if c.ecn else 0,
            pmax=c.ecn.pmax if c.ecn else None,
            marker=c.ecn.marker if c.ecn else "bpf",
            drop_probability=drop_probability,
            limit_bytes=0 if c.shared else c.limit_bytes,
            egress_xoff_bytes=c.pfc.egress_xoff_bytes if c.pfc else 0,
            egress_xon_bytes=c.pfc.egress_xon_bytes if c.pfc else 0,
        ) for c in egress.classes},
        trims={c.tc: TrimParams(threshold_bytes=c.trim.threshold_bytes,
                                size_bytes=c.trim.size_bytes, tc=c.trim.tc, dscp=c.trim.dscp)
               for c in egress.classes if c.trim is not None},
    )


def node_params_from_plan(node: NodePlan, ifindex: dict[str, int]) -> NodeParams:
    """The node's buffer model and per-(class, ingress port) thresholds, as planned.

    Slot k + 1 is the node's k-th interface (slot 0: its own traffic). The
    thresholds of an ingress port are those of the link it belongs to (one port
    class for both ends of a link).
    """
    buf = node.buffer
    ingress: dict[tuple[int, int], IngressParams] = {}
    for k, iface in enumerate(node.interfaces):
        for cls in iface.egress.classes:
            if cls.tc in buf.tracked and cls.pfc is not None:
                ingress[(cls.tc, k + 1)] = IngressParams(
                    headroom_bytes=cls.pfc.headroom_bytes,
                    xoff_bytes=cls.pfc.xoff_bytes if buf.mode == "static" else 0,
                    xon_bytes=cls.pfc.xon_bytes if buf.mode == "static" else 0)
    slots = {ifindex[i.ifname]: k + 1 for k, i in enumerate(node.interfaces)
             if i.ifname in ifindex}
    return NodeParams(mode=buf.mode, tracked=tuple(buf.tracked), ingress=ingress, slots=slots,
                      buffer_bytes=buf.pool_bytes, reserve_bytes=buf.reserve_bytes,
                      alpha=buf.alpha, resume_offset_bytes=buf.resume_offset_bytes,
                      total_hdrm_bytes=buf.total_headroom_bytes,
                      total_rsrv_bytes=buf.total_reserve_bytes)


_open: dict[str, PortMaps] = {}


def _maps(target: PortHandle | PortMaps | str | Path) -> PortMaps:
    """The open maps of a port, by handle, open maps or pin directory (fds cached per
    directory; reopened when the pins were replaced, e.g. by a detach and attach in
    another process)."""
    if isinstance(target, PortHandle):
        return target.maps
    if isinstance(target, PortMaps):
        return target
    key = str(target)
    maps = _open.get(key)
    if maps is not None and maps.ino == _ino(Path(key) / "maps" / "state"):
        return maps
    if maps is not None:
        maps.close()
        del _open[key]
    maps = PortMaps(Path(key))
    _open[key] = maps
    return maps


def _forget(prefix: Path) -> None:
    for key in [k for k in _open if Path(k) == prefix or Path(k).is_relative_to(prefix)]:
        _open.pop(key).close()


# --- build -------------------------------------------------------------------------------


def multiarch() -> str:
    """Debian multiarch triplet of this machine (where asm/types.h lives)."""
    for argv in (["gcc", "-print-multiarch"], ["dpkg-architecture", "-qDEB_HOST_MULTIARCH"]):
        if shutil.which(argv[0]) is None:
            continue
        res = subprocess.run(argv, capture_output=True, text=True)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    machine = platform.machine()
    return {"armv7l": "arm-linux-gnueabihf"}.get(machine, f"{machine}-linux-gnu")


def compile_flags() -> list[str]:
    include = Path("/usr/include") / multiarch()
    return ["-O2", "-g", "-target", "bpf", f"-I{include}"]


#: the lab build of port.bpf.c: one instance for every port of a lab (map-in-map)
LAB_DEFINES = ("-DLAB_INSTANCE",)


def object_path(cache_dir: Path | None = None, source: Path = PORT_SOURCE,
                defines: tuple[str, ...] = ()) -> Path:
    """Where the object for the current source and flags lives (built or not)."""
    flags = [*compile_flags(), *defines]
    digest = hashlib.sha256(source.read_bytes() + b"\0" + " ".join(flags).encode())
    stem = source.name.split(".", 1)[0]         # "port" (port.bpf.c), "rxe_cc", ...
    if defines:
        stem += "-lab" if defines == LAB_DEFINES else "-" + hashlib.sha256(
            " ".join(defines).encode()).hexdigest()[:8]
    return (cache_dir or _cache_dir()) / f"{stem}-{digest.hexdigest()[:16]}.o"


def _cache_dir() -> Path:
    return Path(os.environ.get("TESTBED_BPF_CACHE", CACHE_DIR))


def ensure_object(cache_dir: Path | None = None, source: Path = PORT_SOURCE,
                  defines: tuple[str, ...] = ()) -> Path:
    """The compiled port program, compiled with clang on first use and cached by source
    hash (`defines`: LAB_DEFINES for the lab build)."""
    out = object_path(cache_dir, source, defines)
    if out.exists():
        return out
    clang = shutil.which("clang")
    if clang is None:
        raise PortProgError("clang not found, needed to compile the port program: "
                            "install clang; `make setup` does")
    flags = compile_flags()
    include = Path(flags[-1][2:])
    if not (include / "asm").is_dir():
        raise PortProgError(f"{include}/asm missing: install linux-libc-dev and libbpf-dev; "
                            "`make setup` does")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PortProgError(f"cannot create the BPF cache {out.parent}: {exc.strerror} "
                            "(run as root, or set TESTBED_BPF_CACHE)") from None
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    res = subprocess.run([clang, *flags, *defines, "-c", str(source), "-o", str(tmp)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise PortProgError(f"clang failed to compile {source} (exit {res.returncode}):\n"
                            f"{res.stderr.strip()}")
    os.replace(tmp, out)
    return out


# --- bpffs, load, attach -----------------------------------------------------------------


def bpffs_mounted() -> bool:
    with open("/proc/self/mounts") as fh:
        return any(line.split()[1:3] == [str(BPFFS), "bpf"] for line in fh)


def ensure_bpffs() -> None:
    if bpffs_mounted():
        return
    res = subprocess.run(["mount", "-t", "bpf", "bpf", str(BPFFS)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise PortProgError(f"mount -t bpf bpf {BPFFS} failed (exit {res.returncode}): "
                            f"{res.stderr.strip()}")


def _check_name(kind: str, name: str) -> None:
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"{kind} {name!r} cannot be a bpffs path component")


def pin_dir_of(lab: str, node: str, ifname: str) -> Path:
    for kind, name in (("lab", lab), ("node", node), ("ifname", ifname)):
        _check_name(kind, name)
    if ifname == NODE_DIR:
        raise ValueError(f"ifname {ifname!r} is the node's shared-map directory")
    return PIN_ROOT / lab / node / ifname


def node_dir_of(lab: str, node: str) -> Path:
    """Where the maps all ports of a node share are pinned."""
    for kind, name in (("lab", lab), ("node", node)):
        _check_name(kind, name)
    return PIN_ROOT / lab / node / NODE_DIR


@dataclass
class PortHandle:
    lab: str
    node: str
    netns: str
    ifname: str
    ifindex: int
    pin_dir: Path
    attach_method: str              # "pyroute2" or "tc" (nsenter fallback)
    maps: PortMaps = field(repr=False)
    peer: tuple[str, str, int] | None = None     # (netns, ifname, ifindex) of the departure hook

    def close(self) -> None:
        # a closed handle's maps must not be handed out again by path (_maps)
        if _open.get(str(self.pin_dir)) is self.maps:
            del _open[str(self.pin_dir)]
        self.maps.close()


def _rmtree(path: Path) -> None:
    """rm -r for bpffs: tolerant of entries vanishing underneath (a concurrent teardown)."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            _rmtree(Path(entry.path))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def _bpftool() -> str:
    bpftool = shutil.which("bpftool")
    if bpftool is None:
        raise PortProgError("bpftool not found, needed to load the port program: "
                            "install bpftool (Debian) or linux-tools (Ubuntu)")
    return bpftool


def _load_args(obj: Path, pin_dir: Path, node_dir: Path, reuse: bool) -> list[str]:
    """One instance of the object: both programs pinned in pin_dir/progs, every map in
    pin_dir/maps; with `reuse`, the node's shared maps are the ones pinned in node_dir."""
    argv = ["prog", "loadall", str(obj), str(pin_dir / "progs"), "type", "classifier"]
    if reuse:
        for name in NODE_MAPS:
            argv += ["map", "name", name, "pinned", str(node_dir / name)]
    return argv + ["pinmaps", str(pin_dir / "maps")]


def _pin_node_args(pin_dir: Path, node_dir: Path) -> list[list[str]]:
    """The first instance of a node hands its shared maps to the node directory."""
    return [["map", "pin", "pinned", str(pin_dir / "maps" / name), str(node_dir / name)]
            for name in NODE_MAPS]


def _prepare(pin_dir: Path) -> None:
    _forget(pin_dir)
    _rmtree(pin_dir)
    pin_dir.mkdir(parents=True)


def _loaded(pin_dir: Path) -> bool:
    return all((pin_dir / "progs" / p).exists() for p in ("port_egress", "port_departure"))


def _node_ready(node_dir: Path) -> bool:
    return all((node_dir / name).exists() for name in NODE_MAPS)


def load_programs(pin_dirs: list[Path], obj: Path | None = None) -> None:
    """Load a fresh program instance into each (emptied) pin dir; returns when all are
    loaded (`start_loading(...).wait()`)."""
    start_loading(pin_dirs, obj).wait()


# bpftool batches run side by side: the verifier (~4 ms a port, two programs) is CPU
# work in the calling process, so one batch per CPU divides the load's wall time.
MAX_LOAD_WORKERS = 4


def split_batches(nodes: list[list[list[str]]], workers: int) -> list[list[list[str]]]:
    """The batch files' lines: each node's lines (its first port making the node's
    shared maps, then its other ports) kept whole and in order, nodes spread over at most
    `workers` batches, each to the batch with the fewest lines so far."""
    shares: list[list[list[str]]] = [[] for _ in range(max(1, min(workers, len(nodes))))]
    for lines in sorted(nodes, key=len, reverse=True):
        min(shares, key=len).extend(lines)
    return shares


class Loading:
    """Program instances being loaded by `bpftool batch` processes (start_loading).

    `wait()` waits for them and checks every pin dir: bpftool 7.1's batch mode can
    report a stale errno at the end of its file even when every command ran, so success
    is judged by the pins, and a port whose programs are missing is loaded again on its
    own, which reports that port's own error. Always wait (also when the build fails),
    so no bpftool pins anything after the lab's pins were removed.
    """

    def __init__(self, obj: Path, pin_dirs: list[Path],
                 procs: list[tuple[subprocess.Popen, Path]]) -> None:
        self.obj, self.pin_dirs, self._procs = obj, pin_dirs, procs
        self.done = not procs

    def wait(self, check: bool = True) -> None:
        for proc, batch in self._procs:
            proc.communicate()
            batch.unlink(missing_ok=True)
        self._procs = []
        self.done = True
        if not check:
            return
        for pin_dir in self.pin_dirs:
            if not _loaded(pin_dir):
                _prepare(pin_dir)
                _bpftool_load(self.obj, pin_dir)


def start_loading(pin_dirs: list[Path], obj: Path | None = None,
                  workers: int | None = None) -> Loading:
    """Start loading a fresh program instance into each pin dir (emptied first), in
    `workers` `bpftool batch` processes (default: one per CPU, at most
    MAX_LOAD_WORKERS); returns at once. `Loading.wait()` before using them.

    Pin dirs are /sys/fs/bpf/tb/<lab>/<node>/<ifname>; the first port of each node
    creates the node's shared maps and pins them in <node>/_node, the node's other
    ports reuse them, so all ports of a node go to the same batch, in order. A bpftool
    process per port cost ~5 ms, most of it the process; in a batch a load costs ~4 ms,
    nearly all of it the verifier (two programs; bench/README.md).
    """
    obj = obj or ensure_object()
    for part in (obj, *pin_dirs):
        if any(c.isspace() or c in "\\'\"#" for c in str(part)):
            raise PortProgError(f"{part}: a path bpftool's batch mode cannot quote")
    if not pin_dirs:
        return Loading(obj, [], [])
    ensure_bpffs()
    by_node: dict[Path, list[list[str]]] = {}
    for pin_dir in pin_dirs:
        node_dir = pin_dir.parent / NODE_DIR
        _prepare(pin_dir)
        lines = by_node.get(node_dir)
        if lines is None:
            lines = by_node[node_dir] = []
            _forget(node_dir)
            _rmtree(node_dir)
            node_dir.mkdir(parents=True)
            lines.append(_load_args(obj, pin_dir, node_dir, reuse=False))
            lines += _pin_node_args(pin_dir, node_dir)
        else:
            lines.append(_load_args(obj, pin_dir, node_dir, reuse=True))
    shares = split_batches(list(by_node.values()),
                           workers or min(os.cpu_count() or 1, MAX_LOAD_WORKERS))
    bpftool = _bpftool()
    procs = []
    try:
        for share in shares:
            fd, name = tempfile.mkstemp(prefix="tb-bpftool-", suffix=".batch")
            with os.fdopen(fd, "w") as fh:
                fh.write("".join(" ".join(line) + "\n" for line in share))
            procs.append((subprocess.Popen([bpftool, "batch", "file", name],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                          Path(name)))
    except BaseException:
        Loading(obj, pin_dirs, procs).wait(check=False)
        raise
    return Loading(obj, pin_dirs, procs)


# --- one instance per lab ----------------------------------------------------------------
# The lab build of port.bpf.c (LAB_INSTANCE): two programs for the whole lab, every map
# name an ARRAY_OF_MAPS keyed by (ifindex << 1 | direction). Each port's and node's maps
# are made here, with the per-port build's types, sizes and flags, pinned where the
# per-port build pins them, and put into the outer maps; the kernel checks each against
# the outer map's template (type, key, value, flags) when it is inserted.
MAX_IFINDEX = 8192          #: lab-unique ifindexes must be below this (port.bpf.c)
MAX_PORT_KEYS = 2 * MAX_IFINDEX
MAX_NODES = 4096            #: elements of the lab's node_lock array
#: first lab-assigned ifindex: above what a new namespace may hold already (lo is 1; the
#: fallback tunnel devices sit0, tunl0, gre0, ... take the next ones where loaded)
FIRST_IFINDEX = 32
LAB_DIR = "_lab"            #: <lab>/_lab/{progs,maps}: the lab instance's own pins
BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_RINGBUF = 1, 2, 9, 27
BPF_F_MMAPABLE = 1 << 10
BPF_MAP_CREATE, BPF_OBJ_PIN, BPF_MAP_UPDATE_BATCH = 0, 6, 26


@dataclass(frozen=True)
class MapSpec:
    """What BPF_MAP_CREATE is given for one map (libbpf gives the per-port build's)."""
    map_type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int = 0


def _spec(name: str) -> MapSpec:
    size, entries = MAPS[name]
    if name == "events":
        return MapSpec(BPF_MAP_TYPE_RINGBUF, 0, 0, entries)
    if name == "ifslot":
        return MapSpec(BPF_MAP_TYPE_HASH, 4, size, entries)
    if name == "flow_drops":
        return MapSpec(BPF_MAP_TYPE_LRU_HASH, FLOW_KEY.size, size, entries)
    mmapable = BPF_F_MMAPABLE if name in ("state", "port_ingress", "node") else 0
    return MapSpec(BPF_MAP_TYPE_ARRAY, 4, size, entries, mmapable)


#: the per-port and per-node maps the lab instance reaches through its outer maps
#: (node_lock is not among them: an element of the lab's own node_lock array)
INNER_PORT_MAPS = tuple(PORT_MAPS)
INNER_NODE_MAPS = tuple(n for n in NODE_MAPS if n != "node_lock")
INNER_SPECS = {name: _spec(name) for name in (*INNER_PORT_MAPS, *INNER_NODE_MAPS)}


def lab_dir_of(lab: str) -> Path:
    _check_name("lab", lab)
    return PIN_ROOT / lab / LAB_DIR


def lab_ifindexes(plan_nodes: list[NodePlan]) -> dict[tuple[str, str], int]:
    """(node, ifname) -> the lab-unique ifindex the builder gives that interface:
    FIRST_IFINDEX on, in plan order. PortProgError if the lab has too many."""
    out: dict[tuple[str, str], int] = {}
    for node in plan_nodes:
        for iface in node.interfaces:
            out[(node.name, iface.ifname)] = FIRST_IFINDEX + len(out)
    if out and max(out.values()) >= MAX_IFINDEX:
        raise PortProgError(f"{len(out)} fabric interfaces: one port program instance per "
                            f"lab keys ports by ifindex, below {MAX_IFINDEX} "
                            f"(FIRST_IFINDEX {FIRST_IFINDEX}); raise MAX_IFINDEX in "
                            "port.bpf.c and portprog.py")
    return out


@dataclass(frozen=True)
class LabPort:
    """A port served by the lab instance: its egress runs on `ifindex`, its departures
    are counted at `peer_ifindex` (both lab-unique)."""
    node: str
    ifname: str
    ifindex: int
    peer_ifindex: int


def _create_map(spec: MapSpec, name: str) -> int:
    bpf = _Bpf()
    struct.pack_into("=7I16s", bpf.attr, 0, spec.map_type, spec.key_size, spec.value_size,
                     spec.max_entries, spec.flags, 0, 0, name.encode()[:15])
    return bpf.call(BPF_MAP_CREATE, f"MAP_CREATE {name}")


def _pin(fd: int, path: Path) -> None:
    bpf = _Bpf()
    cpath = ctypes.create_string_buffer(os.fsencode(str(path)))
    struct.pack_into("=QII", bpf.attr, 0, ctypes.addressof(cpath), fd, 0)
    bpf.call(BPF_OBJ_PIN, f"OBJ_PIN {path}")


def _update_batch(fd: int, name: str, entries: dict[int, int]) -> None:
    """Write u32 key -> u32 value pairs into an array (of maps) in one BPF_MAP_UPDATE_BATCH:
    the kernel waits for an RCU grace period after every syscall that changes a map of
    maps (~10 ms here), so one element at a time would cost seconds."""
    if not entries:
        return
    n = len(entries)
    keys = (ctypes.c_uint32 * n)(*entries.keys())
    values = (ctypes.c_uint32 * n)(*entries.values())
    bpf = _Bpf()
    struct.pack_into("=QQQQIIQQ", bpf.attr, 0, 0, 0, ctypes.addressof(keys),
                     ctypes.addressof(values), n, fd, 0, 0)
    try:
        bpf.call(BPF_MAP_UPDATE_BATCH, f"MAP_UPDATE_BATCH {name}")
    except OSError as exc:
        raise PortProgError(
            f"the kernel refused to put {n} maps into the lab instance's {name!r} map "
            f"({exc.strerror}): the lab build of the port program needs Linux 5.19 or "
            "later (batch updates of an array of maps; ring buffers and mmap-able arrays "
            "as inner maps); set TESTBED_PORTPROG=per-port to load one instance per "
            "port") from None


def _fill_outer_maps(maps_dir: Path, entries: dict[str, dict[int, int]]) -> None:
    """Each outer map's entries in one batch, all maps at once: every batch waits for an
    RCU grace period (~10-20 ms), and waits that overlap end together."""
    errors: list[BaseException] = []

    def fill(name: str) -> None:
        try:
            outer = obj_get(maps_dir / name)
            try:
                _update_batch(outer, name, entries[name])
            finally:
                os.close(outer)
        except BaseException as exc:        # raised below, in the loading thread
            errors.append(exc)

    threads = [threading.Thread(target=fill, args=(name,), name=f"portprog-{name}")
               for name in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class LabLoading:
    """The lab's one program instance being loaded (one bpftool process, two programs
    through the verifier) while a thread of this process makes every node's and port's
    maps, pins them, and puts them into the outer maps (start_lab_loading).

    Same contract as `Loading`: always `wait()`, also when the build fails.
    """

    def __init__(self, lab: str, ports: list[LabPort], obj: Path) -> None:
        self.lab, self.ports, self.obj = lab, ports, obj
        self.pin_dirs = [pin_dir_of(lab, p.node, p.ifname) for p in ports]
        self.error: BaseException | None = None
        self.done = False
        self.loads = 1                  # bpftool program loads (two programs each)
        self._thread = threading.Thread(target=self._run, name=f"portprog-{lab}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._make()
        except BaseException as exc:    # handed to wait()
            self.error = exc

    def _make(self) -> None:
        lab_dir = lab_dir_of(self.lab)
        _rmtree(lab_dir)
        lab_dir.mkdir(parents=True)
        proc = subprocess.Popen([_bpftool(), "prog", "loadall", str(self.obj),
                                 str(lab_dir / "progs"), "type", "classifier", "pinmaps",
                                 str(lab_dir / "maps")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        fds: list[int] = []
        try:
            inner, node_of_key = self._make_maps(fds)   # beside the verifier's run
            _, err = proc.communicate()
            if proc.returncode != 0 or not _loaded(lab_dir):
                tail = "\n".join(err.strip().splitlines()[-25:])
                raise PortProgError(f"bpftool prog loadall {self.obj} failed for lab "
                                    f"{self.lab} (exit {proc.returncode}):\n{tail}")
            _fill_outer_maps(lab_dir / "maps", {**inner, "port_node": node_of_key})
            for prog in ("port_egress", "port_departure"):
                fd = obj_get(lab_dir / "progs" / prog)
                try:
                    for pin_dir in self.pin_dirs:       # where the per-port build pins them
                        _pin(fd, pin_dir / "progs" / prog)
                finally:
                    os.close(fd)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for fd in fds:
                os.close(fd)

    def _make_maps(self, fds: list[int]) -> tuple[dict[str, dict[int, int]], dict[int, int]]:
        """Every node's and port's maps, made and pinned (their fds appended to `fds`);
        returns (outer map name -> key -> inner map fd, key -> node index)."""
        inner: dict[str, dict[int, int]] = {name: {} for name in INNER_SPECS}
        node_of_key: dict[int, int] = {}
        node_fds: dict[str, dict[str, int]] = {}
        for port, pin_dir in zip(self.ports, self.pin_dirs, strict=True):
            if port.node not in node_fds:
                if len(node_fds) >= MAX_NODES:
                    raise PortProgError(f"more than {MAX_NODES} nodes in lab {self.lab}")
                node_dir = pin_dir.parent / NODE_DIR
                _forget(node_dir)
                _rmtree(node_dir)
                node_dir.mkdir(parents=True)
                node_fds[port.node] = {}
                for name in INNER_NODE_MAPS:
                    fds.append(_create_map(INNER_SPECS[name], name))
                    node_fds[port.node][name] = fds[-1]
                    _pin(fds[-1], node_dir / name)
            _prepare(pin_dir)
            (pin_dir / "maps").mkdir()
            (pin_dir / "progs").mkdir()
            mine = dict(node_fds[port.node])
            for name in INNER_PORT_MAPS:
                fds.append(_create_map(INNER_SPECS[name], name))
                mine[name] = fds[-1]
                _pin(fds[-1], pin_dir / "maps" / name)
            for ifindex, direction in ((port.ifindex, 0), (port.peer_ifindex, 1)):
                if not 1 < ifindex < MAX_IFINDEX:
                    raise PortProgError(f"{port.node}/{port.ifname}: ifindex {ifindex} "
                                        f"outside 2..{MAX_IFINDEX - 1}")
                key = ifindex << 1 | direction
                if key in node_of_key:
                    raise PortProgError(f"{port.node}/{port.ifname}: ifindex {ifindex} is "
                                        "another port's too (the lab instance needs "
                                        "lab-unique ifindexes)")
                node_of_key[key] = list(node_fds).index(port.node)
                for name, fd in mine.items():
                    inner[name][key] = fd
        return inner, node_of_key

    def check_ifindexes(self, index: dict[str, dict[str, int]],
                        netns_of: dict[str, str]) -> None:
        """The interfaces have the ifindexes the instance keys their ports by (node ->
        ifname -> ifindex, as dumped); a port keyed by another would go uncounted."""
        peer_of = {p.peer_ifindex: p for p in self.ports}
        for port in self.ports:
            got = index.get(port.node, {}).get(port.ifname)
            if got != port.ifindex:
                raise PortProgError(f"{netns_of.get(port.node, port.node)}/{port.ifname} has "
                                    f"ifindex {got}, the lab's port program expects "
                                    f"{port.ifindex}: the interface was not made by the "
                                    "builder's step 2 (lab_ifindexes)")
        missing = set(peer_of) - {p.ifindex for p in self.ports}
        if missing:
            raise PortProgError(f"departure ifindexes {sorted(missing)[:5]} are no port of "
                                "this lab")

    def wait(self, check: bool = True) -> None:
        self._thread.join()
        self.done = True
        if check and self.error is not None:
            raise self.error


def departure_hook(plan: Plan, node: str, ifname: str) -> tuple[str, int] | None:
    """(namespace, ifindex) where the lab instance counts this port's departures (its
    peer's), None if the lab was loaded per port (its own instance ignores the device)."""
    if not (lab_dir_of(plan.lab) / "progs" / "port_departure").exists():
        return None
    iface = next(i for i in plan.node(node).interfaces if i.ifname == ifname)
    peer = iface.peer
    return plan.node(peer.node).netns, lab_ifindexes(list(plan.nodes))[(peer.node,
                                                                        peer.ifname)]


def start_lab_loading(lab: str, ports: list[LabPort], obj: Path | None = None) -> LabLoading:
    """Start loading the lab's one program instance and making its ports' maps (see
    LabLoading); returns at once. `obj`: the lab build (ensure_object(defines=LAB_DEFINES))."""
    obj = obj or ensure_object(defines=LAB_DEFINES)
    _bpftool()                  # missing: say so now, not from the loading thread
    ensure_bpffs()
    return LabLoading(lab, ports, obj)


def _bpftool_load(obj: Path, pin_dir: Path) -> None:
    """One instance on its own: reuses the node's shared maps if they are pinned, else
    creates and pins them."""
    node_dir = pin_dir.parent / NODE_DIR
    reuse = _node_ready(node_dir)
    commands = [_load_args(obj, pin_dir, node_dir, reuse)]
    if not reuse:
        _rmtree(node_dir)
        node_dir.mkdir(parents=True)
        commands += _pin_node_args(pin_dir, node_dir)
    for args in commands:
        res = subprocess.run([_bpftool(), *args], capture_output=True, text=True)
        if res.returncode != 0:
            tail = "\n".join(res.stderr.strip().splitlines()[-25:])
            raise PortProgError(f"bpftool {' '.join(args[:2])} failed for {pin_dir} "
                                f"(exit {res.returncode}):\n{tail}")


def _attach_pyroute2(ipr, ifindex: int, prog_fd: int, parent: int, name: str) -> None:
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr.tc("add", "clsact", ifindex)
    except NetlinkError as exc:
        if exc.code != errno.EEXIST:
            raise
    ipr.tc("replace-filter", "bpf", ifindex, FILTER_HANDLE, fd=prog_fd, name=name,
           parent=parent, prio=FILTER_PRIO, protocol=ETH_P_ALL, classid=1,
           direct_action=True)


def _attach_tc(netns: str, ifname: str, pin: Path, direction: str) -> None:
    # nsenter --net switches only the network namespace: bpffs stays visible
    # (`ip netns exec` remounts /sys and would hide /sys/fs/bpf).
    nsenter = ["nsenter", f"--net=/var/run/netns/{netns}", "tc"]
    res = subprocess.run([*nsenter, "qdisc", "add", "dev", ifname, "clsact"],
                         capture_output=True, text=True)
    if res.returncode != 0 and "File exists" not in res.stderr:
        raise PortProgError(f"tc qdisc add clsact on {netns}/{ifname} failed: "
                            f"{res.stderr.strip()}")
    res = subprocess.run([*nsenter, "filter", "replace", "dev", ifname, direction, "prio",
                          str(FILTER_PRIO), "handle", str(FILTER_HANDLE), "bpf", "da",
                          "pinned", str(pin)], capture_output=True, text=True)
    if res.returncode != 0:
        raise PortProgError(f"tc filter add bpf on {netns}/{ifname} failed: "
                            f"{res.stderr.strip()}")


def attach_port(lab: str, node: str, netns: str, ifname: str, params: PortParams, *,
                peer: tuple[str, str], ipr=None, peer_ipr=None, obj: Path | None = None,
                loaded: bool = False, ifindex: int | None = None,
                peer_ifindex: int | None = None) -> PortHandle:
    """Load a program instance for one port, configure it, attach `port_departure` at
    the clsact ingress of its veth peer `peer` = (netns, ifname), then `port_egress` at
    the port's clsact egress (departures first: nothing admitted goes unseen).

    `ipr` / `peer_ipr` may be open pyroute2 IPRoutes inside the two namespaces (the
    builder's), else they are opened. `loaded`: `load_programs` already loaded this
    port's instance. `ifindex` / `peer_ifindex`: if the caller knows them. The node's
    shared maps are reused when pinned, else made; configure them with
    `configure_node`. Attaching again replaces the port's programs and state.
    """
    params.check()
    pin_dir = pin_dir_of(lab, node, ifname)
    if not loaded:
        obj = obj or ensure_object()
        ensure_bpffs()
        _prepare(pin_dir)
        _bpftool_load(obj, pin_dir)
    maps = PortMaps(pin_dir)
    try:
        maps.write_params(params)
        _method, peer_index = _attach(peer[0], peer[1], pin_dir / "progs" / "port_departure",
                                      peer_ipr, peer_ifindex, CLSACT_INGRESS)
        method, ifindex = _attach(netns, ifname, pin_dir / "progs" / "port_egress", ipr,
                                  ifindex, CLSACT_EGRESS)
    except BaseException:
        maps.close()
        raise
    _open[str(pin_dir)] = maps
    return PortHandle(lab, node, netns, ifname, ifindex, pin_dir, method, maps,
                      (peer[0], peer[1], peer_index))


def _attach(netns: str, ifname: str, pin: Path, ipr, ifindex: int | None,
            parent: int) -> tuple[str, int]:
    """Attach the program pinned at `pin` (named as its pin) to the interface's clsact
    `parent`: by pyroute2 on `ipr` (opened if None), else by tc. (method, ifindex)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    own = ipr is None
    if own:
        ipr = IPRoute(netns=netns)
    try:
        if ifindex is None:
            found = ipr.link_lookup(ifname=ifname)
            if not found:
                raise PortProgError(f"no interface {ifname!r} in namespace {netns!r}")
            ifindex = found[0]
        prog_fd = obj_get(pin)
        try:
            _attach_pyroute2(ipr, ifindex, prog_fd, parent, pin.name)
            return "pyroute2", ifindex
        except NetlinkError as exc:
            first = exc
        finally:
            os.close(prog_fd)
    finally:
        if own:
            ipr.close()
    try:
        _attach_tc(netns, ifname, pin, "ingress" if parent == CLSACT_INGRESS else "egress")
    except PortProgError as exc:
        raise PortProgError(f"attaching to {netns}/{ifname}: pyroute2 said {first}; {exc}") \
            from None
    return "tc", ifindex


# --- attach in a netlink batch -----------------------------------------------------------
# The builder queues these on each namespace's NetlinkBatch (testbed/net/batch.py) instead
# of one pyroute2 request at a time (~1.2 ms a request, most of it pyroute2's encoding).
# Byte for byte what pyroute2's IPRoute.tc sends for the same call (tests/unit/
# test_portprog_messages.py checks that against IPBatch).
_NLMSG = struct.Struct("=IHHII")           # length, type, flags, seq, port id
_TCMSG = struct.Struct("=BxxxiIII")        # family, ifindex, handle, parent, info
RTM_NEWQDISC = 36
RTM_NEWTFILTER = 44
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_REPLACE, _NLM_F_EXCL, _NLM_F_CREATE = 1, 4, 0x100, \
    0x200, 0x400
TC_H_CLSACT = 0xFFFFFFF1
CLSACT_HANDLE = 0xFFFF0000
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_BPF_CLASSID, TCA_BPF_FD, TCA_BPF_NAME, TCA_BPF_FLAGS = 3, 6, 7, 8
TCA_BPF_FLAG_ACT_DIRECT = 1


def _rtattr(kind: int, payload: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(payload), kind) + payload + bytes(-len(payload) % 4)


def _tc_message(mtype: int, flags: int, ifindex: int, handle: int, parent: int, info: int,
                attrs: bytes) -> bytes:
    body = _TCMSG.pack(0, ifindex, handle, parent, info) + attrs
    return _NLMSG.pack(_NLMSG.size + len(body), mtype, flags, 0, 0) + body


def clsact_message(ifindex: int) -> bytes:
    """`tc qdisc add dev IF clsact` (fails with EEXIST when the device has one)."""
    return _tc_message(RTM_NEWQDISC, _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_EXCL | _NLM_F_CREATE,
                       ifindex, CLSACT_HANDLE, TC_H_CLSACT, 0, _rtattr(TCA_KIND, b"clsact\0"))


def bpf_filter_message(ifindex: int, parent: int, prog_fd: int, name: str) -> bytes:
    """`tc filter replace dev IF {ingress|egress} prio FILTER_PRIO handle FILTER_HANDLE
    protocol all bpf da fd PROG_FD name NAME` (classid 1), as `_attach_pyroute2` sends it.
    The fd must stay open until the kernel has answered the request."""
    options = (_rtattr(TCA_BPF_CLASSID, struct.pack("=I", 1))
               + _rtattr(TCA_BPF_FD, struct.pack("=I", prog_fd))
               + _rtattr(TCA_BPF_NAME, name.encode() + b"\0")
               + _rtattr(TCA_BPF_FLAGS, struct.pack("=I", TCA_BPF_FLAG_ACT_DIRECT)))
    info = (FILTER_PRIO << 16) | socket.htons(ETH_P_ALL)
    return _tc_message(RTM_NEWTFILTER, _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE
                       | _NLM_F_REPLACE, ifindex, FILTER_HANDLE, parent, info,
                       _rtattr(TCA_KIND, b"bpf\0") + _rtattr(TCA_OPTIONS, options))


def configure_node(lab: str, node: str, params: NodeParams) -> None:
    """Write a node's buffer model, ingress thresholds and ifindex -> slot map."""
    maps = NodeMaps(node_dir_of(lab, node))
    try:
        maps.write_params(params)
    finally:
        maps.close()


def detach_port(handle: PortHandle) -> None:
    """Take the programs off the port (its clsact qdisc goes too) and off its peer
    (the departure filter only: the peer's own program stays), and unpin the port."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with contextlib.suppress(NetlinkError, OSError):   # namespace or link may be gone
        with IPRoute(netns=handle.netns) as ipr:
            ipr.tc("del", "clsact", handle.ifindex)
    if handle.peer is not None:
        with contextlib.suppress(NetlinkError, OSError):
            with IPRoute(netns=handle.peer[0]) as ipr:
                ipr.tc("del-filter", "bpf", handle.peer[2], FILTER_HANDLE,
                       parent=CLSACT_INGRESS, prio=FILTER_PRIO, protocol=ETH_P_ALL)
    _forget(handle.pin_dir)
    _rmtree(handle.pin_dir)


def detach_lab(lab: str) -> bool:
    """Unpin everything under /sys/fs/bpf/tb/<lab>; True if there was something.

    Safe after a crash or SIGKILL and when parts are missing. Programs stay
    attached to ports until their namespaces (or links) go away.
    """
    _check_name("lab", lab)
    path = PIN_ROOT / lab
    _forget(path)
    if not path.exists():
        return False
    _rmtree(path)
    return True


def detach_nodes(lab: str, nodes: list[str]) -> None:
    """Unpin the given nodes of a lab (one VM's part), and the lab's directory once
    nothing else is pinned in it."""
    _check_name("lab", lab)
    for node in nodes:
        _check_name("node", node)
        path = PIN_ROOT / lab / node
        _forget(path)
        if path.exists():
            _rmtree(path)
    try:
        (PIN_ROOT / lab).rmdir()
    except OSError:
        pass        # another part's nodes are still pinned here, or it is gone


def pinned_labs() -> list[str]:
    """Labs with pins under /sys/fs/bpf/tb (for `down --all` after a crash)."""
    try:
        return sorted(e.name for e in os.scandir(PIN_ROOT) if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


# --- run-time operations -----------------------------------------------------------------


def open_port(pin_dir: str | Path) -> PortMaps:
    """Open a port's maps once (a sampler keeps them for the run; close() when done).

    Raises OSError (ENOENT) when no program is pinned there.
    """
    return PortMaps(Path(pin_dir))


def open_node_ports(lab: str, node: NodePlan) -> list[tuple[str, PortMaps]]:
    """The maps of every port of a node that has a program pinned (ifname, maps); close
    each when done. Ports without one (no datapath, or a lab half torn down) are left out."""
    out = []
    for iface in node.interfaces:
        try:
            out.append((iface.ifname, open_port(pin_dir_of(lab, node.name, iface.ifname))))
        except (OSError, PortProgError):
            continue
    return out


def open_node(lab: str, node: str, events: bool = False) -> NodeMaps:
    """Open a node's shared maps (close() when done); `events`: also its ring buffer."""
    return NodeMaps(node_dir_of(lab, node), events=events)


def update_params(target: PortHandle | PortMaps | str | Path, params: PortParams) -> None:
    """Rewrite thresholds, probabilities and the DSCP map; queues and counters stay."""
    _maps(target).write_params(params)


def reset_state(target: PortHandle | PortMaps | str | Path) -> None:
    """Empty the queues and zero the counters of a port (only while no packet moves)."""
    _maps(target).reset()


def read_counters(target: PortHandle | PortMaps | str | Path) -> dict[int, ClassCounters]:
    """Counters of classes 0..7 and of non-IPv4 frames (key OTHER)."""
    return _maps(target).read()


# --- command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.net.portprog",
                                     description="build or inspect the port program")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="compile port.bpf.c (and rxe_cc.bpf.c) into the "
                           "cache, print the port program's path")
    build.add_argument("--cache-dir", type=Path)
    show = sub.add_parser("counters", help="print a port's counters as JSON")
    show.add_argument("pin_dir", type=Path, help="/sys/fs/bpf/tb/<lab>/<node>/<ifname>")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            ensure_object(args.cache_dir, RXE_CC_SOURCE)     # the rxe counters, cached beside
            ensure_object(args.cache_dir, defines=LAB_DEFINES)  # the lab build, beside
            print(ensure_object(args.cache_dir))
        else:
            counters = read_counters(args.pin_dir)
            print(json.dumps({str(k): v._asdict() for k, v in counters.items()}, indent=1))
    except (PortProgError, OSError) as exc:
        print(f"portprog: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
