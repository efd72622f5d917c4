"""What the kinds whose agents are the ranks of a communicator over the user-space RoCE
transport share (the collectives, the training step): one numbering of the ranks on each
host, and so of the host ports they listen on; the transport's entry fields and their
checks; the transport part of a rank's argv.

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

from pydantic import ConfigDict, Field, field_validator

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
              ports: Sequence[tuple[int, int, int]]) -> str:
    """--peers of a communicator's ranks: IP:TCPPORT:UDPPORT per rank, rank order."""
    return ",".join(f"{ctx.address(h)}:{tcp}:{udp}"
                    for h, (tcp, udp, _ina) in zip(hosts, ports, strict=True))


class GroupTransportEntry(TrafficEntry):
    """The RoCE transport fields of a communicator's entry, as the collective kind has
    them: ranks, data type, chunking, queue pairs, class, start, congestion control,
    window and data seed."""

    ranks: list[str] = Field(description="the hosts of the communicator; rank i runs on "
                                         "ranks[i], one rank per host")
    dtype: Literal["float32", "float16", "bfloat16", "int32"] = Field(
        "float32", description="element type of the buffers")
    chunk_bytes: SizeBytes = Field(1 << 20, alias="chunk", description="pipelining unit: "
                                   "a step's data is sent in pieces of at most this many "
                                   "bytes, spread over the queue pairs")
    qps: int = Field(2, ge=1, le=8, description="queue pairs per pair of ranks")
    tclass: str | int = Field("roce", description="traffic class of the data and ACKs; with "
                                                  "cc, a class that marks ECN")
    start_ns: DurationNs = Field(0, alias="start", description="when the ranks start, fabric "
                                 "time after the run's common start t0")
    cc: Literal["dcqcn", "dctcp", "none"] = Field(
        "dcqcn", description="congestion control of every rank's QPs")
    cc_preset: CcPresetName | None = Field(None, description=CC_PRESET_DESCRIPTION)
    window_packets: int | Literal["auto"] = Field(
        "auto", alias="window", description="most unacknowledged packets per QP, or auto "
                                            "(as RoCE entries: docs/roce.md)")
    seed: int = Field(1, ge=0, description="seed of the ranks' input data")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

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


def transport_problems(t: GroupTransportEntry, loc: tuple,
                       ctx: CheckContext) -> Iterator[Problem]:
    """A preset that does not go with `cc`; congestion control on a class that never
    marks ECN (so it never gets a CNP)."""
    bad_preset = preset_problem(t.cc, t.cc_preset)
    if bad_preset is not None:
        yield loc + (bad_preset[0],), bad_preset[1]
    tclass = ctx.classes.get(t.tclass)
    if t.cc != "none" and tclass is not None and not tclass.ecn:
        yield (loc + ("tclass",), f"class {tclass.name!r} (TC{tclass.tc}) does not mark "
               f"ECN, so {t.cc.upper()} never gets a CNP; use an ECN class or cc: none")


def transport_argv(t: GroupTransportEntry, ctx: ExpandContext, host: str) -> list[str]:
    """The RoCE transport's flags of one rank on `host`: chunking, QPs, seed, MTU, DSCPs,
    congestion control, line rate, window, dilation and the agents' set-up settings."""
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
