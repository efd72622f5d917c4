"""The port program's maps, as user space reads and writes them.

The tc-BPF port program (testbed/net/bpf/port.bpf.c) keeps its
configuration, pause state, virtual queues and counters in pinned maps.
This module is the contract with it: the C structs' layouts, the
fixed-point encodings, and bpf(2) through ctypes (no libbpf in the
process). It lives with the agents because the PFC agent reads queues
and sets pause flags through it inside its namespace; `testbed/net/portprog`
(the only code that compiles, loads and attaches the program) uses it too.

Maps are read and written with BPF_OBJ_GET for a pin, MAP_LOOKUP/UPDATE_ELEM
and MAP_LOOKUP_BATCH to read all classes of a port in one call. Values that
hold a bpf_spin_lock are read and written with BPF_F_LOCK, so a reader never
sees a half-updated queue.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

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
PAUSE = struct.Struct("=IIQQQ")
PAUSE_FIELDS = ("lock", "paused", "since_ns", "paused_total_ns", "credit_bytes")
STATE = struct.Struct("=II14Q")
STATE_FIELDS = ("lock", "pad", "vq_fp", "last_ns", "paused_seen_ns", "packets", "bytes",
                "ect_packets", "ce_arrivals", "ce_marks", "would_mark", "drops", "vq_overflows",
                "max_vq_bytes", "mark_errors", "credit_seen")
#: C struct name -> (Python layout, field names), checked against the object's BTF in tests
LAYOUTS = {
    "port_cfg": (PORT_CFG, PORT_CFG_FIELDS),
    "class_cfg": (CLASS_CFG, CLASS_CFG_FIELDS),
    "pause_state": (PAUSE, PAUSE_FIELDS),
    "class_state": (STATE, STATE_FIELDS),
}
MAX_INGRESS = 64            #: ingress_ifindex slots per class in the `ingress` map
#: map name -> (value size, entries); sizes are _Static_assert-ed in the C source too
MAPS = {
    "ingress": (8, NUM_TC * MAX_INGRESS),
    "cfg": (PORT_CFG.size, 1),
    "dscp_tc": (4, NUM_DSCP),
    "class_cfg": (CLASS_CFG.size, NUM_TC),
    "pause": (PAUSE.size, NUM_TC),
    "state": (STATE.size, NUM_SLOTS),
}


class PortMapError(RuntimeError):
    """A map is missing, of another layout, or the bpf(2) syscall refused a request."""


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
                raise PortMapError(
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
        return self.lookup_range(0, self.entries, flags)

    def lookup_range(self, start: int, count: int, flags: int = 0) -> memoryview:
        """Values of keys start .. start + count - 1, in one BPF_MAP_LOOKUP_BATCH.

        The kernel copies every element a batch covers (~0.15 us each): reading one
        class's 64 ingress slots instead of the whole 512-slot map is 8x cheaper, and
        the PFC agent does it for every port on every poll.
        """
        if not (0 <= start and count > 0 and start + count <= self.entries):
            raise ValueError(f"{self.name}: keys {start}..{start + count - 1} outside "
                             f"0..{self.entries - 1}")
        size = count * self.value_size
        if self._batch_ok:
            b = self.bpf
            b.clear()
            # An array batch continues after the key in_batch points at.
            self.key.value = start - 1
            in_batch = ctypes.addressof(self.key) if start else 0
            struct.pack_into("=QQQQIIQQ", b.attr, 0, in_batch, ctypes.addressof(self.out_batch),
                             ctypes.addressof(self.keys), ctypes.addressof(self.values),
                             count, self.fd, flags, 0)
            got = -1
            try:
                b.call(BPF_MAP_LOOKUP_BATCH, f"MAP_LOOKUP_BATCH {self.name}")
                got = count
            except OSError as exc:
                if exc.errno == errno.ENOENT:       # "no more": count says how many came
                    got = struct.unpack_from("=I", b.attr, 32)[0]
                elif exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, _ENOTSUPP):
                    raise
            if got == count and (self._batch_checked or
                                 list(self.keys[:count]) == list(range(start, start + count))):
                self._batch_checked = True
                return memoryview(self.values).cast("B")[:size]
            self._batch_ok = False
        for i in range(count):
            value = self.lookup(start + i, flags)
            ctypes.memmove(ctypes.addressof(self.values) + i * self.value_size, value,
                           self.value_size)
        return memoryview(self.values).cast("B")[:size]


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


_INGRESS_ROW = struct.Struct(f"={MAX_INGRESS}Q")


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
        self.ingress = self.maps["ingress"]
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

    def set_paused(self, tc: int, paused: bool, now_ns: int | None = None,
                   credit_bytes: int = 0) -> None:
        """Pause or resume class `tc`'s virtual queue. `credit_bytes`: what the class's
        gate lets out at once as it changes (a TBF change refills the bucket): the
        program takes it off the vq, which would otherwise keep it as queued."""
        _lock, was, since, total, credit = PAUSE.unpack(self.pause.lookup(tc, BPF_F_LOCK))
        if bool(was) == paused:
            return
        now = time.monotonic_ns() if now_ns is None else now_ns
        if was:                     # resuming: the pause that just ended joins the total
            total += max(0, now - since)
        self.pause.update(tc, PAUSE.pack(0, int(paused), now, total, credit + credit_bytes),
                          BPF_F_LOCK)

    def reset(self) -> None:
        """Empty every virtual queue and zero every counter (pause state is kept)."""
        zero = bytes(STATE.size)
        for slot in range(NUM_SLOTS):
            self.state.update(slot, zero, BPF_F_LOCK)

    def ingress_bytes(self, tc: int) -> dict[int, int]:
        """Cumulative wire bytes each ingress ifindex put into class `tc` (0: sent locally)."""
        rows = self.ingress.lookup_range(tc * MAX_INGRESS, MAX_INGRESS)
        return {slot: value for slot, value in enumerate(_INGRESS_ROW.unpack(rows)) if value}

    def read(self) -> dict[int, ClassCounters]:
        states = self.state.lookup_all(BPF_F_LOCK)
        pauses = self.pause.lookup_all(BPF_F_LOCK)
        rate = PORT_CFG.unpack(self.cfg.lookup(0))[0]
        now = time.monotonic_ns()
        out = {}
        for slot, row in enumerate(STATE.iter_unpack(states)):
            (_lock, _pad, vq_fp, last_ns, paused_seen, packets, nbytes, ect, ce_in, marks,
             would, drops, overflows, max_vq, mark_errors, credit_seen) = row
            paused = False
            if slot < NUM_TC:
                _l, flag, since, total, credit = PAUSE.unpack_from(pauses, slot * PAUSE.size)
                paused = flag != 0
                vq_fp = _drained(vq_fp, last_ns, paused_seen, flag, since, total, rate, now,
                                 credit - credit_seen)
            out[slot] = ClassCounters(packets, nbytes, ect, ce_in, marks, would, drops,
                                      overflows, max_vq, mark_errors, vq_fp >> FP_SHIFT,
                                      paused, last_ns)
        return out

    def vq_bytes(self, tc: int) -> int:
        """Class `tc`'s virtual queue now: `read()[tc].vq_bytes` in three element lookups
        instead of two batches and nine rows (the PFC agent asks for it on every poll)."""
        row = STATE.unpack(self.state.lookup(tc, BPF_F_LOCK))
        _l, flag, since, total, credit = PAUSE.unpack(self.pause.lookup(tc, BPF_F_LOCK))
        rate = PORT_CFG.unpack(self.cfg.lookup(0))[0]
        return _drained(row[2], row[3], row[4], flag, since, total, rate,
                        time.monotonic_ns(), credit - row[15]) >> FP_SHIFT


def _drained(vq_fp: int, last_ns: int, paused_seen_ns: int, paused: int, since_ns: int,
             paused_total_ns: int, rate_fp: int, now_ns: int, credit_bytes: int = 0) -> int:
    """A class's virtual queue (fixed point) as the program would see it at `now_ns`:
    drained at the port's rate over the time since its last arrival that was not paused,
    less the gate's credit the program has not taken yet."""
    if not vq_fp:
        return 0
    paused_now = paused_total_ns + now_ns - since_ns if paused and now_ns > since_ns \
        else paused_total_ns
    active = now_ns - last_ns if now_ns > last_ns else 0
    if paused_now > paused_seen_ns:
        active -= paused_now - paused_seen_ns
    if active > 0:
        vq_fp = max(0, vq_fp - active * rate_fp)
    if credit_bytes > 0:            # after the drain, as the program applies it
        vq_fp = max(0, vq_fp - (credit_bytes << FP_SHIFT))
    return vq_fp


def _ino(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return -1
