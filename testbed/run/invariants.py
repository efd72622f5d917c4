"""The run's own invariants: did the emulated fabric behave as the fabric it models?

Every run checks five things and names each violation, with its place, its
fabric time where a sample shows it, and its size:

- (a) `queue`: the queue the port program decides on (ECN, PFC, tail drop) is
  the kernel's real queue: |vq_bytes - backlog_bytes| stays within two frames.
  The sampler reads the program's admitted/departed bytes just before and just
  after each qdisc dump, so a sample is judged against the range the program's
  queue can have had while the kernel was read (not against one instant).
- (b) `headroom`: no lossless queue passes its threshold plus its headroom
  (static: an ingress port's bytes at the switch <= pfc.xoff + headroom;
  shared pool: its headroom use <= its headroom).
- (c) `lossless_drop`: no packet of a lossless class is dropped by a queue
  (tail drop, shared-buffer refusal, descriptor exhaustion, or the kernel's
  qdisc) where PFC protects it. PHY and impairment losses are counted apart: a
  lossless fabric still loses frames to bit errors, and they are configured,
  not emulator faults. A lossless class on a port whose PFC is off (a config
  showing what happens without PFC) is lossless in name only: its drops are
  listed (`unprotected_drops`), not violations.
- (d) `reorder`: no flow's packets arrive out of order without a loss to
  explain it (UDP receivers count it per flow; a RoCE responder's out-of-order
  drops with nothing lost on its flow are reordering).
- (e) `conservation`: every packet sent is received or has a counted place:
  per stream sent = received + drops of its flow in the fabric (PHY,
  impairment, tail, shared buffer, descriptors; by 5-tuple) + drops in the
  receiving host's socket (SO_RXQ_OVFL / the namespace's UDP RcvbufErrors) +
  still queued at the end; and per port and class, the program's admitted
  packets = what the qdisc sent + holds + dropped, what it sent = what the
  peer's ingress saw + the veth's own drops, and every arrival was admitted,
  dropped, refused or trimmed. A trimmed packet (UET trimming) is neither lost nor
  dropped: it left its class's arrivals as a trim, and its short copy is an
  arrival, and an admission, of the trim class, whose departures it then matches.
  A link taken down by the fault timeline loses what its ports held (the kernel
  frees it uncounted) and, until routes converge, what other nodes send into the
  black hole; the timeline counts both (testbed/net/events.py), and they are the
  counted place of that many otherwise missing packets (`link_losses`, named in the
  check's details). Where links carry a netem stage (testbed/net/netem.py), what it
  drops (the PHY's frame loss, or its packet limit) and what it still holds at the
  end (on the wire) are sampled per sending port (`wire_drops`,
  `wire_backlog_packets`) but not by flow: like a link-down's losses they are the
  counted place of up to that many missing packets of any stream (`wire_losses` in
  the check's details), so a lossy link is not an unexplained loss. In such
  a run, reordering is reported beside (d), not against it: flows whose path changed
  are overtaken by their own packets on the new path.

`InvariantMonitor.observe` runs on every sample (the collector calls it);
`InvariantMonitor.finish` runs once after the run with the port programs' final
counters (testbed/net/counters.datapath_snapshot) and the agents' results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from testbed.plan.model import Plan
from testbed.results.store import Sample
from testbed.units import format_size

INVARIANTS = {
    "queue": "(a) the queue ECN and PFC decide on is the real queue",
    "headroom": "(b) lossless queues stay within threshold + headroom",
    "lossless_drop": "(c) lossless classes lose nothing in a queue",
    "reorder": "(d) no flow is reordered by the emulator",
    "conservation": "(e) every lost packet has a counted place",
}
MAX_NOTES_PER_INVARIANT = 6
FRAME_OVERHEAD_BYTES = 24        # FCS, preamble, IFG: the tolerance counts them


@dataclass
class Violation:
    invariant: str              # a key of INVARIANTS
    where: str                  # "leaf2:swp4 TC3", "stream incast h1->h8"
    amount: float
    unit: str                   # "B", "packets"
    detail: str
    ts_fabric_ns: int | None = None
    count: int = 1              # samples or events that showed it

    def note(self) -> str:
        when = "" if self.ts_fabric_ns is None else f" (first at {self.ts_fabric_ns / 1e3:.1f} us)"
        return f"invariant {INVARIANTS[self.invariant]} violated at {self.where}{when}: " \
               f"{self.detail}"


@dataclass
class _Worst:
    amount: float = 0.0
    ts: int | None = None
    first_ts: int | None = None
    count: int = 0
    info: dict = field(default_factory=dict)


def _where(node: str, port: str, tc: int) -> str:
    return f"{node}:{port} TC{tc}"


class InvariantMonitor:
    """Checks (a)-(c) on every sample; (b)-(e) again at the end from exact counters."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.tolerance_bytes = 2 * (plan.mtu_bytes + FRAME_OVERHEAD_BYTES)
        self.lossless = {t.tc for t in plan.traffic_classes if t.lossless}
        # (c) holds where PFC protects a lossless class: a class whose port has PFC off is
        # lossless in name only there, and its drops are reported, not violations
        self.protected = {(node.name, iface.ifname, cls.tc) for node in plan.nodes
                          for iface in node.interfaces for cls in iface.egress.classes
                          if cls.lossless and cls.pfc is not None}
        self.samples = 0
        # (a): per port class, the largest naive |vq - backlog| and the violations
        self.queue_diff: dict[tuple[str, str, int], _Worst] = {}
        self.queue_bad: dict[tuple[str, str, int], _Worst] = {}
        # (b): per (node, ingress port, class) bound
        self.bound: dict[tuple[str, str, int], tuple[int, str]] = {}
        for node in plan.switches():
            for iface in node.interfaces:
                for cls in iface.egress.classes:
                    if cls.tc not in node.buffer.tracked or cls.pfc is None:
                        continue
                    if node.buffer.mode == "shared":
                        self.bound[(node.name, iface.ifname, cls.tc)] = (
                            cls.pfc.headroom_bytes, "headroom_used_bytes")
                    else:
                        self.bound[(node.name, iface.ifname, cls.tc)] = (
                            cls.pfc.xoff_bytes + cls.pfc.headroom_bytes, "ingress_bytes")
        self.headroom_bad: dict[tuple[str, str, int], _Worst] = {}
        # (c): first time a lossless queue counter moved
        self.drop_prev: dict[tuple[str, str, int, str], float] = {}
        self.drop_first: dict[tuple[str, str, int], int] = {}
        # (a) is not judged on a port while its link is being taken down: the kernel has
        # freed its queue and the port program is told a moment later (timeline.py)
        self.quiet: dict[tuple[str, str], list[list[float]]] = {}
        self.pfc_off: dict[tuple[str, int], int] = {}
        # Set when the fabric's PFC agents begin to stop: each opens its gates as it goes,
        # so a queue its upstream still held paused floods a neighbour whose agent has
        # gone. That is the emulator coming down, not the fabric; it is not judged.
        self.frozen = False

    def freeze(self) -> None:
        """Stop judging samples: the fabric agents are about to stop."""
        self.frozen = True

    def quiet_ports(self, ports: list[tuple[str, str]], from_ns: int,
                    to_ns: int | None = None) -> None:
        """Skip (a) on these (node, port)s for samples taken from `from_ns` (fabric) on,
        until `to_ns`; a later call with `to_ns` closes the window opened at `from_ns`."""
        for port in ports:
            windows = self.quiet.setdefault(port, [])
            open_at = next((w for w in windows if w[0] == from_ns), None)
            if open_at is None:
                windows.append([from_ns, float("inf") if to_ns is None else to_ns])
            else:
                open_at[1] = float("inf") if to_ns is None else to_ns

    def _quiet(self, node: str, port: str, ts_fabric_ns: int) -> bool:
        return any(a <= ts_fabric_ns <= b for a, b in self.quiet.get((node, port), ()))

    # -- live ---------------------------------------------------------------------------
    def observe(self, ts_fabric_ns: int, samples: list[Sample],
                brackets: dict[tuple[str, str, int], tuple[int, int]]) -> None:
        if self.frozen:
            return
        self.samples += 1
        backlog: dict[tuple[str, str, int], float] = {}
        vq: dict[tuple[str, str, int], float] = {}
        for s in samples:
            key = (s.node, s.port, s.tclass)
            if s.counter == "backlog_bytes":
                backlog[key] = s.value
            elif s.counter == "vq_bytes":
                vq[key] = s.value
            elif s.counter in ("ingress_bytes", "headroom_used_bytes"):
                bound = self.bound.get(key)
                if bound is not None and bound[1] == s.counter and s.value > bound[0]:
                    w = self.headroom_bad.setdefault(key, _Worst())
                    w.count += 1
                    w.first_ts = w.first_ts if w.first_ts is not None else ts_fabric_ns
                    if s.value - bound[0] > w.amount:
                        w.amount, w.ts = s.value - bound[0], ts_fabric_ns
                        w.info = {"value": s.value, "bound": bound[0]}
            elif (key in self.protected and s.counter in
                  ("class_drops", "tail_drops", "mmu_drops", "desc_drops")):
                dkey = (s.node, s.port, s.tclass, s.counter)
                if s.value > self.drop_prev.get(dkey, 0) and key not in self.drop_first:
                    self.drop_first[key] = ts_fabric_ns
                self.drop_prev[dkey] = s.value
        for key, b in backlog.items():
            if key not in vq or self._quiet(key[0], key[1], ts_fabric_ns):
                continue
            diff = abs(vq[key] - b)
            w = self.queue_diff.setdefault(key, _Worst())
            if diff > w.amount:
                w.amount, w.ts, w.info = diff, ts_fabric_ns, {"vq": vq[key], "backlog": b}
            lo, hi = brackets.get(key, (vq[key], vq[key]))
            off = max(lo - b, b - hi, 0)
            if off > self.tolerance_bytes:
                bad = self.queue_bad.setdefault(key, _Worst())
                bad.count += 1
                bad.first_ts = bad.first_ts if bad.first_ts is not None else ts_fabric_ns
                if off > bad.amount:
                    bad.amount, bad.ts = off, ts_fabric_ns
                    bad.info = {"vq": vq[key], "backlog": b, "lo": lo, "hi": hi}

    # -- at the end ---------------------------------------------------------------------
    def finish(self, snapshot: dict | None, last: dict[str, dict[tuple[str, str, int], float]],
               streams: list[dict], host_udp_errors: dict[str, int],
               link_losses: list[dict] | None = None,
               pfc_off: dict[tuple[str, int], int] | None = None,
               peaks_snapshot: dict | None = None) -> dict:
        """Every invariant's verdict: {"violations": [...], "checks": {...}}.

        `snapshot`: datapath_snapshot() at the end (None without port programs);
        `last`: the store's last value per counter; `streams`: one dict per stream
        (testbed/run/accounts.py `stream_accounts`); `host_udp_errors`: per host,
        UDP RcvbufErrors during the run; `link_losses`: per link-down event of the
        fault timeline, {"where", "packets" (all it lost), "ports": {(node, port,
        tclass): packets freed in that port class's queue}}; `pfc_off`: (node, class)
        -> fabric time a timeline event turned PFC off on a port of it (from then on the
        class is lossless in name only there: its drops and overfull ingresses are
        reported, not violations); `peaks_snapshot`: datapath_snapshot() taken just before
        the fabric agents stopped, whose per-ingress peaks the headroom check reads
        (default: `snapshot`), so a teardown flood is not a headroom violation."""
        self.pfc_off = dict(pfc_off or {})
        out: list[Violation] = []
        out += self._queue_violations()
        out += self._headroom_violations(peaks_snapshot or snapshot)
        drop_violations, unprotected = self._drop_violations(snapshot, last)
        out += drop_violations
        reorders = _reorder_violations(streams)
        # A flow moved to another path by a link event's route change can be overtaken
        # by its own packets on the new path: the network's doing, not the emulator's.
        moved = bool(link_losses) and bool(reorders)
        if not moved:
            out += reorders
        out += _conservation_violations(streams, host_udp_errors, snapshot, last,
                                        self.plan, link_losses or [])
        checks = {name: {"label": label, "held": not any(v.invariant == name for v in out)}
                  for name, label in INVARIANTS.items()}
        worst = max(self.queue_diff.items(), key=lambda kv: kv[1].amount, default=None)
        checks["queue"].update({
            "tolerance_bytes": self.tolerance_bytes, "samples": self.samples,
            "max_abs_diff_bytes": int(worst[1].amount) if worst else 0,
            "max_abs_diff_at": _where(*worst[0]) if worst else None,
            "max_abs_diff_ts_fabric_ns": worst[1].ts if worst else None,
        })
        if snapshot is None:
            checks["queue"]["held"] = None
            checks["queue"]["note"] = "no port programs: nothing to compare"
        checks["conservation"]["streams"] = len(streams)
        wire = wire_losses(last)
        if wire:
            checks["conservation"]["wire_losses"] = wire
        notes = _notes(out)
        if moved:
            checks["reorder"]["after_route_changes"] = {v.where: int(v.amount)
                                                        for v in reorders}
            notes.append(f"{sum(int(v.amount) for v in reorders)} packets of "
                         f"{len(reorders)} streams arrived out of order in a run whose "
                         "routes changed at link events (flows moved to another path are "
                         "overtaken by their own packets): not counted against invariant "
                         f"{INVARIANTS['reorder']}")
        if link_losses:
            checks["conservation"]["link_losses"] = [
                {"where": x["where"], "packets": x["packets"]} for x in link_losses]
        checks["lossless_drop"]["unprotected_drops"] = unprotected
        if self.pfc_off:
            checks["lossless_drop"]["pfc_off_by_events"] = {
                f"{node} TC{tc}": ts for (node, tc), ts in sorted(self.pfc_off.items())}
        return {"checks": checks, "violations": [asdict(v) for v in out],
                "notes": notes}

    def _queue_violations(self) -> list[Violation]:
        out = []
        for key, w in sorted(self.queue_bad.items(), key=lambda kv: -kv[1].amount):
            i = w.info
            out.append(Violation(
                "queue", _where(*key), w.amount, "B",
                f"the kernel's backlog was {format_size(i['backlog'])} while the port program's "
                f"queue was {format_size(i['lo'])}..{format_size(i['hi'])} "
                f"({format_size(w.amount)} beyond the {format_size(self.tolerance_bytes)} "
                f"tolerance, in {w.count} of {self.samples} samples)", w.first_ts, w.count))
        return out

    def _unguarded(self, key: tuple[str, str, int], first_ts: int | None) -> bool:
        """PFC was off (a timeline event) at this node and class when this was first
        seen (or its time is unknown)."""
        off = self.pfc_off.get((key[0], key[2]))
        return off is not None and (first_ts is None or first_ts >= off)

    def _headroom_violations(self, snapshot: dict | None) -> list[Violation]:
        out = []
        seen = set()
        for key, w in sorted(self.headroom_bad.items(), key=lambda kv: -kv[1].amount):
            seen.add(key)
            if self._unguarded(key, w.first_ts):
                continue
            out.append(Violation(
                "headroom", f"{key[0]} ingress {key[1]} TC{key[2]}", w.amount, "B",
                f"held {format_size(w.info['value'])}, {format_size(w.amount)} above its "
                f"threshold + headroom {format_size(w.info['bound'])} "
                f"({w.count} samples)", w.first_ts, w.count))
        for node in (snapshot or {}).get("nodes", []):
            for a in node["ingress"]:
                key = (node["node"], a["port"], a["tclass"])
                bound = self.bound.get(key)
                if bound is None or key in seen or self._unguarded(key, None):
                    continue
                peak = a["max_hdrm_bytes"] if bound[1] == "headroom_used_bytes" \
                    else a["max_bytes"]
                if peak > bound[0]:
                    out.append(Violation(
                        "headroom", f"{key[0]} ingress {key[1]} TC{key[2]}", peak - bound[0],
                        "B", f"peaked at {format_size(peak)}, above its threshold + headroom "
                        f"{format_size(bound[0])} (between samples)"))
        return out

    def _drop_violations(self, snapshot: dict | None,
                         last: dict[str, dict[tuple[str, str, int], float]]
                         ) -> tuple[list[Violation], dict[str, int]]:
        """Queue drops in PFC-protected lossless classes (violations), and per port those
        in lossless classes whose port has PFC off (reported, not violations)."""
        out = []
        drops: dict[tuple[str, str, int], dict[str, int]] = {}
        for key, value in last.get("class_drops", {}).items():
            if key[2] in self.lossless and value:
                drops.setdefault(key, {})["qdisc"] = int(value)
        for row in (snapshot or {}).get("ports", []):
            key = (row["node"], row["port"], row["tclass"])
            if key[2] not in self.lossless:
                continue
            for name in ("tail_drops", "mmu_drops", "desc_drops"):
                if row[name]:
                    drops.setdefault(key, {})[name.replace("_drops", "")] = row[name]
        guarded = {key for key in drops if key in self.protected
                   and not self._unguarded(key, self.drop_first.get(key))}
        unprotected = {_where(*key): sum(parts.values()) for key, parts in drops.items()
                       if key not in guarded}
        drops = {key: parts for key, parts in drops.items() if key in guarded}
        for key, parts in sorted(drops.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(parts.values())
            how = ", ".join(f"{n} {k}" for k, n in sorted(parts.items()))
            out.append(Violation("lossless_drop", _where(*key), total, "packets",
                                 f"{total} packets dropped ({how})",
                                 self.drop_first.get(key)))
        return out, unprotected


def _reorder_violations(streams: list[dict]) -> list[Violation]:
    out = []
    for s in streams:
        if s.get("reordered"):
            out.append(Violation("reorder", f"stream {s['name']}", s["reordered"], "packets",
                                 f"{s['reordered']} packets arrived out of order"
                                 + ("" if s.get("lost_counted") else
                                    " with nothing lost on the flow")))
    return out


def _conservation_violations(streams: list[dict], host_udp_errors: dict[str, int],
                             snapshot: dict | None, last: dict, plan: Plan | None,
                             link_losses: list[dict]) -> list[Violation]:
    """Every lost packet has a counted place: per stream (its drops, its host's socket
    drops, the links' losses) and, given a `snapshot` of the port programs (and the
    `plan` it came from), per port class."""
    out = []
    # packets a link-down lost are not known by flow: they explain missing packets of
    # any stream, up to their number
    # so are the packets the links' netem stages dropped or still hold (not by flow)
    wire = wire_losses(last)
    link_budget = sum(x["packets"] for x in link_losses) + sum(wire.values())
    link_where = "; ".join([x["where"] for x in link_losses]
                           + [f"{n} on the wire from {w}" for w, n in wire.items()])
    flushed: dict[tuple[str, str, int], int] = {}
    for x in link_losses:
        for key, n in x["ports"].items():
            flushed[key] = flushed.get(key, 0) + n
    # per stream, then per receiving host (a host's socket drops are not per stream)
    unexplained: dict[str, list[tuple[dict, int]]] = {}
    for s in streams:
        missing = s["sent"] - s["received"] - s["fabric_drops"] - s.get("socket_drops", 0)
        if missing < 0:
            out.append(Violation("conservation", f"stream {s['name']}", -missing, "packets",
                                 f"received {s['received']} of {s['sent']} sent, with "
                                 f"{s['fabric_drops']} counted drops: {-missing} more arrived "
                                 "than were sent less the drops"))
        elif missing:
            unexplained.setdefault(s["dst"], []).append((s, missing))
    for host, items in unexplained.items():
        budget = host_udp_errors.get(host, 0)
        for s, missing in sorted(items, key=lambda x: -x[1]):
            covered = min(budget, missing)
            budget -= covered
            by_link = min(link_budget, missing - covered)
            link_budget -= by_link
            if missing > covered + by_link:
                where = " or ".join(w for w, on in (("where a link went down", link_losses),
                                                    ("on a link's wire", wire)) if on)
                at_link = f", {by_link} lost {where} ({link_where})" if where else ""
                out.append(Violation(
                    "conservation", f"stream {s['name']}", missing - covered - by_link,
                    "packets",
                    f"sent {s['sent']}, received {s['received']}, {s['fabric_drops']} dropped in "
                    f"the fabric, {s.get('socket_drops', 0) + covered} in {host}'s sockets (a "
                    f"full receive buffer, or no receiver){at_link}: "
                    f"{missing - covered - by_link} packets have no counted place"))
    if snapshot is None or plan is None:
        return out
    default_tcs = {c.tc for n in plan.nodes for i in n.interfaces for c in i.egress.classes
                   if c.classid == i.egress.default_classid}
    sent = last.get("class_packets", {})
    held = last.get("backlog_packets", {})
    qdrops = last.get("class_drops", {})
    for row in snapshot.get("ports", []):
        key = (row["node"], row["port"], row["tclass"])
        if key not in sent or key[2] in default_tcs:
            continue          # the default class also carries ARP and the PFC agents' kicks
        qdisc = int(sent[key] + held.get(key, 0) + qdrops.get(key, 0))
        # What a link-down freed: admitted, and either still in the qdisc (not counted
        # by it) or sent into the veth as it went down (counted as sent, never seen by
        # the peer): the qdisc's count lies between enq - lost and enq.
        lost = flushed.get(key, 0)
        if not qdisc <= row["enq_packets"] <= qdisc + lost:
            off = (row["enq_packets"] - qdisc - lost if row["enq_packets"] > qdisc + lost
                   else qdisc - row["enq_packets"])
            out.append(Violation(
                "conservation", _where(*key), off,
                "packets",
                f"the port program admitted {row['enq_packets']} packets, the qdisc sent, "
                f"holds or dropped {qdisc}"
                + (f", and {lost} were freed when its link went down" if lost else "")))
        transit = int(sent[key]) - row["dep_packets"]
        if transit > 0 and not held.get(key, 0):
            out.append(Violation(
                "conservation", _where(*key), transit, "packets",
                f"the qdisc sent {int(sent[key])} packets and the peer's ingress saw "
                f"{row['dep_packets']}: {transit} vanished between them (veth drops: "
                f"{int(last.get('tx_dropped', {}).get((key[0], key[1], -1), 0))})"))
        out += _arrival_violations(row, key)
        if row["dep_unmatched"]:
            out.append(Violation(
                "conservation", _where(*key), row["dep_unmatched"], "packets",
                f"the peer's ingress saw {row['dep_unmatched']} packets the port never "
                "admitted"))
    return out


def merge_part_invariants(parts: dict[str, dict | None], streams: list[dict],
                          host_udp_errors: dict[str, int], last: dict) -> dict:
    """The invariants of a run over several VMs (testbed/run/merge.py): each VM judged its
    own ports (queue, headroom, lossless drops, the ports' conservation); reordering and
    each stream's conservation need both of its ends, so they are judged here, over every
    VM's results. `parts`: VM -> its summary's `invariants` (None: it left none)."""
    out = [asdict(v) for v in _reorder_violations(streams) + _conservation_violations(
        streams, host_udp_errors, None, last, None, [])]
    violations = [dict(v, vm=vm) for vm, inv in parts.items() if inv
                  for v in inv.get("violations", [])] + out
    checks: dict[str, dict] = {}
    for name, label in INVARIANTS.items():
        held = [(inv.get("checks") or {}).get(name, {}).get("held")
                for inv in parts.values() if inv]
        mine = any(v["invariant"] == name for v in out)
        checks[name] = {"label": label, "held": (
            False if mine or False in held else
            None if None in held or len(held) < len(parts) else True),
            "by_vm": {vm: (inv.get("checks") or {}).get(name) if inv else None
                      for vm, inv in parts.items()}}
    checks["conservation"]["streams"] = len(streams)
    return {"checks": checks, "violations": violations,
            "notes": _notes([Violation(**{k: v[k] for k in Violation.__dataclass_fields__})
                             for v in out])}


def wire_losses(last: dict) -> dict[str, int]:
    """Per sending port ("node:port"), packets its link's netem stage dropped or still
    holds at the end, from the store's last `wire_drops` / `wire_backlog_packets`."""
    out: dict[str, int] = {}
    for counter in ("wire_drops", "wire_backlog_packets"):
        for (node, port, _tc), value in last.get(counter, {}).items():
            if value:
                out[f"{node}:{port}"] = out.get(f"{node}:{port}", 0) + int(value)
    return out


def _arrival_violations(row: dict, key: tuple[str, str, int]) -> list[Violation]:
    """Every arrival at a port class has a place: admitted, dropped (PHY), refused (tail,
    shared buffer, descriptors) or trimmed (a trim is none of the others)."""
    if "packets" not in row:
        return []
    arrived = int(row["packets"])
    placed = sum(int(row.get(k, 0)) for k in ("enq_packets", "drops", "tail_drops",
                                              "mmu_drops", "desc_drops", "trims"))
    if arrived == placed:
        return []
    return [Violation("conservation", _where(*key), abs(arrived - placed), "packets",
                      f"{arrived} packets arrived at the port program and {placed} were "
                      "admitted, dropped, refused or trimmed")]


def _notes(violations: list[Violation]) -> list[str]:
    notes = []
    for name in INVARIANTS:
        mine = [v for v in violations if v.invariant == name]
        notes += [v.note() for v in mine[:MAX_NOTES_PER_INVARIANT]]
        if len(mine) > MAX_NOTES_PER_INVARIANT:
            notes.append(f"invariant {INVARIANTS[name]}: {len(mine) - MAX_NOTES_PER_INVARIANT} "
                         "more places (summary.json `invariants`)")
    return notes
