"""What the kinds whose agents are the ranks of a communicator over the user-space RoCE
transport share (the collectives, the training step): one numbering of the ranks on each
host, and so of the host ports they listen on; the transport's entry fields and their
checks; the transport part of a rank's argv.

With `transport: uet` a rank's data goes over the Ultra Ethernet transport instead
(agents/collectives/uet.py): its host's one UET NIC on UDP UET_PORT (4793), the port
every UET user of a host shares, so a host may hold one UET rank or UET agent at most
(`uet_host_ports`: the config refuses two entries that bind it on one host). The set-up port is
numbered as for RoCE; the rank's UDP RoCE port is then unused.

A shared module, not a kind (its name has the shared `rdma` prefix): any RDMA kind may
import it, and the kinds that number their ranks here declare `port_owner = PORT_OWNER`,
which tells the registry that they share GROUP_PORTS without colliding.

Ports of the n-th rank on a host, over every entry of every such kind in config order:
TCP SETUP_PORT + n for its peers' set-up, UDP ROCE_PORT + n for RDMA, and UDP
INA_WORKER_PORT + n for an in-network all-reduce's aggregation socket (used by the
collective kind only). UDP 11000..11499, inside GROUP_PORTS, are the collective kind's
switch aggregators (on switches, numbered by that kind).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from testbed.fields import DurationNs, SizeBytes
from testbed.workloads.base import CheckContext, ExpandContext, Problem, TrafficEntry
from testbed.workloads.rdma import (
    CC_PRESET_DESCRIPTION,
    DEFAULT_CC_PRESETS,
    MAX_ROCE_WINDOW_PACKETS,
    ROCE_CONNECT_TIMEOUT_S,
    ROCE_SPIN_NS,
    CcPresetName,
    parse_cc_preset,
    preset_problem,
    roce_window_packets,
)

PORT_OWNER = "rdma_group"
SETUP_PORT, ROCE_PORT = 12000, 10000          # TCP set-up, UDP RoCE of a host's first rank
INA_WORKER_PORT = 11500                       # UDP of a host's first rank's aggregation socket
MAX_RANKS_PER_HOST = 500
GROUP_PORTS = {"tcp": range(SETUP_PORT, SETUP_PORT + MAX_RANKS_PER_HOST),
               "udp": range(ROCE_PORT, INA_WORKER_PORT + MAX_RANKS_PER_HOST)}


def rank_ports(ctx: ExpandContext, hosts: Sequence[str]) -> list[tuple[int, int, int]]:
    """(TCP set-up, UDP RoCE, UDP aggregation) ports of a new communicator's ranks, one
    per host of `hosts`, after every rank already numbered on those hosts in this
    expansion (by any kind that numbers its ranks here)."""
    per_host = ctx.state(PORT_OWNER)          # host -> ranks on it so far
    ports = []
    for host in hosts:
        n = per_host.get(host, 0)
        if n >= MAX_RANKS_PER_HOST:
            raise ValueError(f"more than {MAX_RANKS_PER_HOST} communicator ranks on {host}")
        per_host[host] = n + 1
        ports.append((SETUP_PORT + n, ROCE_PORT + n, INA_WORKER_PORT + n))
    return ports


def peers_arg(ctx: ExpandContext, hosts: Sequence[str],
              ports: Sequence[tuple[int, int, int]], transport: str = "roce") -> str:
    """--peers of a communicator's ranks: IP:TCPPORT:UDPPORT per rank, rank order; the
    UDP port is the RoCE one, or with `transport` uet the UET NIC's (UET_PORT)."""
    return ",".join(f"{ctx.address(h)}:{tcp}:{UET_PORT if transport == 'uet' else udp}"
                    for h, (tcp, udp, _ina) in zip(hosts, ports, strict=True))


#: UDP port of a host's UET NIC (agents.wire.uet.UET_UDP_PORT): one per host, shared by
#: every UET user on it.
UET_PORT = 4793
#: Payload bytes of a UET packet beyond which it would not fit the interface MTU: IPv4 20 +
#: UDP 8 + PDS (RUD_CC_REQ) 16 + SES standard 44.
UET_HEADER_BYTES = 20 + 8 + 16 + 44


def uet_host_ports(t: GroupTransportEntry) -> dict[str, list[tuple[str, int, str]]]:
    """With transport: uet, each rank's host runs a UET NIC on UDP 4793 (the config
    check refuses a second entry that binds it on the same host)."""
    if t.transport != "uet":
        return {}
    return {h: [("udp", UET_PORT, f"the UET NIC of rank {i}")] for i, h in enumerate(t.ranks)}


ROCE_CCS = ("dcqcn", "dctcp", "none")
UET_CCS = ("nscc", "credit", "none")
UET_ENTROPIES = 16                  # source ports a UET NIC sprays over by default


class GroupTransportEntry(TrafficEntry):
    """The transport fields of a communicator's entry, as the collective kind has them:
    ranks, data type, chunking, class, start and data seed; the transport (RoCE or UET)
    and its congestion control; RoCE's queue pairs, preset and window; UET's entropy. The
    fields are the flows kind's where both have them (transport, cc, entropy, entropies)."""

    ranks: list[str] = Field(description="the hosts of the communicator; rank i runs on "
                                         "ranks[i], one rank per host")
    dtype: Literal["float32", "float16", "bfloat16", "int32"] = Field(
        "float32", description="element type of the buffers")
    chunk_bytes: SizeBytes = Field(1 << 20, alias="chunk", description="pipelining unit: "
                                   "a step's data is sent in pieces of at most this many "
                                   "bytes, spread over the queue pairs (RoCE), one UET SEND "
                                   "each (UET)")
    qps: int = Field(2, ge=1, le=8, description="queue pairs per pair of ranks (transport: "
                                                "roce)")
    tclass: str | int = Field("roce", description="traffic class of the data and ACKs; with "
                                                  "cc dcqcn, dctcp or nscc, a class that "
                                                  "marks ECN; transport: uet needs it named "
                                                  "(a lossy class)")
    start_ns: DurationNs = Field(0, alias="start", description="when the ranks start, fabric "
                                 "time after the run's common start t0")
    cc: Literal["dcqcn", "dctcp", "none", "nscc", "credit"] = Field(
        "dcqcn", description="congestion control of every rank: roce: dcqcn, dctcp or none "
        "(its QPs); uet: nscc (sender window on ECN and delay), credit (receiver-paced "
        "credit) or none (its NIC); default dcqcn, nscc with transport: uet")
    cc_preset: CcPresetName | None = Field(None, description=CC_PRESET_DESCRIPTION)
    window_packets: int | Literal["auto"] = Field(
        "auto", alias="window", description="most unacknowledged packets per QP, or auto "
                                            "(as RoCE entries: docs/roce.md; transport: roce)")
    seed: int = Field(1, ge=0, description="seed of the ranks' input data")
    transport: Literal["roce", "uet"] = Field(
        "roce", description="roce: RDMA WRITEs with immediate over RC queue pairs (qps, "
                            "cc_preset, window apply); uet: UET SENDs over each host's Ultra "
                            "Ethernet NIC (UDP 4793, one per host; entropy, entropies apply)")
    entropy: Literal["spray", "oblivious", "reps"] | None = Field(
        None, description="uet: how each packet's UDP source port is picked: spray (round "
        "robin over the entropies, the default), oblivious (one per PDC, like RoCE), reps "
        "(keep the ports whose ACKs came back unmarked)")
    entropies: int | None = Field(None, ge=1, le=4096, description="uet: UDP source ports "
                                  "a rank's NIC sprays over (default 16)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _uet_cc(cls, data: object) -> object:
        # The default cc follows the transport: DCQCN for RoCE, NSCC for UET.
        if isinstance(data, dict) and data.get("transport") == "uet" and "cc" not in data:
            return {**data, "cc": "nscc"}
        return data

    @field_validator("cc_preset", mode="before")
    @classmethod
    def _cc_preset(cls, value: object) -> object:
        return parse_cc_preset(value)

    @field_validator("window_packets")
    @classmethod
    def _window(cls, value: object) -> object:
        if value != "auto" and not (isinstance(value, int) and
                                    1 <= value <= MAX_ROCE_WINDOW_PACKETS):
            raise ValueError(f"expected 1..2^22 packets or auto, got {value!r}")
        return value

    @property
    def preset(self) -> str | None:
        return self.cc_preset or DEFAULT_CC_PRESETS.get(self.cc)


#: The fields that set up RoCE queue pairs, by config name (what transport: uet refuses).
ROCE_ONLY_FIELDS = {"qps": "qps", "cc_preset": "cc_preset", "window_packets": "window"}


def transport_problems(t: GroupTransportEntry, loc: tuple,
                       ctx: CheckContext) -> Iterator[Problem]:
    """RoCE: a cc of UET's, entropy fields, a preset that does not go with `cc`,
    congestion control on a class that never marks ECN (so it never gets a CNP). UET: a
    cc of RoCE's, RoCE's queue-pair fields, an unnamed class, NSCC on a class that never
    marks ECN."""
    tclass = ctx.classes.get(t.tclass)
    if t.transport == "uet":
        if t.cc not in UET_CCS:
            yield loc + ("cc",), (f"cc {t.cc} is RoCE's; with transport: uet use "
                                  f"{', '.join(UET_CCS)}")
        for name, alias in ROCE_ONLY_FIELDS.items():
            if name in t.model_fields_set:
                yield (loc + (alias,), f"{alias} sets up RoCE queue pairs; transport: uet "
                       "has none, drop it")
        if "tclass" not in t.model_fields_set:
            yield loc + ("tclass",), ("transport: uet needs its traffic class named: a lossy "
                                      "class (with trim: true to trim instead of drop), not "
                                      "the lossless roce class PFC protects")
        elif t.cc == "nscc" and tclass is not None and not tclass.ecn:
            yield (loc + ("tclass",), f"class {tclass.name!r} (TC{tclass.tc}) does not mark "
                   "ECN, so NSCC sees congestion only as delay and loss; use a class with "
                   "ecn: true, or cc: credit or cc: none")
        return
    if t.cc not in ROCE_CCS:
        yield loc + ("cc",), (f"cc {t.cc} is Ultra Ethernet's; with transport: roce use "
                              f"{', '.join(ROCE_CCS)}, or set transport: uet")
        return
    for name in ("entropy", "entropies"):
        if getattr(t, name) is not None:
            yield loc + (name,), (f"{name} is for transport: uet (RoCE picks one UDP "
                                  "source port per QP); drop it or set transport: uet")
    bad_preset = preset_problem(t.cc, t.cc_preset)
    if bad_preset is not None:
        yield loc + (bad_preset[0],), bad_preset[1]
    if t.cc != "none" and tclass is not None and not tclass.ecn:
        yield (loc + ("tclass",), f"class {tclass.name!r} (TC{tclass.tc}) does not mark "
               f"ECN, so {t.cc.upper()} never gets a CNP; use an ECN class or cc: none")


def transport_argv(t: GroupTransportEntry, ctx: ExpandContext, host: str) -> list[str]:
    """The transport's flags of one rank on `host`: RoCE's (chunking, QPs, seed, MTU,
    DSCPs, congestion control, line rate, window, dilation and the agents' set-up
    settings) or UET's (uet_argv)."""
    if t.transport == "uet":
        return uet_argv(t, ctx, host)
    mtu = ctx.roce_mtu_bytes
    line = ctx.line_rate_bps(host)
    window = (roce_window_packets(line, ctx.round_trip_ns(ctx.tc(t.tclass)), mtu)
              if t.window_packets == "auto" else int(t.window_packets))
    return ["--chunk-bytes", str(t.chunk_bytes), "--qps", str(t.qps), "--seed", str(t.seed),
            "--mtu", str(mtu), "--dscp", str(ctx.dscp(t.tclass)), "--cc", t.cc,
            *(["--cc-preset", t.preset] if t.preset else []),
            *(["--cnp-dscp", str(ctx.cnp_dscp)] if ctx.cnp_dscp is not None else []),
            "--line-rate-bps", str(line), "--window-packets", str(window),
            "--dilation", str(ctx.dilation),
            "--connect-timeout-s", str(ROCE_CONNECT_TIMEOUT_S),
            "--spin-ns", str(ROCE_SPIN_NS)]


def uet_payload_bytes(ctx: ExpandContext) -> int:
    """UET payload per packet: the RoCE MTU's (so both transports cut data alike), or
    less if the interface MTU cannot carry it with UET's headers."""
    return min(ctx.roce_mtu_bytes, ctx.mtu_bytes - UET_HEADER_BYTES)


def uet_argv(t: GroupTransportEntry, ctx: ExpandContext, host: str) -> list[str]:
    """The UET transport's flags of one rank on `host`: chunking, seed, DSCP and ECN of
    the class, congestion control, entropy, payload, line rate, the longest empty-queue
    round trip to another rank (NSCC's base), the DSCP a trimming switch gives the class's
    packets (if one trims it), dilation, the set-up timeout and no
    busy-polling (as RoCE ranks)."""
    base_rtt = max((ctx.base_rtt_ns(host, h) for h in t.ranks if h != host), default=0)
    trim_dscp = ctx.trim_dscp(ctx.tc(t.tclass))
    return ["--transport", "uet", "--chunk-bytes", str(t.chunk_bytes), "--seed", str(t.seed),
            "--dscp", str(ctx.dscp(t.tclass)), "--uet-cc", t.cc,
            "--uet-entropy", t.entropy or "spray",
            "--uet-entropies", str(t.entropies or UET_ENTROPIES),
            "--uet-payload-bytes", str(uet_payload_bytes(ctx)),
            "--line-rate-bps", str(ctx.line_rate_bps(host)),
            *(["--uet-base-rtt-ns", str(base_rtt)] if base_rtt > 0 else []),
            *(["--uet-trim-dscp", str(trim_dscp)] if trim_dscp is not None else []),
            "--dilation", str(ctx.dilation),
            "--connect-timeout-s", str(ROCE_CONNECT_TIMEOUT_S),
            "--spin-ns", str(ROCE_SPIN_NS)]       # many ranks on few cores: never spin
