"""The port program's maps, as user space reads and writes them.

The tc-BPF port program (testbed/net/bpf/port.bpf.c) keeps its
configuration, queues, buffer accounting and counters in pinned maps. This
module is the contract with it: the C structs' layouts, the fixed-point
encodings, and bpf(2) through ctypes (no libbpf in the process). It lives
with the agents because the PFC agent reads the node's buffer accounting and
PFC events through it inside its namespace; `testbed/net/portprog` (the only
code that compiles, loads and attaches the program) uses it too.

Two scopes of maps:
- per PORT (`PortMaps`, pins under .../<node>/<ifname>/maps/): `cfg`,
  `dscp_tc`, `class_cfg` (thresholds, probabilities, UET trimming), `state`
  (per class: admitted and departed bytes, so queue = admitted - departed;
  counters, trims among them), `ring` (the FIFO of ingress
  slots of tracked classes), `port_ingress` (bytes per ingress slot);
- per NODE (`NodeMaps`, pins under .../<node>/_node/): `node` (the buffer
  model: mode, shared pool, per-(class, ingress slot) accounting), `node_lock`,
  `ifslot` (ingress ifindex -> slot), `events` (ring buffer of PFC-relevant
  transitions), `flow_drops` (drops by flow).

`state`, `port_ingress` and `node` are mmap-able arrays: readers map them once
and read a queue or an ingress's occupancy from memory, with no syscall. The
program writes them under the node's spin lock; user space reads without it
(every field is an aligned u64, so a read may be one packet stale, never torn).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

NUM_TC = 8
OTHER = NUM_TC              #: read_counters key of non-IPv4 frames (ARP, PFC, IPv6)
NUM_SLOTS = NUM_TC + 1
NUM_DSCP = 64
MAX_SLOTS = 512             #: ingress slots per node; slot 0 is the node's own traffic
MAX_TRACKED = 2             #: lossless classes with per-ingress accounting per node
RING = 16384                #: FIFO entries (packet descriptors) per (port, tracked class)
NO_TRACK = 0xFF
NODE_DIR = "_node"          #: a node's shared maps, beside its ports' pin dirs (eth<N> / swp<N>)
FP_SHIFT = 32
FP_ONE = 1 << FP_SHIFT      #: probability 1.0
ALPHA_SHIFT = 16            #: node alpha in units of 2^-16
MAX_THRESHOLD_SPAN = 1 << 31  # kmax - kmin must stay below this (64-bit products in C)
UET_UDP_PORT = 4793         #: the only packets the program trims (IPv4 UDP, IHL 5)
MIN_TRIM_BYTES = 20 + 8 + 16 + 44   #: IP + UDP + the largest PDS request + SES standard
MAX_TRIM_BYTES = 0xFFFF
PAGE = mmap.PAGESIZE

MODES = {"none": 0, "static": 1, "shared": 2}
#: class_cfg.ecn_enabled: off; the program marks (bpf); sch_red marks and the program
#: counts its ECT -> CE marks at departure (red)
ECN_OFF = 0
ECN_MARKERS = {"bpf": 1, "red": 2}
EV_XOFF, EV_XON, EV_EGRESS_HOT, EV_EGRESS_COOL, EV_DROP = 1, 2, 3, 4, 5
EVENT_NAMES = {EV_XOFF: "xoff", EV_XON: "xon", EV_EGRESS_HOT: "egress_hot",
               EV_EGRESS_COOL: "egress_cool", EV_DROP: "drop"}
F_WANT_PAUSE = 1
F_HOT = 1

PORT_CFG = struct.Struct("=II")
PORT_CFG_FIELDS = ("default_tc", "port_slot")
CLASS_CFG = struct.Struct("=7QIIQII")
CLASS_CFG_FIELDS = ("kmin_bytes", "kmax_bytes", "pmax_fp", "drop_fp", "limit_bytes",
                    "egress_xoff_bytes", "egress_xon_bytes", "ecn_enabled", "trim_len",
                    "trim_threshold_bytes", "trim_tc", "trim_dscp")
STATE = struct.Struct("=24Q")
STATE_FIELDS = ("enq_bytes", "enq_packets", "dep_bytes", "dep_packets", "packets", "bytes",
                "ect_packets", "ce_arrivals", "ce_marks", "would_mark", "drops", "tail_drops",
                "mmu_drops", "desc_drops", "max_queue_bytes", "mark_errors", "ring_head",
                "ring_tail", "dep_mismatch", "dep_unmatched", "flags", "trims", "trim_errors",
                "ce_queued")
INGRESS_ACCT = struct.Struct("=7Q6I")
INGRESS_ACCT_FIELDS = ("bytes", "hdrm_bytes", "max_bytes", "max_hdrm_bytes", "drops",
                       "xoff_events", "xon_events", "headroom_bytes", "xoff_bytes", "xon_bytes",
                       "alpha_fp", "flags", "pad")
NODE_HEAD = struct.Struct("=II5Q8B4Q")
NODE_HEAD_FIELDS = ("mode", "alpha_fp", "buffer_bytes", "reserve_bytes", "resume_offset_bytes",
                    "total_hdrm_bytes", "total_rsrv_bytes", "tracked", "shared_used_bytes",
                    "max_shared_used_bytes", "events_lost", "pad")
NODE_SIZE = NODE_HEAD.size + MAX_TRACKED * MAX_SLOTS * INGRESS_ACCT.size
EVENT = struct.Struct("=QIIIIQ")
EVENT_FIELDS = ("ts_ns", "kind", "tc", "slot", "port_slot", "bytes")
FLOW_KEY = struct.Struct("=IIHHBBH")
FLOW_KEY_FIELDS = ("saddr", "daddr", "sport", "dport", "proto", "tc", "pad")
FLOW_DROPS = struct.Struct("=4Q")
FLOW_DROPS_FIELDS = ("phy", "tail", "mmu", "desc")
RING_SIZE = MAX_TRACKED * RING * 4
PORT_INGRESS_SIZE = 2 * MAX_TRACKED * MAX_SLOTS * 8
NODE_LOCK_SIZE = 8
EVENTS_BYTES = 1 << 16
#: C struct name -> (Python layout, field names), checked against the object's BTF in tests
#: (`tracked` is a u8[8] array in C: eight B fields here)
LAYOUTS = {
    "port_cfg": (PORT_CFG, PORT_CFG_FIELDS),
    "class_cfg": (CLASS_CFG, CLASS_CFG_FIELDS),
    "class_state": (STATE, STATE_FIELDS),
    "ingress_acct": (INGRESS_ACCT, INGRESS_ACCT_FIELDS),
    "event": (EVENT, EVENT_FIELDS),
    "flow_key": (FLOW_KEY, FLOW_KEY_FIELDS),
    "flow_drops": (FLOW_DROPS, FLOW_DROPS_FIELDS),
}
#: size of structs without a flat Python layout
STRUCT_SIZES = {"node_acct": NODE_SIZE, "node_lock": NODE_LOCK_SIZE}
#: map name -> (value size, entries) of a port's own maps
PORT_MAPS = {
    "cfg": (PORT_CFG.size, 1),
    "dscp_tc": (4, NUM_DSCP),
    "class_cfg": (CLASS_CFG.size, NUM_TC),
    "state": (STATE.size, NUM_SLOTS),
    "ring": (RING_SIZE, 1),
    "port_ingress": (PORT_INGRESS_SIZE, 1),
}
#: map name -> (value size, entries) of the maps all ports of a node share
NODE_MAPS = {
    "node": (NODE_SIZE, 1),
    "node_lock": (NODE_LOCK_SIZE, 1),
    "ifslot": (4, MAX_SLOTS),
    "events": (0, EVENTS_BYTES),
    "flow_drops": (FLOW_DROPS.size, 4096),
}
MAPS = {**PORT_MAPS, **NODE_MAPS}


class PortMapError(RuntimeError):
    """A map is missing, of another layout, or the bpf(2) syscall refused a request."""


# --- parameters --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassParams:
    kmin_bytes: int = 0
    kmax_bytes: int = 0
    pmax: float | None = None        # None: this class never marks
    marker: str = "bpf"              # "bpf": the program marks with the curve; "red": the
                                     # class's sch_red marks, the program counts its marks
    drop_probability: float = 0.0    # PHY frame loss or explicit impairment
    limit_bytes: int = 0             # this port's buffer for the class; 0: none (shared pool)
    egress_xoff_bytes: int = 0       # static mode: a queue this deep pauses its contributors
    egress_xon_bytes: int = 0


@dataclass(frozen=True)
class TrimParams:
    """Packet trimming of a class: a UET packet (IPv4 UDP to UET_UDP_PORT) that would take
    the queue above `threshold_bytes` is cut to `size_bytes` of IP and sent in class `tc`
    with DSCP `dscp` (ECN bits kept) instead of being admitted to this class."""

    threshold_bytes: int
    size_bytes: int                  # IP bytes kept (the IP total length of the short packet)
    tc: int                          # the class it goes to (strict, never tracked)
    dscp: int                        # the DSCP written into it: one of that class's


@dataclass(frozen=True)
class PortParams:
    dscp_to_tc: Mapping[int, int] = field(default_factory=dict)
    default_tc: int = 0
    classes: Mapping[int, ClassParams] = field(default_factory=dict)
    port_slot: int = 0               # this port's ingress slot at its node (1..)
    trims: Mapping[int, TrimParams] = field(default_factory=dict)   # by class: switch ports

    def problems(self) -> list[str]:
        out = []
        if not 0 <= self.default_tc < NUM_TC:
            out.append(f"default_tc must be 0..{NUM_TC - 1}, got {self.default_tc}")
        if not 0 <= self.port_slot < MAX_SLOTS:
            out.append(f"port_slot must be 0..{MAX_SLOTS - 1}, got {self.port_slot}")
        for dscp, tc in self.dscp_to_tc.items():
            if not 0 <= dscp < NUM_DSCP or not 0 <= tc < NUM_TC:
                out.append(f"dscp_to_tc[{dscp}] = {tc}: DSCP 0..63 to class 0..7")
        out += self._trims_problems()
        out += [f"classes[{tc}].marker must be one of {', '.join(ECN_MARKERS)}"
                for tc, cls in self.classes.items() if cls.marker not in ECN_MARKERS]
        for tc, cls in self.classes.items():
            where = f"classes[{tc}]"
            if not 0 <= tc < NUM_TC:
                out.append(f"{where}: class must be 0..{NUM_TC - 1}")
            if not 0 <= cls.drop_probability <= 1:
                out.append(f"{where}.drop_probability must be in [0, 1]")
            for name in ("limit_bytes", "egress_xoff_bytes", "egress_xon_bytes"):
                if getattr(cls, name) < 0:
                    out.append(f"{where}.{name} must be >= 0")
            if cls.egress_xon_bytes > cls.egress_xoff_bytes:
                out.append(f"{where}: egress_xon_bytes above egress_xoff_bytes")
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

    def _trims_problems(self) -> list[str]:
        return [p for tc, trim in self.trims.items() for p in self._trim_problems(tc, trim)]

    def _trim_problems(self, tc: int, trim: TrimParams) -> list[str]:
        where, out = f"classes[{tc}]", []
        if not MIN_TRIM_BYTES <= trim.size_bytes <= MAX_TRIM_BYTES:
            out.append(f"{where}: trim size_bytes must be {MIN_TRIM_BYTES}..{MAX_TRIM_BYTES}, "
                       f"got {trim.size_bytes}")
        if not 0 <= trim.tc < NUM_TC or trim.tc == tc:
            out.append(f"{where}: trim tc must be another class 0..{NUM_TC - 1}, got {trim.tc}")
        elif trim.tc in self.trims:
            out.append(f"{where}: trim tc {trim.tc} trims too; a trimmed packet goes to a "
                       "class that does not")
        elif self.dscp_to_tc.get(trim.dscp, self.default_tc) != trim.tc:
            out.append(f"{where}: trim dscp {trim.dscp} does not select class {trim.tc} at "
                       "this port")
        if trim.threshold_bytes < 0:
            out.append(f"{where}: trim threshold_bytes must be >= 0")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid port parameters: " + "; ".join(problems))


@dataclass(frozen=True)
class IngressParams:
    """Thresholds of one (ingress port, tracked class) of a node."""

    headroom_bytes: int = 0          # shared mode: what the ingress may hold above XOFF
    xoff_bytes: int = 0              # static XOFF (shared mode: of the shared part; 0 there:
    xon_bytes: int = 0               # the dynamic alpha threshold); static mode 0: never
    alpha: float = 0.0               # shared, dynamic: 0 takes the node's alpha


@dataclass(frozen=True)
class NodeParams:
    """The buffer model of a node, shared by all its ports.

    `tracked`: the classes (at most MAX_TRACKED) whose bytes are accounted per
    ingress port (lossless classes with PFC). `ingress[(tc, slot)]`: thresholds
    per tracked class and ingress slot. `slots`: ingress ifindex -> slot.
    """

    mode: str = "none"               # "none" (host), "static" or "shared"
    tracked: tuple[int, ...] = ()
    ingress: Mapping[tuple[int, int], IngressParams] = field(default_factory=dict)
    slots: Mapping[int, int] = field(default_factory=dict)
    buffer_bytes: int = 0
    reserve_bytes: int = 0
    alpha: float = 0.125
    resume_offset_bytes: int = 0
    total_hdrm_bytes: int = 0
    total_rsrv_bytes: int = 0

    def problems(self) -> list[str]:
        out = []
        if self.mode not in MODES:
            out.append(f"mode must be one of {sorted(MODES)}, got {self.mode!r}")
        if len(self.tracked) > MAX_TRACKED or len(set(self.tracked)) != len(self.tracked):
            out.append(f"at most {MAX_TRACKED} distinct tracked classes, got {self.tracked}")
        if any(not 0 <= tc < NUM_TC for tc in self.tracked):
            out.append(f"tracked classes must be 0..{NUM_TC - 1}")
        for (tc, slot), p in self.ingress.items():
            if tc not in self.tracked or not 0 < slot < MAX_SLOTS:
                out.append(f"ingress[{tc}, {slot}]: class not tracked or slot outside "
                           f"1..{MAX_SLOTS - 1}")
            if p.xon_bytes > p.xoff_bytes:
                out.append(f"ingress[{tc}, {slot}]: xon above xoff")
            for name in ("headroom_bytes", "xoff_bytes", "xon_bytes"):
                if not 0 <= getattr(p, name) < 1 << 32:
                    out.append(f"ingress[{tc}, {slot}].{name} must fit in 32 bits")
        for ifindex, slot in self.slots.items():
            if ifindex <= 0 or not 0 < slot < MAX_SLOTS:
                out.append(f"slots[{ifindex}] = {slot}: slot must be 1..{MAX_SLOTS - 1}")
        if not 0 < self.alpha < (1 << (32 - ALPHA_SHIFT)):
            out.append(f"alpha must be in (0, {1 << (32 - ALPHA_SHIFT)}), got {self.alpha}")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid node parameters: " + "; ".join(problems))


# --- fixed-point encodings ---------------------------------------------------------------


def probability_fp(p: float) -> int:
    """p in [0, 1] as the C side compares it: a u32 random r hits iff r < result."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability must be in [0, 1], got {p}")
    return round(p * FP_ONE)


def alpha_fp(alpha: float) -> int:
    """The node's alpha in units of 2^-16 (1/8 -> 8192), as the C side multiplies it."""
    return round(alpha * (1 << ALPHA_SHIFT))


def mark_probability(q_bytes: int, kmin_bytes: int, kmax_bytes: int, pmax: float) -> float:
    """Exact probability that the program marks a packet finding `q_bytes` queued."""
    if q_bytes > kmax_bytes:
        return 1.0
    if q_bytes <= kmin_bytes:
        return 0.0
    # hits: r in [0, 2^32) with r * span < pmax_fp * (q - kmin)
    span = kmax_bytes - kmin_bytes
    hits = -(-probability_fp(pmax) * (q_bytes - kmin_bytes) // span)
    return min(hits, FP_ONE) / FP_ONE


def shared_threshold(buffer_bytes: int, total_hdrm_bytes: int, total_rsrv_bytes: int,
                     shared_used_bytes: int, alpha: float) -> int:
    """HPCC's dynamic XOFF threshold as the program computes it: alpha x free shared bytes."""
    free = max(0, buffer_bytes - total_hdrm_bytes - total_rsrv_bytes - shared_used_bytes)
    return (free * alpha_fp(alpha)) >> ALPHA_SHIFT


def encode_port_cfg(params: PortParams) -> bytes:
    return PORT_CFG.pack(params.default_tc, params.port_slot)


def encode_class_cfg(cls: ClassParams | None, trim: TrimParams | None = None) -> bytes:
    """A class's `class_cfg` entry; trim_len 0 means the class does not trim."""
    t = (trim.size_bytes, trim.threshold_bytes, trim.tc, trim.dscp) if trim else (0, 0, 0, 0)
    if cls is None:
        return CLASS_CFG.pack(0, 0, 0, 0, 0, 0, 0, 0, *t)
    ecn = cls.pmax is not None
    return CLASS_CFG.pack(cls.kmin_bytes if ecn else 0, cls.kmax_bytes if ecn else 0,
                          0 if cls.pmax is None else probability_fp(cls.pmax),
                          probability_fp(cls.drop_probability), cls.limit_bytes,
                          cls.egress_xoff_bytes, cls.egress_xon_bytes,
                          ECN_MARKERS[cls.marker] if ecn else ECN_OFF, *t)


def encode_node_head(params: NodeParams) -> bytes:
    tracked = [NO_TRACK] * NUM_TC
    for i, tc in enumerate(params.tracked):
        tracked[tc] = i
    return NODE_HEAD.pack(MODES[params.mode], alpha_fp(params.alpha), params.buffer_bytes,
                          params.reserve_bytes, params.resume_offset_bytes,
                          params.total_hdrm_bytes, params.total_rsrv_bytes, *tracked,
                          0, 0, 0, 0)


def dscp_table(params: PortParams) -> list[int]:
    """Class of every DSCP, the default class filled in where the map is silent."""
    return [params.dscp_to_tc.get(d, params.default_tc) for d in range(NUM_DSCP)]


def acct_offset(tracked_index: int, slot: int) -> int:
    """Byte offset of node.in[tracked_index][slot] in the node map's value."""
    return NODE_HEAD.size + (tracked_index * MAX_SLOTS + slot) * INGRESS_ACCT.size


# --- bpf(2) ------------------------------------------------------------------------------

_NR_BPF = {"x86_64": 321, "aarch64": 280, "armv7l": 386, "riscv64": 280, "ppc64le": 361,
           "s390x": 351}
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_GET_NEXT_KEY = 1, 2, 4
BPF_MAP_UPDATE_BATCH = 26
ENOTSUPP = 524              # the kernel's own 'not supported' (no errno name in libc)
BPF_OBJ_GET, BPF_OBJ_GET_INFO_BY_FD = 7, 15
BPF_ANY = 0
_ATTR_SIZE = 128   # larger than any command's part of union bpf_attr we use; rest zero

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_uint]


def _nr_bpf() -> int:
    try:
        return _NR_BPF[platform.machine()]
    except KeyError:
        raise PortMapError(f"no bpf(2) syscall number known for {platform.machine()}") from None


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
    """An open pinned map, its sizes checked: element writes with u32 keys (configuration).
    Counters are read through MmapArray, hash maps through iter_keys / lookup_raw."""

    def __init__(self, fd: int, value_size: int, entries: int, name: str = "") -> None:
        self.fd = fd
        self.name = name
        self.value_size = value_size
        self.entries = entries
        self.bpf = _Bpf()
        self.key = ctypes.c_uint32(0)
        self.value = ctypes.create_string_buffer(value_size)

    @classmethod
    def open_pinned(cls, path: Path, value_size: int, entries: int,
                    key_size: int = 4) -> BpfMap:
        fd = obj_get(path)
        try:
            _kind, got_key, got_size, got_entries, name = map_info(fd)
            if (got_key, got_size, got_entries) != (key_size, value_size, entries):
                raise PortMapError(
                    f"{path}: map has key/value/entries {got_key}/{got_size}/{got_entries}, "
                    f"this testbed expects {key_size}/{value_size}/{entries}; it was loaded "
                    "from another version of port.bpf.c - detach the lab and attach again")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, value_size, entries, name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

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

    def update_all(self, values: list[bytes]) -> None:
        """Elements 0..len(values)-1 in one BPF_MAP_UPDATE_BATCH (a port's configuration
        is ~70 elements; one syscall each was most of attaching a lab's ports). Each
        element is written as update() writes it; a kernel without batch updates of
        arrays gets them one at a time."""
        if any(len(v) != self.value_size for v in values):
            raise ValueError(f"{self.name}: values must be {self.value_size} bytes each")
        if not values:
            return
        n = len(values)
        keys = (ctypes.c_uint32 * n)(*range(n))
        data = ctypes.create_string_buffer(b"".join(values), n * self.value_size)
        b = self.bpf
        b.clear()
        # union bpf_attr.batch: in_batch, out_batch, keys, values, count, map_fd,
        # elem_flags, flags
        struct.pack_into("=QQQQIIQQ", b.attr, 0, 0, 0, ctypes.addressof(keys),
                         ctypes.addressof(data), n, self.fd, BPF_ANY, 0)
        try:
            b.call(BPF_MAP_UPDATE_BATCH, f"MAP_UPDATE_BATCH {self.name}")
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP):
                raise
            for key, value in enumerate(values):
                self.update(key, value)


# --- mmap-able arrays and the ring buffer ------------------------------------------------


class MmapArray:
    """An mmap-able BPF array (BPF_F_MMAPABLE), mapped once: values read from memory."""

    def __init__(self, fd: int, value_size: int, entries: int, writable: bool = False) -> None:
        self.stride = (value_size + 7) & ~7
        self.value_size = value_size
        self.entries = entries
        size = -(-self.stride * entries // PAGE) * PAGE
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.mem = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        self.view = memoryview(self.mem)

    def close(self) -> None:
        self.view.release()
        self.mem.close()


RINGBUF_BUSY = 1 << 31
RINGBUF_DISCARD = 1 << 30
RINGBUF_HDR = 8


class RingBuffer:
    """Consumer of a BPF_MAP_TYPE_RINGBUF: poll its fd (select/epoll) for readability,
    then `read()` the records that are complete."""

    def __init__(self, fd: int, size: int) -> None:
        if size & (size - 1) or size % PAGE:
            raise ValueError(f"ring buffer size {size} is not a power of two of pages")
        self.fd = fd
        self.mask = size - 1
        self.cons = mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # producer position page, then the data pages mapped twice (a record that wraps
        # reads as one piece)
        self.prod = mmap.mmap(fd, PAGE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ,
                              offset=PAGE)

    def fileno(self) -> int:
        return self.fd

    def read(self, limit: int = 1 << 20) -> list[bytes]:
        out: list[bytes] = []
        cons = struct.unpack_from("=Q", self.cons, 0)[0]
        prod = struct.unpack_from("=Q", self.prod, 0)[0]
        while cons < prod and len(out) < limit:
            at = PAGE + (cons & self.mask)
            hdr = struct.unpack_from("=I", self.prod, at)[0]
            if hdr & RINGBUF_BUSY:
                break
            length = hdr & ~(RINGBUF_BUSY | RINGBUF_DISCARD)
            if not hdr & RINGBUF_DISCARD:
                out.append(bytes(self.prod[at + RINGBUF_HDR:at + RINGBUF_HDR + length]))
            cons += (length + RINGBUF_HDR + 7) & ~7
            struct.pack_into("=Q", self.cons, 0, cons)
            if cons >= prod:
                prod = struct.unpack_from("=Q", self.prod, 0)[0]
        return out

    def close(self) -> None:
        self.cons.close()
        self.prod.close()


# --- counters ----------------------------------------------------------------------------


class ClassCounters(NamedTuple):
    packets: int            # arrivals (drops included)
    bytes: int              # skb->len of arrivals
    ect_packets: int        # ECT(0)/ECT(1) arrivals
    ce_arrivals: int        # arrivals already CE
    ce_marks: int           # ECT -> CE done at this port
    would_mark: int         # non-ECT arrivals the curve picked
    drops: int              # dropped by drop_probability (PHY loss, impairment)
    tail_drops: int         # refused by the port's limit_bytes
    mmu_drops: int          # refused by the node's shared buffer
    desc_drops: int         # refused: the FIFO ring of the class was full
    max_vq_bytes: int       # largest queue right after an admission
    mark_errors: int
    vq_bytes: int           # the queue now: admitted - departed (frame bytes)
    vq_packets: int
    enq_bytes: int          # admitted
    enq_packets: int
    dep_bytes: int          # departed: seen at the peer's ingress
    dep_packets: int
    dep_mismatch: int       # departures whose length was not their FIFO entry's
    dep_unmatched: int      # departures with nothing admitted (not counted)
    trims: int = 0          # UET arrivals cut and sent in the trim class (not admitted here)
    trim_errors: int = 0    # of those, dropped: cutting them failed

    @property
    def refused(self) -> int:
        """Every packet the program dropped: PHY/impairment loss and refused admissions
        (a trimmed packet is not dropped; one whose cutting failed is)."""
        return self.drops + self.tail_drops + self.mmu_drops + self.desc_drops + \
            self.trim_errors


def _class_counters(row: tuple) -> ClassCounters:
    (enq_b, enq_p, dep_b, dep_p, packets, nbytes, ect, ce_in, marks, would, drops, tail, mmu,
     desc, max_q, mark_err, _head, _tail, mismatch, unmatched, _flags, trims, trim_err,
     _ce_queued) = row
    return ClassCounters(packets, nbytes, ect, ce_in, marks, would, drops, tail, mmu, desc,
                         max_q, mark_err, max(0, enq_b - dep_b), max(0, enq_p - dep_p),
                         enq_b, enq_p, dep_b, dep_p, mismatch, unmatched, trims, trim_err)


class IngressAcct(NamedTuple):
    bytes: int
    hdrm_bytes: int
    max_bytes: int
    max_hdrm_bytes: int
    drops: int
    xoff_events: int
    xon_events: int
    headroom_bytes: int
    xoff_bytes: int
    xon_bytes: int
    alpha_fp: int
    flags: int
    pad: int

    @property
    def want_pause(self) -> bool:
        return bool(self.flags & F_WANT_PAUSE)


class NodeHead(NamedTuple):
    mode: str
    alpha: float
    buffer_bytes: int
    reserve_bytes: int
    resume_offset_bytes: int
    total_hdrm_bytes: int
    total_rsrv_bytes: int
    tracked: tuple[int, ...]        # tracked index -> class
    shared_used_bytes: int
    max_shared_used_bytes: int
    events_lost: int

    def threshold_bytes(self, alpha: float | None = None) -> int:
        """The shared mode's dynamic XOFF threshold now (the node's alpha by default)."""
        return shared_threshold(self.buffer_bytes, self.total_hdrm_bytes, self.total_rsrv_bytes,
                                self.shared_used_bytes, alpha or self.alpha)


class Event(NamedTuple):
    ts_ns: int              # CLOCK_MONOTONIC of the packet that caused it
    kind: str               # xoff, xon, egress_hot, egress_cool, drop
    tc: int
    slot: int               # ingress slot
    port_slot: int          # egress port's slot
    bytes: int


def decode_event(raw: bytes) -> Event:
    ts, kind, tc, slot, port_slot, nbytes = EVENT.unpack_from(raw)
    return Event(ts, EVENT_NAMES.get(kind, str(kind)), tc, slot, port_slot, nbytes)


def _opened(mem: MmapArray | None, what: str) -> MmapArray:
    """`mem` while its maps are open; PortMapError once they were closed."""
    if mem is None:
        raise PortMapError(f"the {what} map is closed")
    return mem


def _open(pin_dir: Path, name: str, size: int, entries: int) -> BpfMap:
    key_size = FLOW_KEY.size if name == "flow_drops" else 4
    return BpfMap.open_pinned(pin_dir / name, size, entries, key_size)


class PortMaps:
    """The open maps of one port's program instance (pins in `pin_dir`/maps)."""

    def __init__(self, pin_dir: Path) -> None:
        self.pin_dir = Path(pin_dir)
        self.maps: dict[str, BpfMap] = {}
        self.state_mem: MmapArray | None = None
        self.ingress_mem: MmapArray | None = None
        try:
            for name, (size, entries) in PORT_MAPS.items():
                self.maps[name] = _open(self.pin_dir / "maps", name, size, entries)
            self.state_mem = MmapArray(self.maps["state"].fd, STATE.size, NUM_SLOTS,
                                       writable=True)
            self.ingress_mem = MmapArray(self.maps["port_ingress"].fd, PORT_INGRESS_SIZE, 1,
                                         writable=True)
        except BaseException:
            self.close()
            raise
        self.cfg, self.dscp_tc = self.maps["cfg"], self.maps["dscp_tc"]
        self.class_cfg, self.state = self.maps["class_cfg"], self.maps["state"]
        self.ino = _ino(self.pin_dir / "maps" / "state")

    @property
    def _state(self) -> MmapArray:
        return _opened(self.state_mem, "state")

    @property
    def _ingress(self) -> MmapArray:
        return _opened(self.ingress_mem, "port_ingress")

    def close(self) -> None:
        for mem in (self.state_mem, self.ingress_mem):
            if mem is not None:
                mem.close()
        self.state_mem = self.ingress_mem = None
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    def write_params(self, params: PortParams) -> None:
        params.check()
        self.dscp_tc.update_all([struct.pack("=I", tc) for tc in dscp_table(params)])
        self.class_cfg.update_all([encode_class_cfg(params.classes.get(tc), params.trims.get(tc))
                                   for tc in range(NUM_TC)])
        self.cfg.update(0, encode_port_cfg(params))

    def reset(self) -> None:
        """Zero every queue and counter of the port. Only while no packet moves: the
        program updates these under the node lock, which user space cannot take."""
        state = self._state
        state.view[:NUM_SLOTS * state.stride] = bytes(NUM_SLOTS * state.stride)
        self._ingress.view[:PORT_INGRESS_SIZE] = bytes(PORT_INGRESS_SIZE)

    def row(self, slot: int) -> tuple:
        state = self._state
        return STATE.unpack_from(state.view, slot * state.stride)

    def read(self) -> dict[int, ClassCounters]:
        return {slot: _class_counters(self.row(slot)) for slot in range(NUM_SLOTS)}

    def vq_bytes(self, tc: int) -> int:
        """Class `tc`'s queue now (admitted - departed), from memory."""
        state = self._state
        enq, _p, dep = struct.unpack_from("=3Q", state.view, tc * state.stride)
        return max(0, enq - dep)

    def hot(self, tc: int) -> bool:
        """Static mode: the class's egress protection is on (queue reached egress XOFF)."""
        return bool(self.row(tc)[20] & F_HOT)

    def ingress_queued(self, tracked_index: int) -> dict[int, int]:
        """Bytes of this port's queue of a tracked class, per ingress slot (slot 0: local)."""
        view = self._ingress.view
        row = MAX_SLOTS * 8
        adm = struct.unpack_from(f"={MAX_SLOTS}Q", view, tracked_index * row)
        dep = struct.unpack_from(f"={MAX_SLOTS}Q", view, (MAX_TRACKED + tracked_index) * row)
        return {slot: a - d for slot, (a, d) in enumerate(zip(adm, dep, strict=True)) if a > d}


class NodeMaps:
    """The maps all ports of a node share (pins in `node_dir`): buffer model, events."""

    def __init__(self, node_dir: Path, events: bool = False) -> None:
        self.node_dir = Path(node_dir)
        self.maps: dict[str, BpfMap] = {}
        self.mem: MmapArray | None = None
        self.ring: RingBuffer | None = None
        try:
            for name, (size, entries) in NODE_MAPS.items():
                # events: below, if asked for; node_lock: user space never takes it (and
                # a lab instance keeps its nodes' locks in one array of its own)
                if name in ("events", "node_lock"):
                    continue
                self.maps[name] = _open(self.node_dir, name, size, entries)
            self.mem = MmapArray(self.maps["node"].fd, NODE_SIZE, 1, writable=True)
            if events:
                fd = obj_get(self.node_dir / "events")
                self.events_fd = fd
                self.ring = RingBuffer(fd, EVENTS_BYTES)
        except BaseException:
            self.close()
            raise
        self.ino = _ino(self.node_dir / "node")

    @property
    def _view(self) -> memoryview:
        return _opened(self.mem, "node").view

    def fileno(self) -> int:
        """The events ring buffer's fd, to wait on (select) for PFC events."""
        if self.ring is None:
            raise PortMapError("node maps were opened without events=True")
        return self.ring.fileno()

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            os.close(self.ring.fd)
            self.ring = None
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    def write_params(self, params: NodeParams) -> None:
        """The node's buffer model and ingress thresholds; counters are kept."""
        params.check()
        view = self._view
        head = encode_node_head(params)
        cfg_bytes = NODE_HEAD.size - 4 * 8           # the state words after `tracked` stay
        view[:cfg_bytes] = head[:cfg_bytes]
        tracked_index = {tc: i for i, tc in enumerate(params.tracked)}
        cfg_at = 7 * 8                      # headroom, xoff, xon, alpha inside an entry
        # zero those four u32s of every entry with strided writes (one per field, not one
        # per entry: 1024 entries a node), counters between them untouched
        entries = MAX_TRACKED * MAX_SLOTS
        words = view[NODE_HEAD.size:NODE_HEAD.size + entries * INGRESS_ACCT.size].cast("I")
        stride = INGRESS_ACCT.size // 4
        zeros = memoryview(bytes(4 * entries)).cast("I")
        for k in range(4):
            words[cfg_at // 4 + k::stride] = zeros
        words.release()
        for (tc, slot), p in params.ingress.items():
            struct.pack_into("=4I", view, acct_offset(tracked_index[tc], slot) + cfg_at,
                             p.headroom_bytes, p.xoff_bytes, p.xon_bytes,
                             alpha_fp(p.alpha) if p.alpha else 0)
        for ifindex, slot in params.slots.items():
            self.maps["ifslot"].update(ifindex, struct.pack("=I", slot))

    def head(self) -> NodeHead:
        v = NODE_HEAD.unpack_from(self._view, 0)
        tracked = tuple(tc for i in range(MAX_TRACKED) for tc in range(NUM_TC)
                        if v[7 + tc] == i)
        mode = {n: m for m, n in MODES.items()}.get(v[0], str(v[0]))
        return NodeHead(mode, v[1] / (1 << ALPHA_SHIFT), v[2], v[3], v[4], v[5], v[6], tracked,
                        v[15], v[16], v[17])

    def acct(self, tracked_index: int, slot: int) -> IngressAcct:
        return IngressAcct(*INGRESS_ACCT.unpack_from(self._view,
                                                     acct_offset(tracked_index, slot)))

    def accts(self, tracked_index: int, slots: int) -> list[IngressAcct]:
        """Entries of slots 0 .. slots-1 of one tracked class."""
        return [self.acct(tracked_index, s) for s in range(slots)]

    def reset(self) -> None:
        """Zero the node's accounting (not its configuration). Only while no packet moves."""
        view = self._view
        struct.pack_into("=4Q", view, NODE_HEAD.size - 4 * 8, 0, 0, 0, 0)
        for t in range(MAX_TRACKED):
            for slot in range(MAX_SLOTS):
                struct.pack_into("=7Q", view, acct_offset(t, slot), 0, 0, 0, 0, 0, 0, 0)
                struct.pack_into("=I", view, acct_offset(t, slot) + 7 * 8 + 16, 0)  # flags

    def events(self) -> list[Event]:
        if self.ring is None:
            raise PortMapError("node maps were opened without events=True")
        return [decode_event(raw) for raw in self.ring.read()]

    def flow_drops(self) -> dict[tuple, tuple[int, int, int, int]]:
        """Drops by flow: (saddr, daddr, sport, dport, proto, tc) -> (phy, tail, mmu, desc),
        addresses as dotted strings."""
        out = {}
        m = self.maps["flow_drops"]
        for key in iter_keys(m.fd, FLOW_KEY.size):
            try:
                value = lookup_raw(m.fd, key, FLOW_DROPS.size)
            except OSError:
                continue
            saddr, daddr, sport, dport, proto, tc, _ = FLOW_KEY.unpack(key)
            out[(_ip(saddr), _ip(daddr), sport, dport, proto, tc)] = FLOW_DROPS.unpack(value)
        return out


def _ip(raw: int) -> str:
    return ".".join(str(b) for b in struct.pack("=I", raw))


def iter_keys(fd: int, key_size: int) -> Iterator[bytes]:
    """Every key of a hash map (BPF_MAP_GET_NEXT_KEY), any key size."""
    bpf = _Bpf()
    key = ctypes.create_string_buffer(key_size)
    nxt = ctypes.create_string_buffer(key_size)
    first = True
    for _ in range(1 << 20):
        bpf.clear()
        struct.pack_into("=IIQQ", bpf.attr, 0, fd, 0, 0 if first else ctypes.addressof(key),
                         ctypes.addressof(nxt))
        try:
            bpf.call(BPF_MAP_GET_NEXT_KEY, "MAP_GET_NEXT_KEY")
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return
            raise
        first = False
        yield nxt.raw
        ctypes.memmove(key, nxt, key_size)


def lookup_raw(fd: int, key: bytes, value_size: int) -> bytes:
    bpf = _Bpf()
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value_size)
    struct.pack_into("=IIQQQ", bpf.attr, 0, fd, 0, ctypes.addressof(k), ctypes.addressof(v), 0)
    bpf.call(BPF_MAP_LOOKUP_ELEM, "MAP_LOOKUP_ELEM")
    return v.raw


def _ino(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1
