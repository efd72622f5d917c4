"""What a collective is, without numpy: its operations, algorithms, element types, buffer
counts and nccl-tests' size and bus-bandwidth definitions.

Imported by the collective workers (agents.collectives.data, .algorithms) and by the
control plane (testbed/workloads/collective.py, whose config validation must stay
cheap), so that both read one table.
"""

from __future__ import annotations

DTYPES = ("float32", "float16", "bfloat16", "int32")
REDOPS = ("sum", "max")
OPS = ("allreduce", "reducescatter", "allgather", "broadcast", "alltoall")
#: bytes of one element of each dtype (bfloat16 is stored as uint16)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}
#: the algorithms of each operation; the first is the default
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "rhd", "tree"),
    "reducescatter": ("ring",),
    "allgather": ("ring",),
    "broadcast": ("ring",),
    "alltoall": ("pairwise",),
}
#: each operation's bus factor, as nccl-tests' documentation writes it
BUS_FACTOR_FORMULA = {"allreduce": "2(n-1)/n", "reducescatter": "(n-1)/n",
                      "allgather": "(n-1)/n", "alltoall": "(n-1)/n", "broadcast": "1"}


def check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(allowed)}")


def buffer_counts(op: str, count: int, n: int) -> tuple[int, int]:
    """(send, recv) element counts of one rank, nccl-tests' semantics for `count`.

    allreduce, broadcast: count in, count out; reducescatter: count*n in, count out;
    allgather: count in, count*n out; alltoall: count*n both (count per peer).
    """
    check("op", op, OPS)
    if count < 0 or n < 1:
        raise ValueError(f"count {count} and n {n}: need count >= 0, n >= 1")
    if op == "reducescatter":
        return count * n, count
    if op == "allgather":
        return count, count * n
    if op == "alltoall":
        return count * n, count * n
    return count, count


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw * bus_factor(op, n)."""
    buffer_counts(op, 0, n)  # validates op and n
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def size_bytes(op: str, count: int, n: int, dtype: str) -> int:
    """nccl-tests' "size": max(send, recv) bytes of one rank for `count` (its count)."""
    check("dtype", dtype, DTYPES)
    return max(buffer_counts(op, count, n)) * ITEMSIZE[dtype]


def count_of(op: str, size: int, n: int, dtype: str) -> int:
    """The count nccl-tests runs for a size: the largest whose size_bytes fits in it."""
    check("dtype", dtype, DTYPES)
    per = size // ITEMSIZE[dtype]
    return per // n if op in ("reducescatter", "allgather", "alltoall") else per


def algbw(op: str, count: int, n: int, dtype: str, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: size_bytes / seconds."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, not {seconds}")
    return size_bytes(op, count, n, dtype) / seconds


def busbw(op: str, count: int, n: int, dtype: str, seconds: float) -> float:
    """Bus bandwidth in bytes/s: algbw * bus_factor."""
    return algbw(op, count, n, dtype, seconds) * bus_factor(op, n)
