"""The in-network aggregator's ALU model (SwitchML / ATP style): pure, no sockets.

`Aggregator.handle(datagram, source)` takes one UDP payload and returns the datagrams
to send, as (bytes, (ip, port)) pairs; the clock is injected (fabric ns), so tests
drive it with any schedule. The packet format is `agents.wire.ina`'s; the protocol
is docs/ina.md's. In short:

- **Jobs.** A job has members (workers, who send REQUESTs), optionally children
  (leaf aggregators, who send PARTIALs), a pool of `slots` slots of `slot_elements`
  int32 each, and its own pool: two jobs never share a slot (SHARP-like concurrent
  jobs). A contributor is identified by its id AND its configured address; a packet
  for an unknown job, from a non-member, or that does not fit the job's pool is
  dropped and counted by reason (`DropReason`), never an exception.
- **Slots and shadow copies.** Every slot has two copies, one per generation bit
  (SwitchML's even / odd pools): chunk c aggregates in copy (c % slots, (c // slots)
  & 1). A copy holds the chunk being summed or, once complete, its result. A worker
  sends chunk c + slots into the same slot only after it received the result of c,
  so when chunk c + 2 * slots reaches copy (slot, gen) every worker has sent
  c + slots and therefore already holds the result of c: that is when the copy is
  overwritten, and until then a retransmitted REQUEST for c (its result was lost)
  is answered from the copy, to that worker alone. Two copies are what makes this
  safe: the result of c must outlive the start of c + slots in the other copy.
- **Contributions.** The first contribution to a chunk resets the copy; each
  member's (or child's) bit is set once; a contribution whose bit is already set is
  a duplicate (ignored, counted); all bits set completes the chunk.
- **Arithmetic.** int32 elements add like a switch ALU: two's complement, wrapping
  modulo 2^32 (accumulated in int64, wrapped on completion, which gives the same
  bits). Elements whose sum left the int32 range are counted (`overflow_elements`);
  the worker's quantisation (agents.collectives.ina) never lets a float sum get
  there, and int32 data wraps exactly as numpy's int32 addition does.
- **Counters.** Totals, per job, drops by reason, and per configured address (every
  member, child and the parent: datagrams received from it, how many of those it did
  not take, datagrams sent to it), so each stream of a job can be accounted end to
  end; datagrams from any other address are one count (`received_from_others`).
- **Tree.** With a parent (`parent=(ip, port)`), a completed chunk becomes ONE
  PARTIAL to the parent (sender = the job's `uplink_id`, bitmap = this aggregator's
  contributors) and waits; the parent's RESULT completes it here and is relayed,
  unchanged, to every member and child. A duplicate REQUEST that arrives while the
  chunk waits for its parent re-sends the PARTIAL (the PARTIAL or the RESULT was
  lost upstream). Without a parent (a root, or a single aggregator) completion
  sends the RESULT to every member and child. Recovery is driven by the workers'
  timers alone: like a switch, the aggregator keeps no timer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import NamedTuple

import numpy as np

from agents.wire import BytesLike
from agents.wire.ina import (
    AGGREGATOR,
    EXP_NONE,
    MAX_CONTRIBUTORS,
    MAX_ELEMENTS,
    Header,
    MalformedPacket,
    MalformedReason,
    Packet,
    PacketType,
    build,
    gen_of,
    parse,
    slot_of,
)

Addr = tuple[str, int]
Send = tuple[bytes, Addr]

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
#: Most slots of one job's pool (the slot field is a u16).
MAX_SLOTS = 1 << 16


class DropReason(StrEnum):
    """Why a well-formed packet was not aggregated; one counter each."""

    UNKNOWN_JOB = "unknown_job"             # no job with this id here
    NOT_MEMBER = "not_member"               # a REQUEST from an id / address not a member
    NOT_CHILD = "not_child"                 # a PARTIAL from an id / address not a child
    NOT_PARENT = "not_parent"               # a RESULT from anyone but the parent
    UNEXPECTED_RESULT = "unexpected_result"  # a RESULT with no parent, or for no waiting chunk
    BAD_SLOT = "bad_slot"                   # slot beyond the job's pool
    SCHEDULE_MISMATCH = "schedule_mismatch"  # slot / gen are not chunk's (chunk % slots, ...)
    TOO_LONG = "too_long"                   # more elements than the job's slot_elements
    STALE = "stale"                         # an older chunk than the copy holds (late copy)
    SLOT_BUSY = "slot_busy"                 # a newer chunk while the copy is still summing
    COUNT_MISMATCH = "count_mismatch"       # element count differs from the chunk's first
    EXPONENT_MISMATCH = "exponent_mismatch"  # exponent differs from the chunk's first


class Contributor(NamedTuple):
    """One member (worker) or child (leaf aggregator) of a job, and where it listens."""

    id: int
    ip: str
    port: int

    @property
    def addr(self) -> Addr:
        return (self.ip, self.port)


@dataclass(frozen=True)
class JobConfig:
    """One job: members, children, pool. Bit i of a bitmap is contributor i of
    `contributors` (members first, then children)."""

    id: int
    members: tuple[Contributor, ...]
    slots: int
    slot_elements: int
    children: tuple[Contributor, ...] = ()
    uplink_id: int | None = None    # this aggregator's id in its parent's children

    def __post_init__(self) -> None:
        _check_job(self)

    @property
    def contributors(self) -> tuple[Contributor, ...]:
        return self.members + self.children


def _check_contributor(job: int, c: Contributor) -> None:
    if not 0 <= c.id < AGGREGATOR:
        raise ValueError(f"job {job}: contributor id {c.id} is not 0..{AGGREGATOR - 1}")
    try:
        ipaddress.IPv4Address(c.ip)
    except ValueError:
        raise ValueError(f"job {job}: {c.ip!r} is not an IPv4 address") from None
    if not 1 <= c.port <= 0xFFFF:
        raise ValueError(f"job {job}: port {c.port} is not 1..65535")


def _check_job(j: JobConfig) -> None:
    if not 0 <= j.id <= 0xFFFFFFFF:
        raise ValueError(f"job id {j.id} is not a u32")
    every = j.contributors
    if not 1 <= len(every) <= MAX_CONTRIBUTORS:
        raise ValueError(f"job {j.id}: {len(every)} members + children, "
                         f"must be 1..{MAX_CONTRIBUTORS}")
    for c in every:
        _check_contributor(j.id, c)
    for group, name in ((j.members, "member"), (j.children, "child")):
        ids = [c.id for c in group]
        if len(set(ids)) != len(ids):
            raise ValueError(f"job {j.id}: a {name} id appears twice: {sorted(ids)}")
    addrs = [c.addr for c in every]
    if len(set(addrs)) != len(addrs):
        raise ValueError(f"job {j.id}: two contributors share an address")
    if not 1 <= j.slots <= MAX_SLOTS:
        raise ValueError(f"job {j.id}: slots {j.slots} is not 1..{MAX_SLOTS}")
    if not 1 <= j.slot_elements <= MAX_ELEMENTS:
        raise ValueError(f"job {j.id}: slot_elements {j.slot_elements} is not "
                         f"1..{MAX_ELEMENTS}")
    if j.uplink_id is not None and not 0 <= j.uplink_id < AGGREGATOR:
        raise ValueError(f"job {j.id}: uplink_id {j.uplink_id} is not 0..{AGGREGATOR - 1}")


def _contributors(job: int, raw: object, key: str) -> tuple[Contributor, ...]:
    if not isinstance(raw, list):
        raise ValueError(f"job {job}: {key} must be a list of [id, \"ip\", port]")
    out = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], int)
                or not isinstance(item[1], str) or not isinstance(item[2], int)):
            raise ValueError(f"job {job}: {key} entry {item!r} is not [id, \"ip\", port]")
        out.append(Contributor(item[0], item[1], item[2]))
    return tuple(out)


JOB_KEYS = frozenset({"id", "members", "children", "slots", "slot_elements", "uplink_id"})


def jobs_from_json(data: object) -> list[JobConfig]:
    """Jobs from the parsed --jobs JSON: [{"id", "members": [[id, "ip", port], ...],
    "children": [...] (optional), "slots", "slot_elements", "uplink_id" (optional)}].
    Raises ValueError naming the first problem."""
    if not isinstance(data, list) or not data:
        raise ValueError("jobs must be a non-empty JSON list of objects")
    jobs: list[JobConfig] = []
    for raw in data:
        if not isinstance(raw, dict):
            raise ValueError(f"a job must be an object, got {raw!r}")
        unknown = set(raw) - JOB_KEYS
        missing = {"id", "members", "slots", "slot_elements"} - set(raw)
        if unknown or missing:
            raise ValueError(f"job {raw.get('id')!r}: unknown keys {sorted(unknown)}, "
                             f"missing keys {sorted(missing)}")
        for key in ("id", "slots", "slot_elements", "uplink_id"):
            value = raw.get(key, 0)
            if key == "uplink_id" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"job {raw.get('id')!r}: {key} must be an integer, "
                                 f"got {value!r}")
        jobs.append(JobConfig(
            id=raw["id"], members=_contributors(raw["id"], raw["members"], "members"),
            children=_contributors(raw["id"], raw.get("children", []), "children"),
            slots=raw["slots"], slot_elements=raw["slot_elements"],
            uplink_id=raw.get("uplink_id")))
    ids = [j.id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a job id appears twice: {sorted(ids)}")
    return jobs


# --------------------------------------------------------------------------- state


class CopyState(Enum):
    EMPTY = 0        # never used
    OPEN = 1         # summing: some contributors are in
    FORWARDED = 2    # complete here, PARTIAL sent up, waiting for the parent's RESULT
    COMPLETE = 3     # the result is kept (the shadow copy) until the copy is reused


class _Copy:
    """One (slot, generation) copy of a slot: the switch's registers for it."""

    __slots__ = ("acc", "bitmap", "chunk", "count", "exponent", "next_exp", "opened_ns",
                 "packet", "state")

    def __init__(self, slot_elements: int) -> None:
        self.state = CopyState.EMPTY
        self.chunk = -1
        self.acc = np.zeros(slot_elements, dtype=np.int64)
        self.bitmap = 0
        self.count = 0
        self.exponent = 0
        self.next_exp = EXP_NONE
        self.opened_ns = 0.0
        self.packet = b""          # FORWARDED: the PARTIAL; COMPLETE: the RESULT

    def open(self, h: Header, now_ns: float) -> None:
        self.state = CopyState.OPEN
        self.chunk = h.chunk
        self.bitmap = 0
        self.count = h.elements
        self.exponent = h.exponent
        self.next_exp = EXP_NONE
        self.opened_ns = now_ns
        self.packet = b""


class Stats:
    """Count, min, mean, max of a stream of numbers."""

    __slots__ = ("count", "max", "min", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.min: float | None = None
        self.max: float | None = None

    def add(self, v: float) -> None:
        self.count += 1
        self.total += v
        self.min = v if self.min is None else min(self.min, v)
        self.max = v if self.max is None else max(self.max, v)

    def merge(self, other: Stats) -> None:
        if other.min is None or other.max is None:
            return
        self.count += other.count
        self.total += other.total
        self.min = other.min if self.min is None else min(self.min, other.min)
        self.max = other.max if self.max is None else max(self.max, other.max)

    def as_dict(self) -> dict:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 1)
        return {"count": self.count, "min": r(self.min),
                "avg": r(self.total / self.count) if self.count else None, "max": r(self.max)}


@dataclass
class JobCounters:
    """What one job's pool did; the aggregator's totals are their sums."""

    requests: int = 0              # REQUESTs for this job (accepted or not)
    partials_received: int = 0     # PARTIALs from children
    results_received: int = 0      # RESULTs from the parent
    aggregated: int = 0            # contributions added into a slot
    duplicates: int = 0            # contributions whose bit was already set (ignored)
    completed: int = 0             # chunks whose result is known here
    results_sent: int = 0          # RESULT datagrams sent (multicast copies + shadow answers)
    shadow_answers: int = 0        # retransmitted contributions answered from a kept result
    partials_forwarded: int = 0    # first PARTIAL of a chunk to the parent
    partials_resent: int = 0       # PARTIAL re-sent on a duplicate while waiting upstream
    duplicate_results: int = 0     # RESULTs from the parent for an already complete chunk
    overflow_elements: int = 0     # elements whose sum left int32 and wrapped
    slots_in_use: int = 0          # copies OPEN or FORWARDED now
    slots_in_use_max: int = 0
    drops: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in DropReason})

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["drops"] = dict(self.drops)
        return out


class PeerCounters:
    """Datagrams to and from one address the aggregator knows (a member, child or parent),
    so each stream of a job can be accounted end to end: `discarded` are received
    datagrams it did not take (malformed, unknown job, dropped by a DropReason)."""

    __slots__ = ("discarded", "received", "sent")

    def __init__(self) -> None:
        self.received = self.discarded = self.sent = 0

    def as_dict(self) -> dict:
        return {"received": self.received, "discarded": self.discarded, "sent": self.sent}


class _Job:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.full = (1 << len(cfg.contributors)) - 1
        self.pool = [[_Copy(cfg.slot_elements) for _ in range(cfg.slots)] for _ in (0, 1)]
        # (id, address) -> bit position, per direction: members send REQUESTs,
        # children PARTIALs; an id alone is not enough (anyone can write one).
        self.member_pos = {(c.id, c.addr): i for i, c in enumerate(cfg.members)}
        self.child_pos = {(c.id, c.addr): len(cfg.members) + i
                          for i, c in enumerate(cfg.children)}
        self.addrs = [c.addr for c in cfg.contributors]
        self.counters = JobCounters()
        self.latency = Stats()     # fabric ns from a chunk's first contribution to its result


# --------------------------------------------------------------------------- the ALU


class Aggregator:
    """The switch ALU: jobs' pools, contributions in, results (or partials) out.

    `clock` returns fabric nanoseconds (agents.timebase.FabricClock.now_ns); it only
    times how long chunks stay open. `parent` makes this a leaf of a tree: every job
    then needs an `uplink_id`.
    """

    def __init__(self, jobs: Iterable[JobConfig], clock: Callable[[], float],
                 parent: Addr | None = None) -> None:
        self._clock = clock
        self.parent = parent
        self._jobs: dict[int, _Job] = {}
        for cfg in jobs:
            if cfg.id in self._jobs:
                raise ValueError(f"job {cfg.id} configured twice")
            if parent is not None and cfg.uplink_id is None:
                raise ValueError(f"job {cfg.id}: with a parent, a job needs its uplink_id")
            self._jobs[cfg.id] = _Job(cfg)
        self.packets_received = self.bytes_received = 0
        self.packets_sent = self.bytes_sent = 0
        self.unknown_job = 0
        self.malformed = {r.name: 0 for r in MalformedReason}
        # Only configured addresses get counters of their own: a switch keeps no state
        # for whoever else sends to it, so everyone else shares `received_from_others`.
        self.peers = {c.addr: PeerCounters() for j in self._jobs.values()
                      for c in j.cfg.contributors}
        if parent is not None:
            self.peers.setdefault(parent, PeerCounters())
        self.received_from_others = 0
        self._discarded = 0          # every datagram received and not taken, any reason

    # -- entry point

    def handle(self, data: BytesLike, src: Addr) -> list[Send]:
        """One datagram from `src`; returns what to send. Never raises for a packet."""
        self.packets_received += 1
        self.bytes_received += len(data)
        before = self._discarded
        out = self._handle(data, src)
        peer = self.peers.get(src)
        if peer is None:
            self.received_from_others += 1
        else:
            peer.received += 1
            peer.discarded += self._discarded - before
        for payload, to in out:
            self.packets_sent += 1
            self.bytes_sent += len(payload)
            self.peers[to].sent += 1         # only ever to a member, child or the parent
        return out

    def _handle(self, data: BytesLike, src: Addr) -> list[Send]:
        try:
            pkt = parse(data)
        except MalformedPacket as e:
            self.malformed[e.reason.name] += 1
            self._discarded += 1
            return []
        job = self._jobs.get(pkt.header.job)
        if job is None:
            self.unknown_job += 1
            self._discarded += 1
            return []
        h = pkt.header
        if h.type == PacketType.REQUEST:
            job.counters.requests += 1
            out = self._contribution(job, pkt, job.member_pos.get((h.sender, src)),
                                     DropReason.NOT_MEMBER)
        elif h.type == PacketType.PARTIAL:
            job.counters.partials_received += 1
            out = self._contribution(job, pkt, job.child_pos.get((h.sender, src)),
                                     DropReason.NOT_CHILD)
        else:
            job.counters.results_received += 1
            out = self._from_parent(job, pkt, data, src)
        return out

    # -- helpers

    def _drop(self, job: _Job, reason: DropReason) -> list[Send]:
        job.counters.drops[reason.value] += 1
        self._discarded += 1
        return []

    def _misfit(self, job: _Job, h: Header) -> DropReason | None:
        """Why `h` does not fit `job`'s pool, or None."""
        cfg = job.cfg
        if h.slot >= cfg.slots:
            return DropReason.BAD_SLOT
        if h.slot != slot_of(h.chunk, cfg.slots) or h.gen != gen_of(h.chunk, cfg.slots):
            return DropReason.SCHEDULE_MISMATCH
        if h.elements > cfg.slot_elements:
            return DropReason.TOO_LONG
        return None

    def _busy(self, job: _Job, delta: int) -> None:
        c = job.counters
        c.slots_in_use += delta
        c.slots_in_use_max = max(c.slots_in_use_max, c.slots_in_use)

    # -- contributions (REQUEST from a member, PARTIAL from a child)

    def _contribution(self, job: _Job, pkt: Packet, pos: int | None,
                      not_ours: DropReason) -> list[Send]:
        h = pkt.header
        if pos is None:
            return self._drop(job, not_ours)
        misfit = self._misfit(job, h)
        if misfit is not None:
            return self._drop(job, misfit)
        copy = job.pool[h.gen][h.slot]
        c = job.counters
        if copy.chunk != h.chunk:
            if copy.state is not CopyState.EMPTY and h.chunk < copy.chunk:
                return self._drop(job, DropReason.STALE)
            if copy.state in (CopyState.OPEN, CopyState.FORWARDED):
                return self._drop(job, DropReason.SLOT_BUSY)
            copy.open(h, self._clock())      # reuse: the old result is no longer needed
            self._busy(job, +1)
        elif copy.state is CopyState.COMPLETE:
            # Every bit is set, so this is a retransmission: its sender lost the result.
            c.shadow_answers += 1
            c.results_sent += 1
            return [(copy.packet, job.addrs[pos])]
        bit = 1 << pos
        if copy.bitmap & bit:
            c.duplicates += 1
            if copy.state is CopyState.FORWARDED and self.parent is not None:
                c.partials_resent += 1       # the PARTIAL or its RESULT was lost upstream
                return [(copy.packet, self.parent)]
            return []
        if h.elements != copy.count:
            return self._drop(job, DropReason.COUNT_MISMATCH)
        if h.exponent != copy.exponent:
            return self._drop(job, DropReason.EXPONENT_MISMATCH)
        acc = copy.acc[:h.elements]
        if copy.bitmap:
            np.add(acc, pkt.values, out=acc)
        else:
            acc[:] = pkt.values              # first contribution: no clearing pass needed
        copy.bitmap |= bit
        if h.next_exp != EXP_NONE:
            copy.next_exp = max(copy.next_exp, h.next_exp)
        c.aggregated += 1
        if copy.bitmap != job.full:
            return []
        return self._complete(job, copy, h)

    def _complete(self, job: _Job, copy: _Copy, h: Header) -> list[Send]:
        """All contributors are in: wrap the sum to int32 and send it on."""
        acc = copy.acc[:copy.count]
        c = job.counters
        c.overflow_elements += int(np.count_nonzero((acc < INT32_MIN) | (acc > INT32_MAX)))
        values = acc.astype(np.int32)            # modulo 2^32, as the ALU's adders wrap
        if self.parent is not None:
            assert job.cfg.uplink_id is not None        # checked in __init__
            copy.packet = build(Header(PacketType.PARTIAL, h.job, h.chunk, h.slot, h.gen,
                                       job.cfg.uplink_id, copy.exponent, copy.next_exp,
                                       copy.bitmap), values)
            copy.state = CopyState.FORWARDED
            c.partials_forwarded += 1
            return [(copy.packet, self.parent)]
        copy.packet = build(Header(PacketType.RESULT, h.job, h.chunk, h.slot, h.gen, AGGREGATOR,
                                   copy.exponent, copy.next_exp, copy.bitmap), values)
        return self._finish(job, copy)

    def _finish(self, job: _Job, copy: _Copy) -> list[Send]:
        copy.state = CopyState.COMPLETE
        c = job.counters
        c.completed += 1
        c.results_sent += len(job.addrs)
        self._busy(job, -1)
        job.latency.add(self._clock() - copy.opened_ns)
        return [(copy.packet, addr) for addr in job.addrs]

    # -- results from the parent (a leaf of a tree)

    def _from_parent(self, job: _Job, pkt: Packet, data: BytesLike, src: Addr) -> list[Send]:
        h = pkt.header
        if self.parent is None:
            return self._drop(job, DropReason.UNEXPECTED_RESULT)
        if src != self.parent:
            return self._drop(job, DropReason.NOT_PARENT)
        misfit = self._misfit(job, h)
        if misfit is not None:
            return self._drop(job, misfit)
        copy = job.pool[h.gen][h.slot]
        if copy.chunk != h.chunk:
            stale = copy.state is not CopyState.EMPTY and h.chunk < copy.chunk
            return self._drop(job, DropReason.STALE if stale else DropReason.UNEXPECTED_RESULT)
        if copy.state is CopyState.COMPLETE:
            job.counters.duplicate_results += 1      # answers to several re-sent PARTIALs
            return []
        if copy.state is not CopyState.FORWARDED:
            return self._drop(job, DropReason.UNEXPECTED_RESULT)
        if h.elements != copy.count:
            return self._drop(job, DropReason.COUNT_MISMATCH)
        if h.exponent != copy.exponent:
            return self._drop(job, DropReason.EXPONENT_MISMATCH)
        copy.packet = bytes(data)            # relayed as it came: the root's sum and bitmap
        return self._finish(job, copy)

    # -- counters

    def counters(self) -> dict:
        """Totals, per job, and per reason; every key is present from the start."""
        total = JobCounters()
        latency = Stats()
        jobs = {}
        for jid, job in sorted(self._jobs.items()):
            jc = job.counters
            jobs[str(jid)] = {**jc.as_dict(), "slots": job.cfg.slots,
                              "slot_elements": job.cfg.slot_elements,
                              "open_fabric_ns": job.latency.as_dict()}
            for f in fields(jc):
                if f.name == "drops":
                    for k, v in jc.drops.items():
                        total.drops[k] += v
                elif f.name == "slots_in_use_max":
                    total.slots_in_use_max += jc.slots_in_use_max   # a bound: peaks may differ
                else:
                    setattr(total, f.name, getattr(total, f.name) + getattr(jc, f.name))
            latency.merge(job.latency)
        out = total.as_dict()
        out["drops"]["unknown_job"] = self.unknown_job
        out.update({
            "packets_received": self.packets_received, "bytes_received": self.bytes_received,
            "packets_sent": self.packets_sent, "bytes_sent": self.bytes_sent,
            "malformed": dict(self.malformed),
            "slots_total": sum(2 * j.cfg.slots for j in self._jobs.values()),
            "open_fabric_ns": latency.as_dict(),
            "parent": f"{self.parent[0]}:{self.parent[1]}" if self.parent else None,
            "jobs": jobs,
            "peers": {f"{ip}:{port}": c.as_dict() for (ip, port), c in self.peers.items()},
            "received_from_others": self.received_from_others,
        })
        return out


def sampled_counters(counters: dict) -> dict:
    """The numbers the run's collector samples from an aggregator's snapshot, flat (it
    keeps a snapshot's top-level numbers only): `counters` (Aggregator.counters()) with
    `drops_<reason>` and `malformed_<reason>` for the nested counts by reason, `slots`
    (the jobs' pools: at most that many copies are busy at once, since a worker sends
    chunk c + slots only after the result of c) and per job `job<id>_slots_in_use` and
    `job<id>_slots`."""
    out = {k: v for k, v in counters.items()
           if isinstance(v, int | float) and not isinstance(v, bool)}
    out.update({f"drops_{k}": v for k, v in (counters.get("drops") or {}).items()})
    out.update({f"malformed_{k}": v for k, v in (counters.get("malformed") or {}).items()})
    jobs = counters.get("jobs") or {}
    out["slots"] = sum(int(j["slots"]) for j in jobs.values())
    for jid, j in jobs.items():
        out[f"job{jid}_slots_in_use"] = j["slots_in_use"]
        out[f"job{jid}_slots"] = j["slots"]
    return out
