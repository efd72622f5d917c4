"""What `dilation: auto` weighs: the packets a workload puts through the fabric, against
what this machine carries. Pure: the capacity comes in as a value (testbed/run/
calibration.py reads it from the calibration file), the plan records the result.

The model, in CPU time (core-seconds per wall second):

- every stream of the workload (testbed/workloads: each kind's `offered_load`) offers a
  fabric rate from its source to its destination, in packets of its wire size;
- its path is the plan's routed path (testbed/plan/paths.routed_path: at each switch the
  first equal-cost next hop; ECMP paths are shortest paths, so they all have its length);
  each egress port on it (the host NIC's and every switch's) is one hop: one pass through
  veth + HTB + the port program, costing `1 / hop_pps_per_core` core-seconds;
- streams share ports max-min fairly at the ports' fabric rates (water-filling). A
  lossless class's stream moves at its fair rate on every hop and at its agents (PFC,
  and blocking sends on a paused host NIC, hold its sender back); a lossy stream is
  counted at its offered rate on every hop and at its sender (it is dropped somewhere on
  the way: counting every hop over-estimates, on the safe side) and at its fair rate at
  its receiver;
- RoCE's ACKs travel back on the same number of hops, one per `ack_every` data packets;
- each agent kind costs `send` core-seconds per packet it sends and `recv` per packet it
  receives (the PFC agent is woken by pause events, not packets: its per-packet work is
  the port program's, inside the hop cost).

need(D) = (hop_pps x hop cost + sum of agent pps x agent cost) / D, fabric pps at D = 1.
D is the smallest 1-2-5 factor with need(D) <= cores x MARGIN x derating, and with the
busiest port's packet rate within one core's hops (a port's queue is served on one CPU)
at the same margin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from testbed.workloads.base import StreamLoad

#: Share of the measured capacity a plan may use: the rest is left to the control plane
#: (sampler, watchdog, agents' control sockets) and to bursts the averages do not show.
MARGIN = 0.5
#: Bounds of the learned derating (testbed/run/calibration.py): at most 8x below what
#: was measured, never above it.
MIN_DERATING = 0.125
MAX_DERATING = 1.0
#: A run whose port fell behind halves the derating; this many clean runs in a row
#: raise it by RECOVERY_STEP (slowly: one bad run costs what 3 x 3 clean ones give back).
FELL_BEHIND_FACTOR = 0.5
CLEAN_RUNS_TO_RECOVER = 3
RECOVERY_STEP = 1.25
#: The agent kind a stream's agents are costed as when the calibration has no figure
#: for theirs: the Python RoCE transport, the most expensive measured.
FALLBACK_AGENT = "roce"

#: Kinds the cost table names (the `agent` of a StreamLoad).
AGENT_KINDS = ("udp", "roce")


@dataclass(frozen=True)
class AgentCost:
    """Core-seconds one agent kind spends per packet it sends and per packet it receives."""

    send_core_s: float
    recv_core_s: float


@dataclass(frozen=True)
class Capacity:
    """What this machine carries: kernel hops per second per core, the cores, what each
    agent kind costs per packet, the learned derating and where the figures came from."""

    hop_pps_per_core: float
    cores: int
    agents: Mapping[str, AgentCost]
    source: str
    derating: float = 1.0
    derating_note: str = ""

    @property
    def hop_core_s(self) -> float:
        return 1.0 / self.hop_pps_per_core

    @property
    def usable_cores(self) -> float:
        return self.cores * MARGIN * self.derating

    def agent(self, kind: str) -> AgentCost:
        return self.agents.get(kind) or self.agents[FALLBACK_AGENT]


# With no calibration: one core, and per-packet figures at about half of what this
# project's 2-core development machine measured (docs/dilation.md): a small VM is safe.
DEFAULT_CAPACITY = Capacity(
    hop_pps_per_core=150_000.0, cores=1,
    agents={"udp": AgentCost(send_core_s=8e-6, recv_core_s=8e-6),
            "roce": AgentCost(send_core_s=16e-6, recv_core_s=16e-6)},
    source="default (run `testbed calibrate` to measure)")


#: A path's egress ports, in order: (port key, fabric rate bit/s) per hop.
Path = Sequence[tuple[str, int]]


@dataclass(frozen=True)
class Need:
    """Fabric packet rates (at D = 1) the workload puts through the machine."""

    hop_pps: float                        # packets x hops per second, both directions
    agent_send_pps: Mapping[str, float]   # by agent kind
    agent_recv_pps: Mapping[str, float]
    busiest_port_pps: float
    busiest_port: str
    streams: int
    longest_path_hops: int
    fair_bps: Sequence[float] = field(default=())   # per stream, for tests and the plan

    def core_s_per_s(self, capacity: Capacity) -> float:
        """Core-seconds per wall second the workload needs at D = 1."""
        agents = sum(pps * capacity.agent(k).send_core_s
                     for k, pps in self.agent_send_pps.items())
        agents += sum(pps * capacity.agent(k).recv_core_s
                      for k, pps in self.agent_recv_pps.items())
        return self.hop_pps * capacity.hop_core_s + agents


def fair_rates_bps(demands_bps: Sequence[float], paths: Sequence[Path]) -> list[float]:
    """Max-min fair rates (water-filling): each stream gets at most its demand, each port
    at most its rate, and no stream can gain without taking from one that has less."""
    rate = [0.0] * len(demands_bps)
    active = {i for i, d in enumerate(demands_bps) if d > 0 and paths[i]}
    left: dict[str, float] = {}
    users: dict[str, set[int]] = {}
    for i, path in enumerate(paths):
        for port, port_bps in path:
            left[port] = float(port_bps)
            users.setdefault(port, set()).add(i)
    while active:
        # The smallest equal increment that fills a port or meets a demand.
        step = min(demands_bps[i] - rate[i] for i in active)
        for port, who in users.items():
            n = len(who & active)
            if n:
                step = min(step, left[port] / n)
        done: set[int] = set()
        for i in active:
            rate[i] += step
            if rate[i] >= demands_bps[i] * (1 - 1e-12):
                done.add(i)
        for port, who in users.items():
            n = len(who & active)
            if n:
                left[port] -= step * n
                if left[port] <= left[port] * 1e-12 + 1e-6:
                    done |= who & active
        active -= done
    return rate


def workload_need(loads: Sequence[StreamLoad], path_of: Callable[[str, str], Path]) -> Need:
    """The packet rates `loads` put through the fabric, at D = 1 (see the module's doc)."""
    paths = [list(path_of(s.src, s.dst)) for s in loads]
    fair = fair_rates_bps([s.rate_bps for s in loads], paths)
    hop_pps = 0.0
    send: dict[str, float] = {}
    recv: dict[str, float] = {}
    port_pps: dict[str, float] = {}
    for s, path, fair_bps in zip(loads, paths, fair, strict=True):
        moved_bps = fair_bps if s.lossless else s.rate_bps
        pps = moved_bps / (8 * s.wire_bytes)
        delivered_pps = fair_bps / (8 * s.wire_bytes)
        hop_pps += pps * len(path) * (1 + s.reverse_per_packet)
        for port, _ in path:
            port_pps[port] = port_pps.get(port, 0.0) + pps
        send[s.agent] = send.get(s.agent, 0.0) + pps
        recv[s.agent] = recv.get(s.agent, 0.0) + delivered_pps
        if s.reverse_per_packet:
            # ACKs: the responder sends them, the requester receives them.
            acks = delivered_pps * s.reverse_per_packet
            send[s.agent] += acks
            recv[s.agent] += acks
    busiest = max(port_pps.items(), key=lambda kv: (kv[1], kv[0]), default=("", 0.0))
    return Need(hop_pps=hop_pps, agent_send_pps=send, agent_recv_pps=recv,
                busiest_port_pps=busiest[1], busiest_port=busiest[0], streams=len(loads),
                longest_path_hops=max((len(p) for p in paths), default=0), fair_bps=fair)


#: No port's wall rate above this: a PFC class's pause gate is a TBF, whose rate
#: pyroute2 passes as 32 bits of bytes per second (34 Gb/s), and a veth
#: carries little more anyway.
MAX_WALL_PORT_BPS = 25_000_000_000


@dataclass(frozen=True)
class Choice:
    """The D the capacity rule gives, and its parts."""

    factor: int
    need_factor: int          # from the whole machine's CPU
    port_factor: int          # from the busiest port's packets on one core
    rate_factor: int = 1      # from the fastest port's rate within MAX_WALL_PORT_BPS
    least: float = 1.0        # the smallest D (not rounded to 1-2-5) that fits all three

    def fits(self, factor: int) -> bool:
        """Whether D = `factor` (any integer, not only 1-2-5) fits the capacity."""
        return factor >= self.least * (1 - 1e-9)


def choose_factor(need: Need, capacity: Capacity, nice: Callable[[float], int],
                  fastest_port_bps: int = 0) -> Choice:
    """The smallest readable D (`nice`: 1-2-5 steps) at which `need` fits `capacity` and
    the fastest port's wall rate stays within MAX_WALL_PORT_BPS."""
    raw_need = need.core_s_per_s(capacity) / capacity.usable_cores
    raw_port = need.busiest_port_pps / (capacity.hop_pps_per_core * MARGIN * capacity.derating)
    raw_rate = fastest_port_bps / MAX_WALL_PORT_BPS
    by_need, by_port, by_rate = nice(raw_need), nice(raw_port), nice(raw_rate)
    return Choice(max(by_need, by_port, by_rate, 1), by_need, by_port, by_rate,
                  max(raw_need, raw_port, raw_rate, 1.0))


@dataclass(frozen=True)
class Derating:
    """The learned correction of this machine's capacity: a scale in
    [MIN_DERATING, MAX_DERATING] and the clean runs since it last changed."""

    scale: float = 1.0
    clean_runs: int = 0
    runs: int = 0
    fell_behind_runs: int = 0


def learn(state: Derating, *, fell_behind: bool) -> Derating:
    """The derating after one run whose D the capacity rule said would fit: a run that
    fell behind halves it (bounded below); CLEAN_RUNS_TO_RECOVER clean runs in a row
    raise it by RECOVERY_STEP (bounded above by what was measured)."""
    if fell_behind:
        return Derating(max(MIN_DERATING, state.scale * FELL_BEHIND_FACTOR), 0,
                        state.runs + 1, state.fell_behind_runs + 1)
    clean = state.clean_runs + 1
    scale = state.scale
    if clean >= CLEAN_RUNS_TO_RECOVER and scale < MAX_DERATING:
        scale = min(MAX_DERATING, scale * RECOVERY_STEP)
        clean = 0
    return Derating(scale, clean, state.runs + 1, state.fell_behind_runs)
