"""UET streams (`python -m agents.uet`): RDMA-style WRITE or SEND streams over the
user-space Ultra Ethernet transport (agents/uet: PDS reliable unordered delivery over UDP
4793, per-packet entropy, NSCC or receiver credit), every byte checked at the target.

An entry becomes ONE agent per host that takes part, running every stream of that host,
as initiator or as target, over one UET NIC (`agents.uet.nic.UetNic`) bound to UDP 4793:
the port is the NIC's, so a host has one UET user (a second entry, or a UET collective,
on the same host is a config problem). Each agent reads its host's streams from a JSON
schedule the run writes (`AgentSpec.inputs`, agents/uet/host.py), so the two ends of a
stream agree on its number, memory key, match bits and data pattern with no set-up
exchange:

- streams are numbered 0, 1, ... over every UET entry of the workload in config order;
  stream s WRITEs into the target's region with memory key UET_KEY_BASE + s, and its
  SENDs carry match bits s << 32 | message index;
- message k of stream s is the seeded pattern numpy default_rng([seed, k]) (seed from
  s), so the target recomputes and compares every byte;
- the initiator's last message is a SEND with match bits s << 32 | DONE_INDEX carrying
  the number of data messages it sent (8 bytes, big-endian): with `duration`, only the
  initiator knows that number, and the target finishes once it has that many.

Agents of hosts that only receive are started first (role "receiver") and the run waits
for their ready file; every host that initiates a stream is a "sender" started at the
common start. docs/uet.md is the user's page; argv is in fabric units.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.wire.uet import UET_UDP_PORT
from testbed.fields import NAME_RE, DurationNs, SizeBytes
from testbed.workloads.base import (
    AgentFiles,
    AgentSpec,
    CheckContext,
    ClassView,
    ExpandContext,
    PathPin,
    Problem,
    ResultRow,
    Results,
    RunView,
    Shape,
    TrafficEntry,
    WorkloadKind,
    flow_drops_of,
    stream_account,
    streams,
)
from testbed.workloads.rdma import roce_window_packets

UetKindName = Literal["uet_pairs", "uet_incast", "uet_all_to_all"]
# agents.uet.host's KEY_BASE and DONE_INDEX (not imported: it pulls in numpy, and the
# config loads this module); tests/unit/test_workload_uet.py keeps them equal.
UET_KEY_BASE = 0x1000               # stream s writes with memory key UET_KEY_BASE + s
DONE_INDEX = 0xFFFFFFFF             # match bits s << 32 | DONE_INDEX: the initiator's last
UET_MAX_MESSAGE_BYTES = 1 << 30     # a target holds a region of at least one message
UET_MAX_WINDOW_PACKETS = 1 << 15     # agents.uet.nic.UetOptions: at most 32768
UET_MAX_STREAMS = 1 << 20
# A target's region per stream: message slots of this many bytes (at least one message).
# Message k goes to slot k mod slots; an initiator keeps at most `slots` messages of a
# stream outstanding, so a slot is rewritten only after its last message was verified.
UET_REGION_BYTES = 8 << 20
# An agent imports numpy, builds the first messages' data and binds its port before the
# common start.
UET_STARTUP_S = 0.3
# A stream that moved less than this share of its line rate while it ran, with no ECN,
# trim, NACK or timeout to slow it, was held back by the agent's CPU.
CPU_BOUND_SHARE = 0.8
LONG_STREAM_NS = 50_000
# A stream that posted its first message later than this after its start is noted.
UET_LATE_NS = 5_000
# The run waits this many times the busiest host's line-rate time (messages mode).
SPAN_SLACK = 4
# Bytes of a UET data packet beyond its payload, besides the UDP/IP/Ethernet framing:
# the PDS request (12, 16 with congestion-control state) and the SES standard header (44).
PDS_SES_BYTES = 16 + 44


class UetTraffic(TrafficEntry):
    """RDMA WRITE or SEND streams over the user-space Ultra Ethernet transport (agents/uet).

    One agent per host that takes part runs all of its streams over one UET NIC
    (UDP 4793). Each (source, destination) stream is one PDC; its packets carry a
    source port (entropy) chosen per packet by `entropy`, so a sprayed stream uses
    every equal-cost path. The target checks every byte (`verify`). Start and
    duration are fabric time: an initiator posts messages for `duration`, or exactly
    `messages`, then a last SEND that says how many it sent.
    """

    name: str = Field(pattern=NAME_RE, description="the entry's name: lower-case letters, "
                      "digits and _, unique in the workload; agents and results carry it")
    kind: UetKindName = Field(
        description="uet_incast: senders to one receiver; uet_all_to_all: every ordered pair "
                    "of hosts; uet_pairs: the pairs listed; one agent per host takes part")
    senders: list[str] | None = Field(None, description="uet_incast: sending hosts")
    receiver: str | None = Field(None, description="uet_incast: the receiving host")
    hosts: list[str] | None = Field(None, description="uet_all_to_all: hosts (default all)")
    pairs: list[tuple[str, str]] | None = Field(None, description="uet_pairs: [src, dst] lists")
    test: Literal["write_bw", "send_bw"] = Field(
        "write_bw", description="write_bw: RDMA WRITEs into a region the target registered; "
                                "send_bw: SENDs the target reassembles")
    size_bytes: SizeBytes = Field(65536, alias="size",
                                  description="message bytes, 1 B .. 1 GiB")
    start_ns: DurationNs = Field(0, alias="start", description="when the initiators start "
                                 "posting, fabric time after the run's common start t0")
    duration_ns: DurationNs | None = Field(
        None, alias="duration",
        description="post messages for this fabric time, then wait for the outstanding ones "
                    "(give this or messages)")
    messages: int | None = Field(
        None, ge=1, le=DONE_INDEX - 1,
        description="post exactly this many messages per stream (give this or duration)")
    cc: Literal["nscc", "credit", "none"] = Field(
        "nscc", description="congestion control: nscc (sender-based, ECN and delay; the class "
                            "must mark ECN), credit (the receiver paces credit at its line "
                            "rate), none (the window alone)")
    entropy: Literal["spray", "oblivious", "reps"] = Field(
        "spray", description="the UDP source port (entropy) of each packet: spray (round "
                             "robin over `entropies` ports), oblivious (one port per stream, as "
                             "RoCE), reps (reuse ports whose ACKs came back clean, leave those "
                             "that saw ECN or trims)")
    entropies: int = Field(16, ge=1, le=4096, description="source ports a sprayed or reps "
                           "stream uses")
    entropy_paths: Literal["balanced", "hashed"] = Field(
        "balanced", description="balanced: once the fabric is up, the run picks each "
        "initiator's source ports so that every equal-cost path to its target gets the same "
        "number of them (an initiator with one target); hashed: consecutive ports from "
        "0xD000, wherever the ECMP hash puts them")
    window_packets: Annotated[int, Field(ge=1, le=UET_MAX_WINDOW_PACKETS)] | Literal[
        "auto"] = Field(
        "auto", alias="window",
        description="most unacknowledged packets per stream, 1..32768, or auto: the fabric's "
                    "longest round trip at line rate, as roce entries (docs/roce.md, "
                    "'In-flight window')")
    tclass: str | int | None = Field(  # type: ignore[assignment]
        None, description="traffic class name or number of data and ACKs (default: the one "
                          "class with trim: true; required if there is none or several); "
                          "with cc nscc, a class that marks ECN")
    verify: bool = Field(True, description="the target checks every byte written or sent")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("window_packets", mode="before")
    @classmethod
    def _window(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                               and 1 <= value <= UET_MAX_WINDOW_PACKETS):
            return value
        raise ValueError(f"expected a whole number of packets, 1..{UET_MAX_WINDOW_PACKETS}, "
                         f"or auto, got {value!r}")

    @field_validator("size_bytes")
    @classmethod
    def _size(cls, value: int) -> int:
        if not 1 <= value <= UET_MAX_MESSAGE_BYTES:
            raise ValueError(f"message size {value} B is outside 1 B .. 1 GiB")
        return value


def trim_classes(classes: Mapping[str | int, ClassView]) -> list[ClassView]:
    """The classes with `trim: true`, each once."""
    seen: dict[str, ClassView] = {}
    for c in classes.values():
        if getattr(c, "trim", False):
            seen.setdefault(c.name, c)
    return list(seen.values())


def resolve_class(t: UetTraffic, classes: Mapping[str | int, ClassView]
                  ) -> tuple[ClassView | None, str | None]:
    """The entry's class (its tclass, or the one trimming class), or why there is none."""
    if t.tclass is not None:
        c = classes.get(t.tclass)
        return (c, None) if c is not None else (None, f"unknown traffic class {t.tclass!r}")
    trimming = trim_classes(classes)
    if len(trimming) == 1:
        return trimming[0], None
    if not trimming:
        return None, ("no traffic class has trim: true, so a uet entry needs tclass: (a lossy "
                      "class; give it trim: true for switch trimming)")
    return None, (f"several classes trim ({', '.join(c.name for c in trimming)}); say which "
                  "with tclass:")


def uet_hosts(entry: TrafficEntry, hosts: Sequence[str]) -> list[str]:
    """The hosts of a uet entry's streams, each once, in stream order."""
    ends = [h for pair in streams(entry, UetKind.shapes[entry.kind], hosts) for h in pair]
    return list(dict.fromkeys(ends))


def message_wire_bytes(size_bytes: int, payload_bytes: int) -> int:
    """What one message costs on the wire: its payload, and per packet the PDS + SES
    headers and the UDP/IPv4/Ethernet framing (66 B)."""
    packets = max(1, -(-size_bytes // payload_bytes))
    return size_bytes + packets * (PDS_SES_BYTES + WIRE_OVERHEAD_BYTES)


def slots_and_depth(size_bytes: int, messages: int | None, window_packets: int,
                    payload_bytes: int) -> tuple[int, int]:
    """(message slots of a target's region, messages an initiator keeps outstanding):
    slots fill UET_REGION_BYTES (one message at least, no more than it will send);
    outstanding messages are at most the slots (each in a slot of its own) and a window's
    worth and one more (so the window, not the posting, bounds what is in flight)."""
    slots = max(1, UET_REGION_BYTES // size_bytes)
    if messages is not None:
        slots = min(slots, messages)
    per_message = max(1, -(-size_bytes // payload_bytes))
    depth = min(slots, -(-window_packets // per_message) + 1)
    return slots, max(1, depth)


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> dict:
    return json.loads(text)


def _schedule(spec: AgentSpec) -> dict:
    return _parsed(dict(spec.inputs).get("schedule.json", "{}"))


def _pdc_sum(res: dict, key: str) -> int:
    return int((((res.get("nic") or {}).get("totals")) or {}).get(key) or 0)


class UetKind(WorkloadKind):
    shapes: ClassVar = {"uet_incast": Shape.INCAST, "uet_all_to_all": Shape.ALL_TO_ALL,
                        "uet_pairs": Shape.PAIRS}
    model: ClassVar = UetTraffic
    agent_module: ClassVar = "agents.uet"
    doc: ClassVar = ("WRITE or SEND streams over the user-space Ultra Ethernet transport "
                     "(agents/uet: PDS RUD over UDP 4793, per-packet entropy, NSCC or "
                     "receiver credit, selective retransmission), every byte verified: one "
                     "agent per host that takes part, one row per stream.")
    ports: ClassVar = {"udp": range(UET_UDP_PORT, UET_UDP_PORT + 1)}
    example: ClassVar = {"name": "sprayed", "kind": "uet_pairs", "pairs": [["h1", "h4"]],
                         "size": "1MB", "messages": 8, "tclass": "default", "cc": "credit"}
    console_columns: ClassVar = (
        ("src", "src"), ("dst", "dst"), ("Gb/s", "gbps"), ("retrans", "retransmissions"),
        ("trims", "trims"), ("sports", "sports"), ("verified", "verified"))
    result_fields: ClassVar = {
        "src": "initiator host", "dst": "target host",
        "test": "write_bw or send_bw",
        "cc": "congestion control: nscc, credit or none",
        "entropy": "how each packet's source port was chosen: spray, oblivious or reps",
        "entropies": "source ports the stream could use",
        "bytes": "message bytes acknowledged (data messages, the last SEND not counted)",
        "messages": "data messages acknowledged",
        "time_us": "first post to the last data message's acknowledgement, fabric us",
        "start_us": "the first post, fabric us after the run's common start",
        "end_us": "start_us + time_us",
        "gbps": "bytes over time_us, fabric Gb/s",
        "tx_packets": "data packets the initiator sent, retransmissions included",
        "rx_packets": "data packets the target received, trimmed ones and duplicates "
                      "included",
        "retransmissions": "data packets the initiator sent again (after a NACK, a SACK "
                           "hole or a timeout)",
        "nacks": "NACKs the initiator received (a trimmed packet, or the target out of "
                 "resources)",
        "trims": "trimmed packets of the stream that reached the target (each became a "
                 "NACK)",
        "timeouts": "retransmission timeouts at the initiator",
        "ecn_acks": "ACKs the initiator received that reported a CE-marked packet",
        "out_of_order": "data packets the target received above a missing PSN (normal "
                        "when spraying)",
        "sports": "distinct UDP source ports (entropies) the stream's packets used",
        "verified": "the target checked every byte of every message (false: a mismatch; "
                    "null: not checked, or the stream did not finish)",
        "error": "the first error either end reported (null: none)",
    }

    def describe(self, spec: AgentSpec) -> str:
        return f"UET agent {spec.name}"

    # -- config

    def check(self, entry: TrafficEntry, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
        assert isinstance(entry, UetTraffic)
        t = entry
        if t.duration_ns is None and t.messages is None:
            yield (loc, f"{t.kind} needs duration: (post messages for that long) or messages: "
                   "(post exactly that many per stream)")
        elif t.duration_ns is not None and t.messages is not None:
            yield (loc + ("messages",), "duration and messages are both given; give one: "
                   "duration posts messages for that long, messages exactly that many")
        c, why = resolve_class(t, ctx.classes)
        if why is not None:
            yield loc + ("tclass",), why
        elif c is not None and t.cc == "nscc" and not c.ecn:
            yield (loc + ("tclass",), f"class {c.name!r} (TC{c.tc}) does not mark ECN, so NSCC "
                   "never sees a congestion mark; use a class with ecn: true, or cc: credit "
                   "(receiver credit) or cc: none")
        seen: set[tuple[str, str]] = set()
        for j, (src, dst) in enumerate(t.pairs or []):
            if (src, dst) in seen:
                yield (loc + ("pairs", j), f"[{src}, {dst}] is listed twice: a pair of hosts "
                       "is one stream (one PDC); raise messages or size instead")
            seen.add((src, dst))

    def host_ports(self, entry: TrafficEntry,
                   ctx: CheckContext) -> dict[str, list[tuple[str, int, str]]]:
        """Every host of the entry runs a UET NIC on UDP 4793: one UET user per host."""
        return {h: [("udp", UET_UDP_PORT, "the UET NIC of uet streams")]
                for h in uet_hosts(entry, ctx.hosts)}

    # -- expansion

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        """One agent per host of the entry's streams: hosts that only receive first."""
        assert isinstance(entry, UetTraffic)
        t = entry
        state = ctx.state("uet")
        first = state.get("next_stream", 0)
        pairs = streams(t, self.shape(t), ctx.hosts)
        if first + len(pairs) > UET_MAX_STREAMS:
            raise ValueError(f"more than {UET_MAX_STREAMS} UET streams in one run")
        state["next_stream"] = first + len(pairs)
        c, why = resolve_class(t, ctx.classes)
        if c is None and t.tclass is None:
            raise ValueError(f"{t.name}: {why}")     # the config's checks said so first
        tclass: str | int = c.name if c is not None else t.tclass   # type: ignore[assignment]
        payload = ctx.roce_mtu_bytes
        rtt_ns = ctx.round_trip_ns(ctx.tc(tclass)) if t.window_packets == "auto" else None
        out: dict[str, list[dict]] = {}
        inc: dict[str, list[dict]] = {}
        for j, (src, dst) in enumerate(pairs):
            sid = first + j
            window = (roce_window_packets(ctx.line_rate_bps(src), rtt_ns, payload)
                      if rtt_ns is not None else int(t.window_packets))
            slots, depth = slots_and_depth(t.size_bytes, t.messages, window, payload)
            common = {"stream": sid, "test": t.test, "size": t.size_bytes,
                      "messages": t.messages, "slots": slots, "seed": 1 + 16 * sid,
                      "verify": t.verify}
            out.setdefault(src, []).append(
                {**common, "peer": ctx.address(dst), "peer_host": dst,
                 "start_ns": t.start_ns, "duration_ns": t.duration_ns, "depth": depth,
                 "window_packets": window})
            inc.setdefault(dst, []).append({**common, "peer": ctx.address(src),
                                            "peer_host": src})
        klass = {"name": tclass, "tc": ctx.tc(tclass),
                 "lossless": bool(getattr(c, "lossless", False)),
                 "ecn": bool(getattr(c, "ecn", False)), "trim": bool(getattr(c, "trim", False))}
        windows = [s["window_packets"] for rows in out.values() for s in rows]
        balance = {h: _balance(ctx, h, rows[0]["peer_host"], t.entropies) for h, rows in
                   out.items() if t.entropy != "oblivious" and t.entropy_paths == "balanced"
                   and len(rows) == 1}
        specs: list[AgentSpec] = []
        order = ([h for h in ctx.hosts if h in inc and h not in out]
                 + [h for h in ctx.hosts if h in out])
        span = self.span_ns(t, ctx)
        trim_dscp = ctx.trim_dscp(ctx.tc(tclass))
        trim = ([] if trim_dscp is None or trim_dscp == ctx.dscp(tclass)
                else ["--trim-dscp", str(trim_dscp)])
        for h in order:
            doc: dict[str, Any] = {"out": out.get(h, []), "in": inc.get(h, []),
                                   "tclass": klass}
            if balance.get(h):
                doc["balance"] = balance[h]
            argv = ["--bind", ctx.address(h), "--dscp", str(ctx.dscp(tclass)),
                    "--cc", t.cc, "--entropy", t.entropy, "--entropies", str(t.entropies),
                    "--window-packets", str(max(windows, default=256)),
                    "--payload-bytes", str(payload),
                    "--base-rtt-ns", str(max(1, max(
                        (ctx.base_rtt_ns(h, r["peer_host"]) for r in out.get(h, [])
                         + inc.get(h, [])), default=1))),
                    "--line-rate-bps", str(ctx.line_rate_bps(h)),
                    "--dilation", str(ctx.dilation), *trim]
            sender = h in out
            specs.append(AgentSpec(
                name=f"{t.name}-{h}", node=h, role="sender" if sender else "receiver",
                traffic=t.name, kind=t.kind, module=self.agent_module, src=h,
                dst="" if sender else h, duration_ns=span if sender else 0, argv=argv,
                inputs=(("schedule.json", json.dumps(doc, separators=(",", ":"))),)))
        return specs

    def span_ns(self, entry: TrafficEntry, ctx: ExpandContext | None) -> int:
        """With duration: start + duration. With messages: the start plus SPAN_SLACK
        times what the busiest host takes to move its bytes at line rate (the agents
        exit when their streams are done; this only bounds how long the run waits)."""
        assert isinstance(entry, UetTraffic)
        if entry.duration_ns is not None:
            return entry.start_ns + entry.duration_ns
        if ctx is None or entry.messages is None:
            return entry.start_ns
        wire = message_wire_bytes(entry.size_bytes, ctx.roce_mtu_bytes) * entry.messages
        load: dict[str, int] = {}
        for src, dst in streams(entry, self.shape(entry), ctx.hosts):
            load[src] = load.get(src, 0) + wire
            load[dst] = load.get(dst, 0) + wire
        busiest = max((-(-n * 8 * 10**9 // ctx.line_rate_bps(h)) for h, n in load.items()),
                      default=0)
        return entry.start_ns + SPAN_SLACK * busiest

    def path_pins(self, specs: Sequence[AgentSpec]) -> list[PathPin]:
        """Per initiator with `entropy_paths: balanced`: a pin per switch of the widest
        level of its paths (the spines of a leaf-spine), each for an equal share of its
        entropies, so every path carries as many of its source ports."""
        pins = []
        for spec in specs:
            b = _schedule(spec).get("balance")
            if spec.role != "sender" or not b:
                continue
            pins += [PathPin(sender=spec.name, traffic=spec.traffic, src=spec.node,
                             dst=b["dst"], dport=UET_UDP_PORT, count=int(b["per_via"]),
                             via=(v,)) for v in b["via"]]
        return pins

    def pinned(self, spec: AgentSpec, sports: Sequence[int]) -> AgentSpec:
        return dataclasses.replace(spec, argv=[*spec.argv, *(a for p in sports
                                                             for a in ("--sport", str(p)))])

    def startup_wall_s(self, spec: AgentSpec) -> float:
        return UET_STARTUP_S

    def waits_ready(self, spec: AgentSpec) -> bool:
        return spec.role == "receiver"

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        return ["--schedule", str(files.inputs["schedule.json"]),
                "--ready-file", str(files.ready), "--out", str(files.out)]

    # -- results

    def _streams(self, specs: Sequence[AgentSpec], results: Results) -> list[dict]:
        """Per stream, in stream order: its schedule row, entry, the initiator's and the
        target's records (empty dicts where an agent left none)."""
        by_id: dict[int, dict] = {}
        for spec in specs:
            doc = _schedule(spec)
            res = results.get(spec.name) or {}
            recs_out = {int(r["stream"]): r for r in res.get("streams_out") or []}
            recs_in = {int(r["stream"]): r for r in res.get("streams_in") or []}
            for row in doc.get("out", []):
                s = by_id.setdefault(row["stream"], {"in": {}, "target": None})
                s.update(row=row, spec=spec, out=recs_out.get(row["stream"], {}),
                         src=spec.node, dst=row["peer_host"], res_out=res)
            for row in doc.get("in", []):
                s = by_id.setdefault(row["stream"], {"out": {}, "spec": spec, "row": row,
                                                     "src": row["peer_host"],
                                                     "dst": spec.node, "res_out": {}})
                s.update({"in": recs_in.get(row["stream"], {}), "target": spec})
        return [by_id[k] for k in sorted(by_id)]

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        """One row per stream (its initiator's and its target's records)."""
        rows = []
        for s in self._streams(specs, results):
            spec, o, i = s["spec"], s["out"], s["in"]
            args = _argv(spec)
            first = o.get("first_post_ns")
            last = o.get("last_done_ns")
            fabric_ns = float(last - first) if first is not None and last is not None else 0.0
            nbytes = int(o.get("bytes") or 0)
            verified = i.get("verified")
            rows.append(ResultRow(spec.traffic, spec.kind, {
                "src": s["src"], "dst": s["dst"], "test": s["row"].get("test"),
                "cc": args.get("--cc"), "entropy": args.get("--entropy"),
                "entropies": int(args.get("--entropies") or 0) or None,
                "bytes": nbytes, "messages": int(o.get("messages") or 0),
                "time_us": round(fabric_ns / 1e3, 3),
                "start_us": round(first / 1e3, 3) if first is not None else None,
                "end_us": round(last / 1e3, 3) if last is not None else None,
                "gbps": round(nbytes * 8 / fabric_ns, 3) if fabric_ns > 0 else 0.0,
                "tx_packets": int(o.get("tx_packets") or 0),
                "rx_packets": int(i.get("rx_packets") or 0),
                "retransmissions": int(o.get("retransmissions") or 0),
                "nacks": int(o.get("nacks") or 0),
                "trims": int(i.get("trims") or 0),
                "timeouts": int(o.get("timeouts") or 0),
                "ecn_acks": int(o.get("ecn_acks") or 0),
                "out_of_order": int(i.get("out_of_order") or 0),
                "sports": len(o.get("sports") or {}),
                "verified": verified,
                "error": o.get("error") or i.get("error"),
            }))
        return rows

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        """Per stream: the initiator's data packets against the target's, less the
        fabric's drops of packets from the initiator to the target's port 4793.

        The port programs count drops per 5-tuple, and the initiator's credit requests
        and its ACKs of the reverse stream share the data's 5-tuples: drops beyond the
        data the target missed, up to what the initiator sent besides data
        (`control_sent`), were of those and are left out (`control_drops`). Sprayed
        packets take several paths, so their out-of-order arrivals are the fabric's
        doing, not the emulator's: only a one-entropy stream counts them as reordered."""
        out = []
        for s in self._streams(specs, results):
            spec, o, i = s["spec"], s["out"], s["in"]
            drops = flow_drops_of(flow_drops, view.addresses(s["src"]), view.address(s["dst"]),
                                  UET_UDP_PORT, None)
            drops["injected"] = int(o.get("injected_drops") or 0)
            sent, received = int(o.get("tx_packets") or 0), int(i.get("rx_packets") or 0)
            excess = sum(drops.values()) - max(0, sent - received)
            control = min(max(0, excess), int(o.get("control_sent") or 0))
            left = control
            for cause in ("phy", "tail", "mmu", "desc"):
                take = min(left, drops[cause])
                drops[cause] -= take
                left -= take
            sports = o.get("sports") or {}
            ooo = int(i.get("out_of_order") or 0)
            lost = any(drops.values()) or int(i.get("trims") or 0) > 0
            reordered = ooo if len(sports) <= 1 and not lost else 0
            a = stream_account(spec, sent=sent, received=received, drops=drops,
                               reordered=reordered, complete=bool(o and i))
            a.update(name=f"{spec.traffic}-{s['src']}-{s['dst']}", src=s["src"], dst=s["dst"],
                     control_drops=control - left)
            out.append(a)
        return out

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        """Agents that failed or left nothing, unfinished streams, bytes that did not
        match, malformed packets, socket drops, a sender short of CPU, and whether PFC
        paused anything while UET ran."""
        notes: list[str] = []
        for spec in specs:
            res = results.get(spec.name)
            who = self.describe(spec)
            if not res:
                notes.append(f"{who} on {spec.node} left no results")
                continue
            if res.get("error"):
                notes.append(f"{who} on {spec.node}: {res['error']}")
            ready = view.ready_mtime_ns(spec)
            if ready is not None and ready > view.t0_realtime_ns:
                notes.append(f"{who} on {spec.node} bound UDP {UET_UDP_PORT} "
                             f"{(ready - view.t0_realtime_ns) / 1e6:.0f} ms (wall) after the "
                             "common start: packets to it before then were lost and resent")
            malformed = _pdc_sum(res, "malformed")
            if malformed:
                notes.append(f"{who}: {malformed} UET datagrams did not parse and were dropped "
                             "(counted per reason in its nic.totals.malformed_reasons)")
            sock = (res.get("nic") or {}).get("sockets") or {}
            overflow = int(res.get("udp_rcvbuf_errors") or 0)
            if overflow:
                notes.append(f"{who}: {overflow} datagrams to {spec.node} were dropped by full "
                             "UDP receive buffers while it ran (the agent fell behind, not the "
                             "fabric: a NIC would have taken them); selective retransmission "
                             "resent them, so its streams' times include those resends")
            enobufs = int(sock.get("send_enobufs") or 0)
            if enobufs:
                notes.append(f"{who}: {enobufs} sends were refused by the host's own queue "
                             "(ENOBUFS) and retried")
        streams_ = self._streams(specs, results)
        for s in streams_:
            spec, o, i = s["spec"], s["out"], s["in"]
            name = f"{spec.traffic}: stream {s['src']} -> {s['dst']}"
            if o and not o.get("done"):
                notes.append(f"{name} had not finished when the run stopped it: "
                             f"{o.get('messages', 0)} of {o.get('posted', 0)} posted messages "
                             "acknowledged")
            if i and not i.get("done") and o.get("done"):
                notes.append(f"{name}: the target had {i.get('messages', 0)} of "
                             f"{i.get('expected')} messages when it stopped")
            late = o.get("start_late_ns")
            if late is not None and late > UET_LATE_NS:
                notes.append(f"{name} posted its first message {late / 1e3:.1f} us (fabric) "
                             "after its start (the agent was busy setting up); its time "
                             "counts from that post")
            if i.get("verified") is False:
                notes.append(f"{name}: the data did not arrive byte-exact (first mismatch "
                             f"{i.get('first_mismatch')})")
            slow = _cpu_bound(s, view)
            if slow is not None:
                why = ("the agent was short of CPU for this packet rate (payload size and "
                       "dilation), so its rate measures the emulator; raise the dilation")
                if _argv(spec).get("--cc") == "nscc" and o.get("cwnd_bytes"):
                    srtt = o.get("srtt_ns")
                    rtt = (f", its smoothed RTT {srtt / 1e3:.1f} us against a base RTT of "
                           f"{view.base_rtt_ns(s['src'], s['dst']) / 1e3:.1f} us"
                           if srtt else "")
                    why = (f"NSCC's window held it ({o['cwnd_bytes'] / 1e3:.0f} KB at the "
                           f"end{rtt}) or the agent's CPU did: the agents' own time per round "
                           "trip counts as fabric delay to NSCC's delay signal, so raise the "
                           "dilation")
                notes.append(f"{name} moved {slow:.0%} of its line rate with no ECN, trim, "
                             f"NACK or timeout to slow it: {why}")
        notes += _pfc_notes(specs, streams_, view)
        return notes


def _balance(ctx: ExpandContext, src: str, dst: str, entropies: int) -> dict | None:
    """How to balance `src`'s entropies towards `dst`: the switches of the widest level of
    its equal-cost paths (by distance from its first switch; the spines of a leaf-spine)
    and how many ports each gets; None where every path crosses the same switches."""
    def switches(node: str) -> list[str]:
        return [n for n in ctx.neighbours(node) if ctx.role(n) == "switch"]

    def distances(start: str) -> dict[str, int]:
        dist, queue = {start: 0}, deque([start])
        while queue:
            cur = queue.popleft()
            for nbr in switches(cur):
                if nbr not in dist:
                    dist[nbr] = dist[cur] + 1
                    queue.append(nbr)
        return dist

    owner = next(iter(switches(dst)), None)
    first = switches(src)
    if owner is None or len(first) != 1:
        return None
    to_owner, from_first = distances(owner), distances(first[0])
    if owner not in from_first:
        return None
    levels: dict[int, list[str]] = {}
    for v, d in from_first.items():
        if v in to_owner and d + to_owner[v] == from_first[owner]:
            levels.setdefault(d, []).append(v)
    widest = max(levels.values(), key=len, default=[])
    if len(widest) < 2 or entropies < len(widest):
        return None
    via = sorted(widest)
    return {"dst": dst, "via": via, "per_via": max(1, -(-entropies // len(via)))}


def _argv(spec: AgentSpec) -> dict[str, str]:
    a = spec.argv
    return {a[k]: a[k + 1] for k in range(len(a) - 1) if a[k].startswith("--")}


def _cpu_bound(s: dict, view: RunView) -> float | None:
    """The share of its line rate a stream moved, if it ran long enough, alone on its
    initiator, with nothing telling it to slow down, and below CPU_BOUND_SHARE."""
    o, spec = s["out"], s["spec"]
    if not o.get("done") or spec.role != "sender" or len(_schedule(spec).get("out", [])) != 1:
        return None
    if _argv(spec).get("--cc") == "credit":
        return None                     # the receiver paces it
    if any(int(o.get(k) or 0) for k in ("ecn_acks", "nacks", "timeouts")) or int(
            s["in"].get("trims") or 0) or spec.node in view.paused_nodes:
        return None
    first, last = o.get("first_post_ns"), o.get("last_done_ns")
    if first is None or last is None or last <= first:
        return None
    busy = last - first
    if busy < max(LONG_STREAM_NS, 10 * view.base_rtt_ns(s["src"], s["dst"])):
        return None
    payload = int(_argv(spec).get("--payload-bytes") or 4096)
    size = int(s["row"].get("size") or 1)
    wire = message_wire_bytes(size, payload) * int(o.get("messages") or 0)
    share = wire * 8e9 / busy / view.line_rate_bps(s["src"])
    return share if share < CPU_BOUND_SHARE else None


def _pfc_notes(specs: Sequence[AgentSpec], streams_: list[dict], view: RunView) -> list[str]:
    """What the run's pause counters say about the UET entries' classes: none paused at
    all (a fact of this run, and what UET on a lossy class expects), or which nodes were."""
    entries: dict[str, dict] = {}
    for s in streams_:
        e = entries.setdefault(s["spec"].traffic, {"trims": 0, "retransmissions": 0,
                                                   "duplicates": 0,
                                                   "class": _schedule(s["spec"]).get(
                                                       "tclass") or {}})
        e["trims"] += int(s["in"].get("trims") or 0)
        e["duplicates"] += int(s["in"].get("pds_duplicates") or 0)
        e["retransmissions"] += int(s["out"].get("retransmissions") or 0)
    notes = []
    for traffic, e in entries.items():
        c = e["class"]
        what = f"class {c.get('name')} (TC{c.get('tc')})" if c else "its class"
        if not view.paused_nodes:
            notes.append(f"{traffic}: no PFC pause frame reached any port during the run "
                         f"(pauses 0); the UET streams ran on {what}"
                         f"{', lossy' if c and not c.get('lossless') else ''}, and their "
                         f"{e['trims']} trims and {e['retransmissions']} retransmissions, not "
                         "PFC, recovered what the fabric cut or lost"
                         + (f"; {e['duplicates']} packets arrived twice at the targets: "
                            "resends of packets that had only been delayed (sprayed packets "
                            "reordered past the SACK reordering window), not losses"
                            if e["duplicates"] else ""))
        elif c.get("lossless"):
            notes.append(f"{traffic}: its {what} is lossless, and PFC paused ports on "
                         f"{', '.join(sorted(view.paused_nodes))} during the run: UET's "
                         "streams were held by PFC as well as by their own congestion control")
    return notes


KIND = UetKind()
