"""The port program: compile, load, attach, configure and read it.

One instance of `testbed/net/bpf/port.bpf.c` runs at clsact egress of every
fabric port. It keeps a virtual queue per traffic class (drained at the
port's wall rate, frozen while the class is paused), marks CE on the
DCQCN curve, drops with a configured probability and counts per class
(docs/datapath.md). This module is the only code that loads BPF:

    obj = ensure_object()                               # clang, cached by source hash
    handle = attach_port(lab, node, netns, ifname, params_from_egress(egress, loss))
    set_paused(handle, 3, True)                         # a PFC agent's gate
    read_counters(handle)[3].ce_marks                   # a few syscalls, no netlink
    detach_lab(lab)                                     # rm -r /sys/fs/bpf/tb/<lab>

Each port gets its own program instance, its maps pinned under
/sys/fs/bpf/tb/<lab>/<node>/<ifname>/maps/ (the program at .../prog), so
ports never share state and a lab's pins go with one directory removal, even
after the process that made them was killed.

Maps are read and written with the bpf(2) syscall through ctypes (no libbpf
in the process): BPF_OBJ_GET for a pin, MAP_LOOKUP/UPDATE_ELEM, and
MAP_LOOKUP_BATCH to read all classes of a port in one call. Values that hold
a bpf_spin_lock are read and written with BPF_F_LOCK, so a reader never sees
a half-updated queue.
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
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from testbed.net.bpf import PORT_SOURCE
from testbed.plan.model import EgressPlan

# --- layouts shared with port.bpf.c ------------------------------------------------------

NUM_TC = 8
OTHER = NUM_TC              #: read_counters key of non-IPv4 frames (ARP, PFC, IPv6)
NUM_SLOTS = NUM_TC + 1
NUM_DSCP = 64
FP_SHIFT = 32
FP_ONE = 1 << FP_SHIFT      #: probability 1.0; also 1 byte of vq / 1 byte per ns of rate
MAX_THRESHOLD_SPAN = 1 << 31  # kmax - kmin must stay below this (64-bit products in C)

PORT_CFG = struct.Struct("=QII")
PORT_CFG_FIELDS = ("rate_fp", "overhead_bytes", "default_tc")
CLASS_CFG = struct.Struct("=5QII")
CLASS_CFG_FIELDS = ("kmin_bytes", "kmax_bytes", "pmax_fp", "drop_fp", "limit_bytes",
                    "ecn_enabled", "pad")
PAUSE = struct.Struct("=IIQQ")
PAUSE_FIELDS = ("lock", "paused", "since_ns", "paused_total_ns")
STATE = struct.Struct("=II13Q")
STATE_FIELDS = ("lock", "pad", "vq_fp", "last_ns", "paused_seen_ns", "packets", "bytes",
                "ect_packets", "ce_arrivals", "ce_marks", "would_mark", "drops", "vq_overflows",
                "max_vq_bytes", "mark_errors")
#: C struct name -> (Python layout, field names), checked against the object's BTF in tests
LAYOUTS = {
    "port_cfg": (PORT_CFG, PORT_CFG_FIELDS),
    "class_cfg": (CLASS_CFG, CLASS_CFG_FIELDS),
    "pause_state": (PAUSE, PAUSE_FIELDS),
    "class_state": (STATE, STATE_FIELDS),
}
#: map name -> (value size, entries); sizes are _Static_assert-ed in the C source too
MAPS = {
    "cfg": (PORT_CFG.size, 1),
    "dscp_tc": (4, NUM_DSCP),
    "class_cfg": (CLASS_CFG.size, NUM_TC),
    "pause": (PAUSE.size, NUM_TC),
    "state": (STATE.size, NUM_SLOTS),
}

BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "tb"
CACHE_DIR = Path("/var/cache/testbed/bpf")
CLSACT_EGRESS = 0xFFFFFFF3      # "ffff:fff3"
FILTER_PRIO = 1
FILTER_HANDLE = 1
ETH_P_ALL = 0x0003
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")


class PortProgError(RuntimeError):
    """Building, loading or attaching the port program failed; says what to do."""


# --- parameters --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassParams:
    kmin_bytes: int = 0
    kmax_bytes: int = 0
    pmax: float | None = None        # None: this class never marks
    drop_probability: float = 0.0    # PHY frame loss or explicit impairment
    limit_bytes: int = 0             # leaf buffer (arrivals beyond it skip the vq); 0: none


@dataclass(frozen=True)
class PortParams:
    wall_rate_bps: int
    overhead_bytes: int = 24
    dscp_to_tc: Mapping[int, int] = field(default_factory=dict)
    default_tc: int = 0
    classes: Mapping[int, ClassParams] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = []
        if self.wall_rate_bps <= 0:
            out.append(f"wall_rate_bps must be > 0, got {self.wall_rate_bps}")
        if not 0 <= self.overhead_bytes < 1 << 16:
            out.append(f"overhead_bytes out of range: {self.overhead_bytes}")
        if not 0 <= self.default_tc < NUM_TC:
            out.append(f"default_tc must be 0..{NUM_TC - 1}, got {self.default_tc}")
        for dscp, tc in self.dscp_to_tc.items():
            if not 0 <= dscp < NUM_DSCP or not 0 <= tc < NUM_TC:
                out.append(f"dscp_to_tc[{dscp}] = {tc}: DSCP 0..63 to class 0..7")
        for tc, cls in self.classes.items():
            where = f"classes[{tc}]"
            if not 0 <= tc < NUM_TC:
                out.append(f"{where}: class must be 0..{NUM_TC - 1}")
            if not 0 <= cls.drop_probability <= 1:
                out.append(f"{where}.drop_probability must be in [0, 1]")
            if cls.limit_bytes < 0:
                out.append(f"{where}.limit_bytes must be >= 0")
            if cls.pmax is None:
                continue
            if not 0 <= cls.pmax <= 1:
                out.append(f"{where}.pmax must be in [0, 1]")
            if not 0 <= cls.kmin_bytes <= cls.kmax_bytes:
                out.append(f"{where}: need 0 <= kmin_bytes <= kmax_bytes, "
                           f"got {cls.kmin_bytes} / {cls.kmax_bytes}")
            elif cls.kmax_bytes - cls.kmin_bytes >= MAX_THRESHOLD_SPAN:
                out.append(f"{where}: kmax_bytes - kmin_bytes must be below 2 GiB")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid port parameters: " + "; ".join(problems))


def params_from_egress(egress: EgressPlan, drop_probability: float = 0.0) -> PortParams:
    """Port program parameters of one planned egress port.

    `drop_probability` applies to every class (a link's frame-loss ratio hits
    all traffic alike). DSCPs no class lists go to the plan's default class,
    the one HTB's `default` sends unclassified traffic to.
    """
    default_tc = next((c.tc for c in egress.classes if c.classid == egress.default_classid),
                      None)
    if default_tc is None:
        raise ValueError(f"default class {egress.default_classid} is not among the classes")
    return PortParams(
        wall_rate_bps=egress.wall_rate_bps,
        overhead_bytes=egress.overhead_bytes,
        dscp_to_tc={d: c.tc for c in egress.classes for d in c.dscp},
        default_tc=default_tc,
        classes={c.tc: ClassParams(
            kmin_bytes=c.ecn.kmin_bytes if c.ecn else 0,
            kmax_bytes=c.ecn.kmax_bytes if c.ecn else 0,
            pmax=c.ecn.pmax if c.ecn else None,
            drop_probability=drop_probability,
            limit_bytes=c.limit_bytes,
        ) for c in egress.classes},
    )


# --- fixed-point encodings ---------------------------------------------------------------


def probability_fp(p: float) -> int:
    """p in [0, 1] as the C side compares it: a u32 random r hits iff r < result."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability must be in [0, 1], got {p}")
    return round(p * FP_ONE)


def rate_fp(wall_rate_bps: int) -> int:
    """Wall bits per second as bytes per nanosecond, 32.32 fixed point (rounded)."""
    return ((wall_rate_bps << FP_SHIFT) + 4_000_000_000) // 8_000_000_000


def mark_probability(vq_bytes: int, kmin_bytes: int, kmax_bytes: int, pmax: float) -> float:
    """Exact probability that the program marks a packet finding `vq_bytes` queued."""
    if vq_bytes > kmax_bytes:
        return 1.0
    if vq_bytes <= kmin_bytes:
        return 0.0
    # hits: r in [0, 2^32) with r * span < pmax_fp * (vq - kmin)
    span = kmax_bytes - kmin_bytes
    hits = -(-probability_fp(pmax) * (vq_bytes - kmin_bytes) // span)
    return min(hits, FP_ONE) / FP_ONE


def encode_port_cfg(params: PortParams) -> bytes:
    return PORT_CFG.pack(rate_fp(params.wall_rate_bps), params.overhead_bytes, params.default_tc)


def encode_class_cfg(cls: ClassParams | None) -> bytes:
    if cls is None:
        return CLASS_CFG.pack(0, 0, 0, 0, 0, 0, 0)
    ecn = cls.pmax is not None
    return CLASS_CFG.pack(cls.kmin_bytes if ecn else 0, cls.kmax_bytes if ecn else 0,
                          probability_fp(cls.pmax) if ecn else 0,
                          probability_fp(cls.drop_probability), cls.limit_bytes, int(ecn), 0)


def dscp_table(params: PortParams) -> list[int]:
    """Class of every DSCP, the default class filled in where the map is silent."""
    return [params.dscp_to_tc.get(d, params.default_tc) for d in range(NUM_DSCP)]


# --- bpf(2) ------------------------------------------------------------------------------

_NR_BPF = {"x86_64": 321, "aarch64": 280, "armv7l": 386, "riscv64": 280, "ppc64le": 361,
           "s390x": 351}
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_GET_NEXT_KEY = 1, 2, 4
BPF_OBJ_GET, BPF_OBJ_GET_INFO_BY_FD, BPF_MAP_LOOKUP_BATCH = 7, 15, 24
BPF_ANY, BPF_F_LOCK = 0, 4
_ENOTSUPP = 524     # kernel-internal "not supported" that bpf(2) can leak
_ATTR_SIZE = 128   # larger than any command's part of union bpf_attr we use; rest zero

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_uint]


def _nr_bpf() -> int:
    try:
        return _NR_BPF[platform.machine()]
    except KeyError:
        raise PortProgError(f"no bpf(2) syscall number known for {platform.machine()}") from None


class _Bpf:
    """bpf(2) with preallocated attribute buffers; one per map so calls allocate nothing."""

    def __init__(self) -> None:
        self.nr = _nr_bpf()
        self.attr = ctypes.create_string_buffer(_ATTR_SIZE)
        self.addr = ctypes.addressof(self.attr)

    def call(self, cmd: int, what: str) -> int:
        ret = _syscall(self.nr, cmd, self.addr, _ATTR_SIZE)
        if ret < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"bpf({what}): {os.strerror(err)}")
        return ret

    def clear(self) -> None:
        ctypes.memset(self.addr, 0, _ATTR_SIZE)


def obj_get(path: str | Path) -> int:
    """File descriptor of a pinned BPF object (BPF_OBJ_GET); the caller closes it."""
    bpf = _Bpf()
    name = ctypes.create_string_buffer(os.fsencode(str(path)))
    struct.pack_into("=QII", bpf.attr, 0, ctypes.addressof(name), 0, 0)
    return bpf.call(BPF_OBJ_GET, f"OBJ_GET {path}")


def map_info(fd: int) -> tuple[int, int, int, int, str]:
    """(type, key_size, value_size, max_entries, name) of a map fd."""
    bpf = _Bpf()
    info = ctypes.create_string_buffer(80)
    struct.pack_into("=IIQ", bpf.attr, 0, fd, len(info), ctypes.addressof(info))
    bpf.call(BPF_OBJ_GET_INFO_BY_FD, "OBJ_GET_INFO_BY_FD")
    kind, _id, key_size, value_size, entries, _flags = struct.unpack_from("=6I", info, 0)
    name = info.raw[24:40].split(b"\0", 1)[0].decode()
    return kind, key_size, value_size, entries, name


class BpfMap:
    """An open array map with u32 keys: element and batch access."""

    def __init__(self, fd: int, value_size: int, entries: int, name: str = "") -> None:
        self.fd = fd
        self.name = name
        self.value_size = value_size
        self.entries = entries
        self.bpf = _Bpf()
        self.key = ctypes.c_uint32(0)
        self.next_key = ctypes.c_uint32(0)
        self.value = ctypes.create_string_buffer(value_size)
        self.keys = (ctypes.c_uint32 * entries)()
        self.values = ctypes.create_string_buffer(value_size * entries)
        self.out_batch = ctypes.c_uint32(0)
        self._batch_ok = True
        self._batch_checked = False

    @classmethod
    def open_pinned(cls, path: Path, value_size: int, entries: int) -> BpfMap:
        fd = obj_get(path)
        try:
            _kind, key_size, got_size, got_entries, name = map_info(fd)
            if (key_size, got_size, got_entries) != (4, value_size, entries):
                raise PortProgError(
                    f"{path}: map has key/value/entries {key_size}/{got_size}/{got_entries}, "
                    f"this testbed expects 4/{value_size}/{entries}; it was loaded from another "
                    "version of port.bpf.c - detach the lab and attach again")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, value_size, entries, name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def lookup(self, key: int, flags: int = 0) -> bytes:
        self.key.value = key
        b = self.bpf
        b.clear()
        struct.pack_into("=IIQQQ", b.attr, 0, self.fd, 0, ctypes.addressof(self.key),
                         ctypes.addressof(self.value), flags)
        b.call(BPF_MAP_LOOKUP_ELEM, f"MAP_LOOKUP_ELEM {self.name}[{key}]")
        return self.value.raw

    def update(self, key: int, value: bytes, flags: int = BPF_ANY) -> None:
        if len(value) != self.value_size:
            raise ValueError(f"{self.name}: value of {len(value)} bytes, map holds "
                             f"{self.value_size}")
        self.key.value = key
        ctypes.memmove(self.value, value, self.value_size)
        b = self.bpf
        b.clear()
        struct.pack_into("=IIQQQ", b.attr, 0, self.fd, 0, ctypes.addressof(self.key),
                         ctypes.addressof(self.value), flags)
        b.call(BPF_MAP_UPDATE_ELEM, f"MAP_UPDATE_ELEM {self.name}[{key}]")

    def next_key_of(self, key: int | None) -> int | None:
        b = self.bpf
        b.clear()
        self.key.value = key or 0
        struct.pack_into("=IIQQ", b.attr, 0, self.fd, 0,
                         0 if key is None else ctypes.addressof(self.key),
                         ctypes.addressof(self.next_key))
        try:
            b.call(BPF_MAP_GET_NEXT_KEY, f"MAP_GET_NEXT_KEY {self.name}")
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        return self.next_key.value

    def lookup_all(self, flags: int = 0) -> memoryview:
        """Every value, key order, in one BPF_MAP_LOOKUP_BATCH (element calls if unsupported)."""
        if self._batch_ok:
            b = self.bpf
            b.clear()
            struct.pack_into("=QQQQIIQQ", b.attr, 0, 0, ctypes.addressof(self.out_batch),
                             ctypes.addressof(self.keys), ctypes.addressof(self.values),
                             self.entries, self.fd, flags, 0)
            count = -1
            try:
                b.call(BPF_MAP_LOOKUP_BATCH, f"MAP_LOOKUP_BATCH {self.name}")
                count = self.entries
            except OSError as exc:
                if exc.errno == errno.ENOENT:       # "no more": count says how many came
                    count = struct.unpack_from("=I", b.attr, 32)[0]
                elif exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, _ENOTSUPP):
                    raise
            if count == self.entries and (self._batch_checked or
                                          list(self.keys) == list(range(self.entries))):
                self._batch_checked = True
                return memoryview(self.values).cast("B")
            self._batch_ok = False
        for key in range(self.entries):
            value = self.lookup(key, flags)
            ctypes.memmove(ctypes.addressof(self.values) + key * self.value_size, value,
                           self.value_size)
        return memoryview(self.values).cast("B")


# --- counters ----------------------------------------------------------------------------


class ClassCounters(NamedTuple):
    packets: int            # arrivals (drops included)
    bytes: int              # skb->len of arrivals
    ect_packets: int        # ECT(0)/ECT(1) arrivals
    ce_arrivals: int        # arrivals already CE
    ce_marks: int           # ECT -> CE done at this port
    would_mark: int         # non-ECT arrivals the curve picked
    drops: int              # dropped by drop_probability (never queued)
    vq_overflows: int       # arrivals beyond limit_bytes (the leaf tail-drops them)
    max_vq_bytes: int
    mark_errors: int
    vq_bytes: int           # virtual queue now (drained up to the read)
    paused: bool
    last_ns: int            # CLOCK_MONOTONIC of the last arrival


class PortMaps:
    """The open maps of one port's program instance."""

    def __init__(self, pin_dir: Path) -> None:
        self.pin_dir = Path(pin_dir)
        self.maps: dict[str, BpfMap] = {}
        try:
            for name, (size, entries) in MAPS.items():
                self.maps[name] = BpfMap.open_pinned(self.pin_dir / "maps" / name, size, entries)
        except BaseException:
            self.close()
            raise
        self.cfg, self.dscp_tc = self.maps["cfg"], self.maps["dscp_tc"]
        self.class_cfg, self.pause, self.state = (self.maps["class_cfg"], self.maps["pause"],
                                                  self.maps["state"])
        self.ino = _ino(self.pin_dir / "maps" / "state")

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    def write_params(self, params: PortParams) -> None:
        params.check()
        for dscp, tc in enumerate(dscp_table(params)):
            self.dscp_tc.update(dscp, struct.pack("=I", tc))
        for tc in range(NUM_TC):
            self.class_cfg.update(tc, encode_class_cfg(params.classes.get(tc)))
        self.cfg.update(0, encode_port_cfg(params))

    def set_paused(self, tc: int, paused: bool, now_ns: int | None = None) -> None:
        _lock, was, since, total = PAUSE.unpack(self.pause.lookup(tc, BPF_F_LOCK))
        if bool(was) == paused:
            return
        now = time.monotonic_ns() if now_ns is None else now_ns
        if was:                     # resuming: the pause that just ended joins the total
            total += max(0, now - since)
        self.pause.update(tc, PAUSE.pack(0, int(paused), now, total), BPF_F_LOCK)

    def reset(self) -> None:
        """Empty every virtual queue and zero every counter (pause state is kept)."""
        zero = bytes(STATE.size)
        for slot in range(NUM_SLOTS):
            self.state.update(slot, zero, BPF_F_LOCK)

    def read(self) -> dict[int, ClassCounters]:
        states = self.state.lookup_all(BPF_F_LOCK)
        pauses = self.pause.lookup_all(BPF_F_LOCK)
        rate = PORT_CFG.unpack(self.cfg.lookup(0))[0]
        now = time.monotonic_ns()
        out = {}
        for slot, row in enumerate(STATE.iter_unpack(states)):
            (_lock, _pad, vq_fp, last_ns, paused_seen, packets, nbytes, ect, ce_in, marks,
             would, drops, overflows, max_vq, mark_errors) = row
            paused = False
            if slot < NUM_TC and vq_fp:
                _l, flag, since, total = PAUSE.unpack_from(pauses, slot * PAUSE.size)
                paused = flag != 0
                # as the program would see it at `now`: drain over the un-paused time
                paused_now = total + now - since if paused and now > since else total
                active = now - last_ns if now > last_ns else 0
                if paused_now > paused_seen:
                    active -= paused_now - paused_seen
                if active > 0:
                    vq_fp -= active * rate
                    if vq_fp < 0:
                        vq_fp = 0
            elif slot < NUM_TC:
                paused = pauses[slot * PAUSE.size + 4] != 0
            out[slot] = ClassCounters(packets, nbytes, ect, ce_in, marks, would, drops,
                                      overflows, max_vq, mark_errors, vq_fp >> FP_SHIFT,
                                      paused, last_ns)
        return out


def _ino(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1


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


def object_path(cache_dir: Path | None = None, source: Path = PORT_SOURCE) -> Path:
    """Where the object for the current source and flags lives (built or not)."""
    digest = hashlib.sha256(source.read_bytes() + b"\0" + " ".join(compile_flags()).encode())
    return (cache_dir or _cache_dir()) / f"port-{digest.hexdigest()[:16]}.o"


def _cache_dir() -> Path:
    return Path(os.environ.get("TESTBED_BPF_CACHE", CACHE_DIR))


def ensure_object(cache_dir: Path | None = None, source: Path = PORT_SOURCE) -> Path:
    """The compiled port program, compiled with clang on first use and cached by source hash."""
    out = object_path(cache_dir, source)
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
    res = subprocess.run([clang, *flags, "-c", str(source), "-o", str(tmp)],
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
    return PIN_ROOT / lab / node / ifname


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

    def close(self) -> None:
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


def _bpftool_load(obj: Path, pin_dir: Path) -> None:
    bpftool = shutil.which("bpftool")
    if bpftool is None:
        raise PortProgError("bpftool not found, needed to load the port program: "
                            "install bpftool (Debian) or linux-tools (Ubuntu)")
    argv = [bpftool, "prog", "load", str(obj), str(pin_dir / "prog"), "type", "classifier",
            "pinmaps", str(pin_dir / "maps")]
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-25:])
        raise PortProgError(f"bpftool prog load failed for {pin_dir} (exit {res.returncode}):"
                            f"\n{tail}")


def _attach_pyroute2(ipr, ifindex: int, prog_fd: int) -> None:
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr.tc("add", "clsact", ifindex)
    except NetlinkError as exc:
        if exc.code != errno.EEXIST:
            raise
    ipr.tc("replace-filter", "bpf", ifindex, FILTER_HANDLE, fd=prog_fd, name="port_egress",
           parent=CLSACT_EGRESS, prio=FILTER_PRIO, protocol=ETH_P_ALL, classid=1,
           direct_action=True)


def _attach_tc(netns: str, ifname: str, pin: Path) -> None:
    # nsenter --net switches only the network namespace: bpffs stays visible
    # (`ip netns exec` remounts /sys and would hide /sys/fs/bpf).
    nsenter = ["nsenter", f"--net=/var/run/netns/{netns}", "tc"]
    res = subprocess.run([*nsenter, "qdisc", "add", "dev", ifname, "clsact"],
                         capture_output=True, text=True)
    if res.returncode != 0 and "File exists" not in res.stderr:
        raise PortProgError(f"tc qdisc add clsact on {netns}/{ifname} failed: "
                            f"{res.stderr.strip()}")
    res = subprocess.run([*nsenter, "filter", "replace", "dev", ifname, "egress", "prio",
                          str(FILTER_PRIO), "handle", str(FILTER_HANDLE), "bpf", "da",
                          "pinned", str(pin)], capture_output=True, text=True)
    if res.returncode != 0:
        raise PortProgError(f"tc filter add bpf on {netns}/{ifname} failed: "
                            f"{res.stderr.strip()}")


def attach_port(lab: str, node: str, netns: str, ifname: str, params: PortParams, *,
                ipr=None, obj: Path | None = None) -> PortHandle:
    """Load a fresh program instance for one port, configure it, attach it at clsact egress.

    `ipr` may be an open pyroute2 IPRoute inside `netns` (the builder's), else one
    is opened. Attaching again replaces the port's program and state.
    """
    params.check()
    pin_dir = pin_dir_of(lab, node, ifname)
    obj = obj or ensure_object()
    ensure_bpffs()
    _forget(pin_dir)
    _rmtree(pin_dir)
    pin_dir.mkdir(parents=True)
    _bpftool_load(obj, pin_dir)
    maps = PortMaps(pin_dir)
    try:
        maps.write_params(params)
        prog_fd = obj_get(pin_dir / "prog")
        try:
            method, ifindex = _attach(netns, ifname, prog_fd, pin_dir / "prog", ipr)
        finally:
            os.close(prog_fd)
    except BaseException:
        maps.close()
        raise
    _open[str(pin_dir)] = maps
    return PortHandle(lab, node, netns, ifname, ifindex, pin_dir, method, maps)


def _attach(netns: str, ifname: str, prog_fd: int, pin: Path, ipr) -> tuple[str, int]:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    own = ipr is None
    if own:
        ipr = IPRoute(netns=netns)
    try:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            raise PortProgError(f"no interface {ifname!r} in namespace {netns!r}")
        ifindex = found[0]
        try:
            _attach_pyroute2(ipr, ifindex, prog_fd)
            return "pyroute2", ifindex
        except NetlinkError as exc:
            first = exc
    finally:
        if own:
            ipr.close()
    try:
        _attach_tc(netns, ifname, pin)
    except PortProgError as exc:
        raise PortProgError(f"attaching to {netns}/{ifname}: pyroute2 said {first}; {exc}") \
            from None
    return "tc", ifindex


def detach_port(handle: PortHandle) -> None:
    """Take the program off the port (the clsact qdisc goes too) and unpin its maps."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with contextlib.suppress(NetlinkError, OSError):   # namespace or link may be gone
        with IPRoute(netns=handle.netns) as ipr:
            ipr.tc("del", "clsact", handle.ifindex)
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


def set_paused(target: PortHandle | PortMaps | str | Path, tc: int, paused: bool,
               now_ns: int | None = None) -> None:
    """Freeze (paused=True) or restart the drain of class `tc`'s virtual queue."""
    if not 0 <= tc < NUM_TC:
        raise ValueError(f"class must be 0..{NUM_TC - 1}, got {tc}")
    _maps(target).set_paused(tc, paused, now_ns)


def update_params(target: PortHandle | PortMaps | str | Path, params: PortParams) -> None:
    """Rewrite rate, thresholds, probabilities and the DSCP map; queues and counters stay."""
    _maps(target).write_params(params)


def reset_state(target: PortHandle | PortMaps | str | Path) -> None:
    """Empty the virtual queues and zero the counters of a port."""
    _maps(target).reset()


def read_counters(target: PortHandle | PortMaps | str | Path) -> dict[int, ClassCounters]:
    """Counters of classes 0..7 and of non-IPv4 frames (key OTHER), vq drained to now."""
    return _maps(target).read()


# --- command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.net.portprog",
                                     description="build or inspect the port program")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="compile port.bpf.c into the cache, print the path")
    build.add_argument("--cache-dir", type=Path)
    show = sub.add_parser("counters", help="print a port's counters as JSON")
    show.add_argument("pin_dir", type=Path, help="/sys/fs/bpf/tb/<lab>/<node>/<ifname>")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
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
