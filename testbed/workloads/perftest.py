"""perftest between kernel Soft-RoCE hosts (`python -m agents.perftest`): ib_write_bw,
ib_send_bw, ib_write_lat from the perftest package, over the rxe devices of hosts with
`endpoint: rxe` (testbed/net/rxe.py).

An entry lists pairs [src, dst]; each pair is one perftest test: its server in `dst`
(started first; the run waits until its TCP set-up port listens), its client in `src` at
the common start. Each pair gets its own TCP set-up port, numbered across the whole
workload (on kernels whose rxe is not namespace aware every perftest process runs in the
initial namespace, so ports must differ machine-wide, not only per host). The device is
`rxe_<lab>_<host>`; the agent finds out where it lives and runs perftest there.

Units: perftest measures wall time. `bw_gbps` is the fabric bandwidth, perftest's average
wall bandwidth x D (the fabric runs D times slower); `msg_rate_mpps` likewise x D;
latencies are wall / D. `duration` is fabric time, run as perftest's -D in whole wall
seconds (at least 1). The traffic class defaults to the first lossless class; perftest's
--tclass is that class's DSCP with ECT(0) (rxe copies it into the IP TOS byte), so the
fabric classifies the traffic into the class and may mark it CE. rxe itself has no
congestion control.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from agents.timebase import Dilation
from testbed.fields import NAME_RE, DurationNs, SizeBytes
from testbed.workloads.base import (
    AgentFiles,
    AgentSpec,
    CheckContext,
    ExpandContext,
    Problem,
    ResultRow,
    Results,
    RunView,
    Shape,
    TrafficEntry,
    WorkloadKind,
    arg_of,
    streams,
)

BASE_PORT = 17000                 # TCP set-up port of the workload's first pair
MAX_PAIRS = 500
PORTS = range(BASE_PORT, BASE_PORT + MAX_PAIRS)
ECT0 = 0b10
GID_INDEX = 1                     # the RoCEv2 IPv4 GID (testbed/net/rxe.py: GID_INDEX)
TIMEOUT_MARGIN_S = 30             # wall seconds perftest may take beyond its schedule
ITERATIONS_WALL_S = 60            # the longest an iterations-bounded test may run (wall)
# The QP's transport (ACK) timeout is 4.096 us x 2^exp. perftest's default exponent, 14, is
# 67 ms - in wall time, undilated: at D = 1000 it is 67 us of fabric, shorter than the
# queueing delay of one full class buffer (2 MB at 100 Gb/s is 160 us), so rxe timed out
# and resent whole windows that were only queued (the VM lane measured 15.5 MB on leaf1
# for 7.0 MB written). The exponent is raised by log2(D), so the timeout is 67 ms of fabric.
QP_TIMEOUT_EXP_DEFAULT = 14
QP_TIMEOUT_EXP_MAX = 31           # the 5-bit field's largest value (2.4 hours)
Test = Literal["ib_write_bw", "ib_send_bw", "ib_write_lat"]


def device_name(lab: str, host: str) -> str:
    """The rxe device of an rxe host (the same name testbed/net/rxe.py gives it)."""
    return f"rxe_{lab}_{host}"


class PerftestTraffic(TrafficEntry):
    """perftest tests between hosts with `endpoint: rxe`, one per pair."""

    name: str = Field(pattern=NAME_RE, description="the entry's name: lower-case letters, "
                      "digits and _, unique in the workload; agents and results carry it")
    kind: Literal["perftest"] = Field(description="perftest over kernel Soft-RoCE (rxe) hosts")
    test: Test = Field("ib_write_bw", description="the perftest program: ib_write_bw, "
                       "ib_send_bw or ib_write_lat")
    pairs: list[tuple[str, str]] | None = Field(
        None, description="[src, dst] lists: the client runs on src, the server on dst; both "
                          "hosts have endpoint: rxe")
    size_bytes: SizeBytes = Field(65536, alias="size", description="message size (perftest -s)")
    duration_ns: DurationNs | None = Field(
        None, alias="duration", description="how long the test runs, fabric time (perftest -D "
        "in whole wall seconds, at least 1); give duration or iterations")
    iterations: int | None = Field(None, ge=1, description="messages (perftest -n) instead of "
                                   "a duration")
    qps: int = Field(1, ge=1, le=64, description="queue pairs (perftest -q; bandwidth tests)")
    # None (not the base's "default" class): the first lossless class
    tclass: str | int | None = Field(  # type: ignore[assignment]
        None, description="traffic class name or number (default: the first lossless class); "
        "perftest's --tclass is its DSCP with ECT(0)")
    start_ns: DurationNs = Field(0, alias="start", description="when the clients start, "
                                 "fabric time after the run's common start t0")
    gid_index: int = Field(GID_INDEX, ge=0, description="the GID index (perftest -x; 1: the "
                           "RoCEv2 IPv4 GID of an rxe port)")
    qp_timeout_exp: int | None = Field(
        None, ge=1, le=QP_TIMEOUT_EXP_MAX, description="the QP's ACK timeout exponent "
        "(perftest -u; the timeout is 4.096 us x 2^exp of wall time). Default: 14 (67 ms) "
        "raised by ceil(log2 D), so the timeout is 67 ms of fabric time, as on a NIC")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def dilated_qp_timeout_exp(dilation: float,
                           fabric_exp: int = QP_TIMEOUT_EXP_DEFAULT) -> int:
    """The wall-time QP timeout exponent whose timeout, divided by D, is at least the
    fabric timeout 4.096 us x 2^fabric_exp (at most 31). Pure."""
    return min(QP_TIMEOUT_EXP_MAX, fabric_exp + max(0, math.ceil(math.log2(max(1.0, dilation)))))


def tos_byte(dscp: int) -> int:
    """perftest's --tclass for a class: its DSCP with ECT(0)."""
    return dscp << 2 | ECT0


class PerftestKind(WorkloadKind):
    shapes: ClassVar = {"perftest": Shape.PAIRS}
    model: ClassVar = PerftestTraffic
    agent_module: ClassVar = "agents.perftest"
    doc: ClassVar = ("perftest (ib_write_bw, ib_send_bw, ib_write_lat) between hosts with "
                     "endpoint: rxe, over their kernel Soft-RoCE devices (agents/perftest): one "
                     "server per pair in its dst, one client in its src at the common start. "
                     "Rows are perftest's report, rates in fabric units (wall x D).")
    ports: ClassVar = {"tcp": PORTS}
    example: ClassVar = {"name": "bw", "kind": "perftest", "test": "ib_write_bw",
                         "pairs": [["h1", "h3"]], "size": "64KB", "duration": "2ms"}
    result_fields: ClassVar = {
        "test": "the perftest program (ib_write_bw, ib_send_bw, ib_write_lat)",
        "src": "client host", "dst": "server host",
        "bytes": "message size, bytes",
        "iterations": "messages perftest completed (its #iterations)",
        "qps": "queue pairs",
        "bw_gbps": "average bandwidth, fabric Gb/s: perftest's wall BW average x D (bandwidth "
                   "tests; where perftest reports 0 in duration mode with messages done - always "
                   "for ib_send_bw, and for ib_write_bw on a starved VM - bytes x iterations "
                   "over the duration, x D; empty when such a row has no duration: the "
                   "run's fidelity notes say so)",
        "bw_peak_gbps": "perftest's BW peak x D, fabric Gb/s (bandwidth tests)",
        "msg_rate_mpps": "messages per second, fabric, millions: perftest's MsgRate x D "
                         "(bandwidth tests) or its tps x D / 10^6 (ib_write_lat with duration)",
        "lat_avg_us": "average latency, fabric us: perftest's t_avg / D (latency tests)",
        "lat_min_us": "minimum latency, fabric us (ib_write_lat with iterations)",
        "lat_max_us": "maximum latency, fabric us (ib_write_lat with iterations)",
        "lat_p99_us": "99th percentile latency, fabric us (ib_write_lat with iterations)",
        "tos": "the IP TOS byte perftest was given (--tclass: DSCP << 2 | ECT(0))",
        "device": "the client's rxe device",
        "netns": "where perftest ran: host (its namespace) or initial (testbed/net/rxe.py)",
    }
    console_columns: ClassVar = (("test", "test"), ("src", "src"), ("dst", "dst"),
                                 ("bytes", "bytes"), ("bw (fabric Gb/s)", "bw_gbps"),
                                 ("lat (fabric us)", "lat_avg_us"))

    def check(self, entry: TrafficEntry, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
        assert isinstance(entry, PerftestTraffic)
        if (entry.duration_ns is None) == (entry.iterations is None):
            yield loc, "perftest needs exactly one of duration: and iterations:"
        for j, pair in enumerate(entry.pairs or []):
            for host in pair:
                if host in ctx.hosts and ctx.endpoints.get(host, "transport") != "rxe":
                    yield (loc + ("pairs", j), f"{host!r} has no rxe device; give it "
                           f"endpoint: rxe under hosts: (- {{name: {host}, endpoint: rxe}})")
        tclass = entry.tclass
        if tclass is None and not any(c.lossless for c in ctx.classes.values()):
            yield loc + ("tclass",), "no lossless class to default to; name a class"

    def _tclass(self, entry: PerftestTraffic, ctx: ExpandContext) -> str | int:
        if entry.tclass is not None:
            return entry.tclass
        return next(c.name for c in ctx.classes.values() if c.lossless)

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        assert isinstance(entry, PerftestTraffic)
        state = ctx.state("perftest")
        tos = tos_byte(ctx.dscp(self._tclass(entry, ctx)))
        wall_s = (max(1, math.ceil(Dilation(ctx.dilation).to_wall_s(entry.duration_ns)))
                  if entry.duration_ns else None)
        qp_exp = entry.qp_timeout_exp or dilated_qp_timeout_exp(ctx.dilation)
        timeout_s = (wall_s or ITERATIONS_WALL_S) + TIMEOUT_MARGIN_S
        specs: list[AgentSpec] = []
        for src, dst in streams(entry, Shape.PAIRS, ctx.hosts):
            port = BASE_PORT + state.setdefault("pairs", 0)
            state["pairs"] += 1
            if port not in PORTS:
                raise ValueError(f"traffic entry {index}: perftest pairs take TCP ports "
                                 f"{PORTS.start}..{PORTS.stop - 1}, one each; too many pairs")
            common = ["--test", entry.test, "--size", str(entry.size_bytes), "--qps",
                      str(entry.qps), "--tclass", str(tos), "--gid-index",
                      str(entry.gid_index), "--qp-timeout-exp", str(qp_exp), "--port",
                      str(port), "--timeout-s", str(timeout_s)]
            common += (["--duration-s", str(wall_s)] if wall_s
                       else ["--iterations", str(entry.iterations)])
            name = f"{entry.name}-{src}-{dst}"
            specs.append(AgentSpec(
                name=f"{name}-server", node=dst, role="receiver", traffic=entry.name,
                kind=entry.kind, module=self.agent_module, src=src, dst=dst,
                argv=["server", "--device", device_name(ctx.lab, dst), *common]))
            specs.append(AgentSpec(
                name=name, node=src, role="sender", traffic=entry.name, kind=entry.kind,
                module=self.agent_module, start_ns=entry.start_ns,
                duration_ns=entry.duration_ns or 0, src=src, dst=dst,
                argv=["client", "--device", device_name(ctx.lab, src), "--server",
                      ctx.address(dst), *common]))
        return specs

    def startup_wall_s(self, spec: AgentSpec) -> float:
        return 0.5      # the client's verbs set-up (device open, QP) before the start

    def work_wall_s(self, entry: TrafficEntry) -> float:
        assert isinstance(entry, PerftestTraffic)
        # connection set-up and the report after the duration, or a whole iterations run
        return float(TIMEOUT_MARGIN_S if entry.duration_ns else ITERATIONS_WALL_S)

    def waits_ready(self, spec: AgentSpec) -> bool:
        return spec.role == "receiver"

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        return ["--ready-file", str(files.ready), "--out", str(files.out)]

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        rows = []
        for spec in specs:
            if spec.role != "sender":
                continue
            res = results.get(spec.name) or {}
            rows += [ResultRow(spec.traffic, spec.kind, fields)
                     for fields in perftest_rows(spec, res, view.dilation)]
        return rows

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        # rxe's packets are the kernel's: no agent counts them per stream, so they have no
        # packet account (the rxe hw_counters in the database count them per device).
        return []

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        notes = []
        for spec in specs:
            res = results.get(spec.name)
            if res is None:
                continue
            if res.get("error") or res.get("rc") not in (0, None):
                notes.append(f"perftest {spec.role} {spec.name} on {spec.node} failed (exit "
                             f"{res.get('rc')}): {res.get('error') or 'see its output'}")
            if spec.role == "sender" and not arg_of(spec.argv, "--duration-s"):
                unmeasured = [r for r in res.get("rows") or []
                              if r.get("bw_avg_gbps") == 0 and r.get("iterations")]
                for r in unmeasured:
                    notes.append(f"perftest {spec.name} completed {r['iterations']} messages "
                                 "but reported 0 Gb/s (its cycle clock did not measure them: "
                                 "seen on a starved VM); its row's bandwidth is left empty")
        return notes


def perftest_rows(spec: AgentSpec, res: dict, dilation: Dilation) -> list[dict]:
    """A client's report (agents/perftest) as result rows in fabric units, in
    result_fields' order: perftest measures wall time, so rates are multiplied and times
    divided by D (through the Dilation). Pure."""
    test = arg_of(spec.argv, "--test") or ""
    duration_s = arg_of(spec.argv, "--duration-s")
    out = []
    # a client without a report (it failed: its note says why) still has its row
    empty = {"bytes": int(arg_of(spec.argv, "--size") or 0), "iterations": None}
    for r in res.get("rows") or [empty]:
        bw = r.get("bw_avg_gbps")
        if bw == 0 and r.get("iterations"):
            # messages were done, so 0 is perftest's failed measure, not the rate: over the
            # duration when there is one, else unknown (a note says so), never a made-up 0
            bw = (r["bytes"] * r["iterations"] * 8 / int(duration_s) / 1e9 if duration_s
                  else None)
        rate = r.get("msg_rate_mpps")
        if rate is None and r.get("tps") is not None:
            rate = r["tps"] / 1e6

        def fabric_us(v: float | None) -> float | None:
            return None if v is None else dilation.to_fabric_ns(v * 1e3) / 1e3

        def fabric_rate(v: float | None) -> float | None:   # Gb/s or Mpps alike
            return None if v is None else dilation.to_fabric_bps(v)

        out.append({
            "test": test, "src": spec.src, "dst": spec.dst, "bytes": r["bytes"],
            "iterations": r["iterations"], "qps": int(arg_of(spec.argv, "--qps") or 1),
            "bw_gbps": fabric_rate(bw),
            "bw_peak_gbps": fabric_rate(r.get("bw_peak_gbps")),
            "msg_rate_mpps": fabric_rate(rate),
            "lat_avg_us": fabric_us(r.get("t_avg_us")),
            "lat_min_us": fabric_us(r.get("t_min_us")),
            "lat_max_us": fabric_us(r.get("t_max_us")),
            "lat_p99_us": fabric_us(r.get("t_p99_us")),
            "tos": int(arg_of(spec.argv, "--tclass") or 0),
            "device": arg_of(spec.argv, "--device") or "",
            "netns": res.get("netns", ""),
        })
    return out


KIND = PerftestKind()
