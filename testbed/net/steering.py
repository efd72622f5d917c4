"""Flow steering: each flow's packets are received on one CPU at every port (RPS).

Why. A veth transmit hands the packet to the receiving end with netif_rx, which
queues it on the per-CPU backlog of the CPU that transmitted. Which CPU that is
changes from packet to packet of the same flow: the sender may have moved, and a
port's HTB is dequeued by whichever CPU runs the qdisc (the sender's, or the one
whose watchdog timer fired). Each backlog is a FIFO, but two of them are drained
independently; when one CPU's backlog has to wait (its softirq work put off while
the CPU is busy), the other CPU's later packets of the flow reach the next port
first. Measured: four iperf3 UDP streams across leaf-spine-leaf (D = 100, 2 CPUs)
had 739 datagrams out of order in 5 s; a lone flow, even with its sender moved
every 2 ms, stayed in order: it takes busy CPUs.

The fix. With RPS (Receive Packet Steering) a receiving device picks the backlog
from the packet's flow hash (`get_rps_cpu`: `map[hash % len(map)]`), not from the
CPU it is running on, so every packet of a flow goes through one backlog at each
port, whoever sent or dequeued it. The same streams with rps_cpus = 3 on every
port had 0 out of order (docs/datapath.md "Ordering" has the measurements). The
cost: a flow's forwarding runs on the CPU its hash picks, at every hop, so a few
heavy flows can end up sharing one CPU.

How it is set, cheapest first:
- `default-mask`: the per-namespace sysctl net.core.rps_default_mask (kernels with
  it per network namespace), written with the namespace's other sysctls when it is
  made. Every device registered in the namespace afterwards, both ends of each
  veth included, starts with that RPS map: no request per port.
- `rps_cpus`: older kernels: each port's queues/rx-N/rps_cpus in sysfs, written
  after the veth pairs exist (a private mount namespace with each namespace's
  sysfs in turn: namespaces.with_sysfs).
- `none`: the kernel has no RPS (CONFIG_RPS off), or the machine has one CPU
  (nothing to reorder across). The build report says which, and why.

The map holds every CPU this process may run on (its affinity, inherited by the
agents it starts). The initial namespace is not touched: the sysctl is written
inside lab namespaces only, and the sysfs files belong to lab devices.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from testbed.net import namespaces

RPS_DEFAULT_MASK = "net.core.rps_default_mask"
_RPS_DEFAULT_MASK_PATH = "/proc/sys/net/core/rps_default_mask"
# A device of the initial namespace always there; only to see whether RPS is built in.
_LOOPBACK_RPS_CPUS = "/sys/class/net/lo/queues/rx-0/rps_cpus"

DEFAULT_MASK = "default-mask"
RPS_CPUS = "rps_cpus"
NONE = "none"


@dataclass(frozen=True)
class Steering:
    """How the builder keeps flows in order on this machine."""

    method: str                 # DEFAULT_MASK, RPS_CPUS or NONE
    cpus: tuple[int, ...] = ()
    reason: str = ""            # why NONE

    @property
    def mask(self) -> str:
        return cpu_mask(self.cpus)

    def namespace_sysctls(self) -> dict[str, str]:
        """Sysctls every lab namespace gets at creation (before its devices exist)."""
        return {RPS_DEFAULT_MASK: self.mask} if self.method == DEFAULT_MASK else {}

    def describe(self) -> str:
        """One line for the build report: "rps cpus 0-1 (...)", or "none: why"."""
        if self.method == NONE:
            return f"none: {self.reason}"
        how = ("per-namespace rps_default_mask" if self.method == DEFAULT_MASK
               else "rps_cpus of every port")
        return f"rps cpus {cpu_list(self.cpus)} ({how})"


def cpu_mask(cpus: Iterable[int]) -> str:
    """The kernel's cpumask text: hex, in comma-separated 32-bit words, highest first
    ({0, 1} -> "3"; {0, 35} -> "8,00000001")."""
    value = 0
    for cpu in cpus:
        if cpu < 0:
            raise ValueError(f"negative CPU number {cpu}")
        value |= 1 << cpu
    words = []
    while True:
        words.append(value & 0xFFFFFFFF)
        value >>= 32
        if not value:
            break
    words.reverse()
    return ",".join([f"{words[0]:x}", *(f"{w:08x}" for w in words[1:])])


def cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(_span(run))
        run = [cpu]
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


@functools.cache
def default_mask_per_namespace() -> bool:
    """Whether net.core.rps_default_mask exists in a network namespace other than the
    initial one (newer kernels; before, it was global or absent). Tried in a scratch
    namespace once per process (~1 ms)."""
    return namespaces.in_scratch_namespace(lambda: os.path.exists(_RPS_DEFAULT_MASK_PATH))


def rps_built_in() -> bool:
    return os.path.exists(_LOOPBACK_RPS_CPUS)


def choose(enabled: bool = True, cpus: Iterable[int] | None = None) -> Steering:
    """What the builder will do on this machine. `enabled=False` builds without it (only
    to measure what it prevents: bench/ordering.py)."""
    if not enabled:
        return Steering(NONE, reason="turned off for this build (keep_order=False)")
    allowed = tuple(sorted(os.sched_getaffinity(0) if cpus is None else cpus))
    if len(allowed) < 2:
        return Steering(NONE, allowed, "one CPU: packets cannot be reordered across CPUs")
    if default_mask_per_namespace():
        return Steering(DEFAULT_MASK, allowed)
    if rps_built_in():
        return Steering(RPS_CPUS, allowed)
    return Steering(NONE, allowed, "this kernel has no RPS (no rx-0/rps_cpus in sysfs): "
                                   "a flow whose packets are processed on two CPUs can be "
                                   "reordered")


def rx_queue_files(ifname: str) -> list[str]:
    """rps_cpus files of a device's receive queues, in the sysfs mounted on /sys."""
    base = f"/sys/class/net/{ifname}/queues"
    return [f"{base}/{q}/rps_cpus" for q in sorted(os.listdir(base)) if q.startswith("rx-")]


def write_rps_cpus(ports: Mapping[str, Sequence[str]], mask: str) -> int:
    """Write `mask` to every receive queue of each namespace's ports ({netns: [ifname]}),
    the RPS_CPUS method (also: mask "0" turns RPS off). Returns the files written."""
    written = 0

    def write(netns: str) -> None:
        nonlocal written
        for ifname in ports[netns]:
            for path in rx_queue_files(ifname):
                with open(path, "w") as fh:
                    fh.write(mask)
                written += 1

    namespaces.with_sysfs(list(ports), write)
    return written


def read_rps_cpus(ports: Mapping[str, Sequence[str]]) -> dict[tuple[str, str], list[str]]:
    """{(netns, ifname): [mask of rx-0, rx-1, ...]} as the kernel shows them."""
    out: dict[tuple[str, str], list[str]] = {}

    def read(netns: str) -> None:
        for ifname in ports[netns]:
            masks = []
            for path in rx_queue_files(ifname):
                with open(path) as fh:
                    masks.append(fh.read().strip())
            out[(netns, ifname)] = masks

    namespaces.with_sysfs(list(ports), read)
    return out
