"""The rxe congestion counters' maps (testbed/net/bpf/rxe_cc.bpf.c), as agents read them.

One program instance per rxe host NIC, pinned under
/sys/fs/bpf/tb/<lab>/<node>/_rxe_cc/: `maps/qp_counts` (hash, BTH DestQP ->
`QpCounts`) and `maps/totals` (one `Totals` entry). Read with bpf(2) through
agents.portmaps' helpers (no libbpf in the process). The layouts are asserted
against the object's BTF in tests/unit/test_rxe_cc_bpf.py.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from pathlib import Path
from typing import NamedTuple

from agents.portmaps import PortMapError, iter_keys, lookup_raw, map_info, obj_get

PIN_ROOT = Path("/sys/fs/bpf/tb")
PIN_NAME = "_rxe_cc"        #: beside a node's port pin dirs and its _node directory
MAX_QPS = 4096
QP_KEY = struct.Struct("=I")
QP_COUNTS = struct.Struct("=4QIIHHI")
QP_COUNTS_FIELDS = ("packets", "ce_packets", "cnps", "bytes", "saddr", "daddr", "sport",
                    "pad0", "pad1")
TOTALS = struct.Struct("=4Q")
TOTALS_FIELDS = ("roce_packets", "ce_packets", "cnps", "untracked")
#: C struct name -> (layout, field names), checked against the object's BTF in tests
LAYOUTS = {"qp_key": (QP_KEY, ("dest_qp",)), "qp_counts": (QP_COUNTS, QP_COUNTS_FIELDS),
           "totals": (TOTALS, TOTALS_FIELDS)}


class QpCounts(NamedTuple):
    """Counters of one local QP (the BTH DestQP of what arrived) at this NIC."""

    dest_qp: int
    packets: int
    ce_packets: int
    cnps: int
    bytes: int
    src_ip: str             # source address of the last packet to this QP
    dst_ip: str             # its destination (this host's address)
    sport: int              # its UDP source port


class Totals(NamedTuple):
    roce_packets: int
    ce_packets: int
    cnps: int
    untracked: int          # packets of a QP that found no room in the table


def pin_dir_of(lab: str, node: str) -> Path:
    return PIN_ROOT / lab / node / PIN_NAME


def _ip(raw: int) -> str:
    return socket.inet_ntoa(struct.pack("=I", raw))


def decode_qp(key: bytes, value: bytes) -> QpCounts:
    (qp,) = QP_KEY.unpack(key)
    packets, ce, cnps, nbytes, saddr, daddr, sport, _p0, _p1 = QP_COUNTS.unpack(value)
    return QpCounts(qp, packets, ce, cnps, nbytes, _ip(saddr), _ip(daddr), sport)


class RxeCcMaps:
    """The open maps of one NIC's counter program; `close()` when done."""

    def __init__(self, pin_dir: Path) -> None:
        self.pin_dir = Path(pin_dir)
        self.qp_fd = self._open("qp_counts", QP_KEY.size, QP_COUNTS.size, MAX_QPS)
        try:
            self.totals_fd = self._open("totals", 4, TOTALS.size, 1)
        except BaseException:
            os.close(self.qp_fd)
            raise

    def _open(self, name: str, key_size: int, value_size: int, entries: int) -> int:
        path = self.pin_dir / "maps" / name
        fd = obj_get(path)
        try:
            _kind, k, v, n, _name = map_info(fd)
            if (k, v, n) != (key_size, value_size, entries):
                raise PortMapError(f"{path}: key/value/entries {k}/{v}/{n}, expected "
                                   f"{key_size}/{value_size}/{entries}: loaded from another "
                                   "version of rxe_cc.bpf.c")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def qps(self) -> dict[int, QpCounts]:
        """Every QP seen so far, by its number (DestQP)."""
        out = {}
        for key in list(iter_keys(self.qp_fd, QP_KEY.size)):
            try:
                value = lookup_raw(self.qp_fd, key, QP_COUNTS.size)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    continue
                raise
            q = decode_qp(key, value)
            out[q.dest_qp] = q
        return out

    def totals(self) -> Totals:
        return Totals(*TOTALS.unpack(lookup_raw(self.totals_fd, QP_KEY.pack(0), TOTALS.size)))

    def close(self) -> None:
        for fd in (self.qp_fd, self.totals_fd):
            if fd >= 0:
                os.close(fd)
        self.qp_fd = self.totals_fd = -1
