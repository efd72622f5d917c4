"""UDP streams (`python -m agents.udp`): paced datagrams, N:1 incast, all-to-all among
hosts, or explicit pairs.

An entry becomes one receiver per destination host and one sender per (source,
destination) stream. The receivers of entry k listen on BASE_PORT + k, so entries never
share a socket; the kind's ports are PORTS, apart from every other kind's. A sender
paces its stream's datagrams at `rate` (default: its NIC's line rate shared by its
streams of the entry) over `flows` source ports.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from testbed.fields import NAME_RE, DurationNs, RateBps, SizeBytes
from testbed.units import format_rate
from testbed.workloads.base import (
    AgentFiles,
    AgentSpec,
    CheckContext,
    ExpandContext,
    LoadContext,
    Problem,
    ResultRow,
    Results,
    RunView,
    Shape,
    StreamLoad,
    TrafficEntry,
    WorkloadKind,
    arg_of,
    flow_drops_of,
    stream_account,
    streams,
)

BASE_PORT = 20000
PORTS = range(BASE_PORT, 30000)       # receivers of entries 0 .. 9999
#: IPv4 20 + UDP 8: the default datagram fills one MTU
IP_UDP_HEADER_BYTES = 28

EcnCodepoint = Literal["notect", "ect0", "ect1", "ce"]


class UdpTraffic(TrafficEntry):
    """Paced UDP flows: N:1 incast, all-to-all among hosts, or explicit pairs.

    Rates, start times and durations are fabric units. A flow's rate defaults
    to the sender's NIC line rate shared by the sender's flows of this entry.
    """

    name: str = Field(pattern=NAME_RE, description="the entry's name: lower-case letters, "
                      "digits and _, unique in the workload; agents and results carry it")
    kind: Literal["udp_incast", "udp_all_to_all", "udp_pairs"] = Field(
        description="udp_incast: senders to one receiver; udp_all_to_all: every ordered pair "
                    "of hosts; udp_pairs: the pairs listed")
    senders: list[str] | None = Field(None, description="udp_incast: sending hosts")
    receiver: str | None = Field(None, description="udp_incast: the receiving host")
    hosts: list[str] | None = Field(None, description="udp_all_to_all: hosts (default all)")
    pairs: list[tuple[str, str]] | None = Field(None, description="udp_pairs: [src, dst] lists")
    rate_bps: RateBps | None = Field(
        None, alias="rate",
        description="per sender->receiver stream, fabric (default: line rate over its streams)")
    size_bytes: SizeBytes | None = Field(None, alias="size",
                                         description="UDP payload (default: MTU - 28)")
    start_ns: DurationNs = Field(0, alias="start", description="when the senders start, "
                                 "fabric time after the run's common start t0")
    duration_ns: DurationNs = Field(alias="duration",
                                    description="how long each sender sends, fabric time")
    tclass: str | int = Field("default", description="traffic class name or number")
    ecn: EcnCodepoint = Field("notect", description="the ECN codepoint the datagrams carry "
                              "(ect0/ect1: ECN-capable, so switches mark CE instead of dropping)")
    flows: int = Field(1, ge=1, le=64, description="flows (source ports) per sender-receiver pair")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)




class UdpKind(WorkloadKind):
    shapes: ClassVar = {"udp_incast": Shape.INCAST, "udp_all_to_all": Shape.ALL_TO_ALL,
                        "udp_pairs": Shape.PAIRS}
    model: ClassVar = UdpTraffic
    agent_module: ClassVar = "agents.udp"
    doc: ClassVar = ("Paced UDP datagrams (agents/udp): one receiver per destination host, "
                     "one sender per stream, each pacing its datagrams at a set rate for a "
                     "set time. Losses are what the receiver did not get.")
    ports: ClassVar = {"udp": PORTS}
    example: ClassVar = {"name": "incast", "kind": "udp_incast", "senders": ["h1", "h2", "h3"],
                         "receiver": "h4", "duration": "1ms"}
    result_fields: ClassVar = {
        "src": "sending host", "dst": "receiving host",
        "tx_packets": "datagrams the sender sent", "tx_bytes": "their UDP payload bytes",
        "rx_packets": "datagrams of this stream the receiver got",
        "rx_bytes": "their UDP payload bytes",
        "lost": "tx_packets - rx_packets (at least 0)",
        "set_fabric_bps": "the rate the sender was asked for, fabric bit/s",
        "tx_fabric_bps": "the rate it sent at, fabric bit/s",
        "rx_fabric_bps": "wire rate received (payload + 66 B per datagram) over the "
                         "receiver's active window (first to last arrival of any stream), "
                         "fabric bit/s",
    }

    def check(self, entry: TrafficEntry, loc: tuple,
              ctx: CheckContext) -> Iterator[Problem]:
        """A set rate above a sender's line rate could never be sent: refuse it, naming both."""
        assert isinstance(entry, UdpTraffic)
        if entry.rate_bps is None:
            return
        if entry.kind == "udp_incast":
            senders = entry.senders or []
        elif entry.kind == "udp_pairs":
            senders = [src for src, _dst in entry.pairs or []]
        else:
            senders = list(entry.hosts or ctx.hosts)
        for src in dict.fromkeys(senders):
            line_bps = ctx.nic_bps.get(src)
            if line_bps is not None and entry.rate_bps > line_bps:
                yield ((*loc, "rate"),
                       f"rate {format_rate(entry.rate_bps)} is above sender {src}'s line rate "
                       f"{format_rate(line_bps)}; lower rate to at most "
                       f"{format_rate(line_bps)} or leave it out (default: line rate)")
                return

    def waits_ready(self, spec: AgentSpec) -> bool:
        # a receiver listens before any sender is started (its ready file: socket bound)
        return spec.role == "receiver"

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        # a receiver's: socket bound (the run waits for it); a sender's: sockets made
        # (the run gives the common start once it has armed: agents.runtime.start)
        return ["--ready-file", str(files.ready)]

    def offered_load(self, entry: TrafficEntry, ctx: LoadContext) -> list[StreamLoad]:
        """Each stream at its configured rate (default: the sender's line rate over its
        streams, as `expand` sets it), in datagrams of its payload + WIRE_OVERHEAD_BYTES;
        no packets come back."""
        assert isinstance(entry, UdpTraffic)
        pairs = streams(entry, self.shape(entry), ctx.hosts)
        size = entry.size_bytes or ctx.mtu_bytes - IP_UDP_HEADER_BYTES
        fanout: dict[str, int] = {}
        for src, _ in pairs:
            fanout[src] = fanout.get(src, 0) + 1
        tclass = ctx.classes.get(entry.tclass)
        lossless = bool(tclass is not None and tclass.lossless)
        return [StreamLoad(src, dst, entry.rate_bps or ctx.nic_bps.get(src, 0) / fanout[src],
                           size + WIRE_OVERHEAD_BYTES, "udp", lossless)
                for src, dst in pairs]

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        assert isinstance(entry, UdpTraffic)
        d = str(ctx.dilation)
        port = BASE_PORT + index
        if port not in PORTS:
            raise ValueError(f"traffic entry {index}: UDP entries take ports "
                             f"{PORTS.start}..{PORTS.stop - 1}, one each; this is one too many")
        pairs = streams(entry, self.shape(entry), ctx.hosts)
        size = entry.size_bytes or ctx.mtu_bytes - IP_UDP_HEADER_BYTES
        specs = [AgentSpec(
            name=f"{entry.name}-recv-{dst}", node=dst, role="receiver", traffic=entry.name,
            kind=entry.kind, module=self.agent_module, dst=dst,
            argv=["recv", "--port", str(port), "--dilation", d])
            for dst in sorted({dst for _, dst in pairs}, key=list(ctx.hosts).index)]
        fanout: dict[str, int] = {}
        for src, _ in pairs:
            fanout[src] = fanout.get(src, 0) + 1
        for src, dst in pairs:
            rate = entry.rate_bps or ctx.line_rate_bps(src) // fanout[src]
            specs.append(AgentSpec(
                name=f"{entry.name}-{src}-{dst}", node=src, role="sender", traffic=entry.name,
                kind=entry.kind, module=self.agent_module, start_ns=entry.start_ns,
                duration_ns=entry.duration_ns, src=src, dst=dst,
                argv=["send", "--dst", ctx.address(dst), "--dport", str(port),
                      "--rate-bps", str(rate), "--size", str(size),
                      "--duration-ns", str(entry.duration_ns), "--dscp",
                      str(ctx.dscp(entry.tclass)), "--ecn", entry.ecn, "--flows",
                      str(entry.flows), "--dilation", d]))
        return specs

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        by_ip = {view.address(s.dst): s.dst for s in specs if s.role == "receiver"}
        by_ip |= {a: s.src for s in specs if s.role == "sender" for a in view.addresses(s.src)}
        received: dict[tuple[str, str, str], list[int]] = {}   # (traffic, src, dst) -> [pk, B]
        window_ns: dict[tuple[str, str], float] = {}            # (traffic, dst) -> fabric ns
        for spec in specs:
            res = results.get(spec.name)
            if spec.role != "receiver" or res is None:
                continue
            if res.get("start_wall_ns") and res.get("end_wall_ns"):
                window_ns[(spec.traffic, spec.dst)] = view.dilation.to_fabric_ns(
                    res["end_wall_ns"] - res["start_wall_ns"])
            for key, flow in res.get("flows", {}).items():
                ip = key.split(":")[0]
                entry = received.setdefault((spec.traffic, by_ip.get(ip, ip), spec.dst), [0, 0])
                entry[0] += flow.get("received", 0)
                entry[1] += flow.get("bytes", 0)
        rows = []
        for spec in specs:
            if spec.role != "sender":
                continue
            sent = results.get(spec.name, {})
            rx_packets, rx_bytes = received.get((spec.traffic, spec.src, spec.dst), [0, 0])
            tx_packets = sent.get("packets", 0)
            # A stream's received rate is over its receiver's whole active window, so the
            # streams into one receiver add up to what that receiver got.
            window = window_ns.get((spec.traffic, spec.dst), 0)
            rx_wire_bits = (rx_bytes + rx_packets * WIRE_OVERHEAD_BYTES) * 8
            rows.append(ResultRow(spec.traffic, spec.kind, {
                "src": spec.src, "dst": spec.dst,
                "tx_packets": tx_packets, "tx_bytes": sent.get("bytes", 0),
                "rx_packets": rx_packets, "rx_bytes": rx_bytes,
                "lost": max(0, tx_packets - rx_packets),
                "set_fabric_bps": sent.get("set_fabric_bps", 0),
                "tx_fabric_bps": round(sent.get("fabric_bps", 0)),
                "rx_fabric_bps": round(rx_wire_bits / window * 1e9) if window else 0,
            }))
        return rows

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        receivers = {(s.traffic, s.dst): s for s in specs if s.role == "receiver"}
        out = []
        for spec in specs:
            if spec.role != "sender":
                continue
            res = results.get(spec.name) or {}
            src_ips = view.addresses(spec.src)
            recv = receivers.get((spec.traffic, spec.dst))
            recv_res = (results.get(recv.name) if recv else None) or {}
            dport = int(arg_of(spec.argv, "--dport") or 0)
            flows = (res.get("flows") or {}).values()
            sports = {int(f["sport"]) for f in flows if "sport" in f}
            sent = sum(int(f.get("packets", 0)) for f in flows)
            received = reordered = 0
            for key, f in (recv_res.get("flows") or {}).items():
                ip, _, rest = key.partition(":")
                sport = int(rest.split("/")[0]) if rest.split("/")[0].isdigit() else -1
                if ip in src_ips and sport in sports:
                    received += int(f.get("received", 0))
                    reordered += int(f.get("reordered", 0))
            drops = flow_drops_of(flow_drops, src_ips, view.address(spec.dst), dport,
                                  sports or None)
            out.append(stream_account(spec, sent=sent, received=received, drops=drops,
                                      reordered=reordered, complete=bool(res and recv_res)))
        return out

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        # A host asked to send more than its NIC's line rate is held back by its own
        # queue (blocking sends): falling behind schedule is then the fabric pushing
        # back, not the CPU failing to keep up. So is a host that PFC paused.
        offered: dict[str, float] = {}
        for spec in specs:
            if spec.role == "sender":
                offered[spec.src] = offered.get(spec.src, 0) + results.get(
                    spec.name, {}).get("set_fabric_bps", 0)
        notes = []
        for spec in specs:
            res = results.get(spec.name, {})
            forgiven = res.get("forgiven_ns", 0)
            held_back = spec.role == "sender" and (
                offered.get(spec.src, 0) > view.line_rate_bps(spec.src)
                or spec.src in view.paused_nodes)
            if spec.role == "sender" and forgiven and not held_back:
                late_us = view.dilation.to_fabric_ns(res.get("max_late_ns", 0)) / 1e3
                notes.append(f"sender {spec.name} fell behind its schedule and skipped "
                             f"{view.dilation.to_fabric_ns(forgiven) / 1e3:.1f} us fabric of "
                             f"sending (max lateness {late_us:.1f} us fabric): the host CPU "
                             "did not keep up")
            if res.get("socket_drops"):
                notes.append(f"receiver {spec.name} dropped {res['socket_drops']} packets in "
                             "its own socket buffer (it fell behind, not the fabric)")
        return notes


KIND = UdpKind()
