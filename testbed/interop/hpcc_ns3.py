"""HPCC's ns-3 experiment (config.txt + topology + flow file) -> one fabric config.

HPCC (alibaba-edu/High-Precision-Congestion-Control) runs `scratch/third CONFIG.txt`:
a config of `KEY value` lines naming a topology file and a flow file. This module
reads them the way simulation/scratch/third.cc does and translates what our fabric
can express: the explicit topology (rates, delays, per-link error rates), the flows
(one `kind: flows` entry), the ECN maps (one port class per link rate), the shared
switch buffer with dynamic PFC thresholds, the DCQCN / DCTCP parameters and the
packet size. Everything else is listed, key by key, with what was done instead, in
`Translation.notes`, which `to_yaml()` writes as the output's header comment.

Facts taken from HPCC's sources (third.cc, switch-mmu.cc, rdma-hw.cc, run.py):
- third.cc reads whitespace-separated tokens; a file is read up to the counts its
  first line gives and the rest is ignored (the shipped flow.txt says it has 2 flows
  and carries more lines). Relative file names are opened from the working directory.
- topology: `node_num switch_num link_num`, the switch ids, then per link
  `src dst rate delay error_rate` (ns-3 DataRate and Time strings; a bare time is
  seconds). An error rate of 0 means ERROR_RATE_PER_LINK; both ends of a link get the
  error model, so the loss is per packet in both directions.
- flows: the count, then `src dst pg dport size start_time` (size in bytes, start in
  seconds); the source port is 10000 + a per-pair counter.
- KMIN_MAP / KMAX_MAP / PMAX_MAP: `n rate1 v1 ... rate_n v_n`, rate in bit/s, K in KB
  of 1000 bytes (SwitchMmu::ConfigEcn multiplies by 1000); each switch port takes the
  entry of its own rate, and a rate without an entry aborts the simulation.
- BUFFER_SIZE is MiB per switch (ConfigBufferSize(buffer_size * 1024 * 1024)); the
  MMU's thresholds are always dynamic, (free shared buffer) >> pfc_a_shift, with the
  shift 3 (alpha 1/8) lowered by one for each doubling of a port's rate above the NIC
  rate. USE_DYNAMIC_PFC_THRESHOLD only sets QbbNetDevice::DynamicThreshold, which no
  code reads.
- ALPHA_RESUME_INTERVAL, RATE_DECREASE_INTERVAL and RP_TIMER are microseconds.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml

from testbed.phy import DEFAULT_ASSUMPTIONS, PORT_TYPES, PortType

CC_MODES: dict[int, str] = {1: "DCQCN (Mellanox's model)", 3: "HPCC", 7: "TIMELY",
                            8: "DCTCP", 10: "HPCC-PINT"}
SUPPORTED_CC: dict[int, str] = {1: "dcqcn", 8: "dctcp"}
ROCE_MTUS = (256, 512, 1024, 2048, 4096)
ROCE_TC_PG = 3           # HPCC's data priority group; our default `roce` class is tc 3
DATA_CLASS = "roce"
ENTRY_NAME = "hpcc"

# Every key third.cc reads, and how many value tokens it takes (None: a map, `n` then
# n pairs). A key not here is skipped by third.cc too.
KEYS: dict[str, int | None] = {
    **dict.fromkeys((
        "ENABLE_QCN", "USE_DYNAMIC_PFC_THRESHOLD", "CLAMP_TARGET_RATE", "PAUSE_TIME",
        "DATA_RATE", "LINK_DELAY", "PACKET_PAYLOAD_SIZE", "L2_CHUNK_SIZE", "L2_ACK_INTERVAL",
        "L2_BACK_TO_ZERO", "TOPOLOGY_FILE", "FLOW_FILE", "TRACE_FILE", "TRACE_OUTPUT_FILE",
        "SIMULATOR_STOP_TIME", "ALPHA_RESUME_INTERVAL", "RP_TIMER", "EWMA_GAIN",
        "FAST_RECOVERY_TIMES", "RATE_AI", "RATE_HAI", "ERROR_RATE_PER_LINK", "CC_MODE",
        "RATE_DECREASE_INTERVAL", "MIN_RATE", "FCT_OUTPUT_FILE", "HAS_WIN", "GLOBAL_T",
        "MI_THRESH", "VAR_WIN", "FAST_REACT", "U_TARGET", "INT_MULTI", "RATE_BOUND",
        "ACK_HIGH_PRIO", "DCTCP_RATE_AI", "PFC_OUTPUT_FILE", "ENABLE_TRACE", "BUFFER_SIZE",
        "QLEN_MON_FILE", "QLEN_MON_START", "QLEN_MON_END", "MULTI_RATE", "SAMPLE_FEEDBACK",
        "PINT_LOG_BASE", "PINT_PROB"), 1),
    "LINK_DOWN": 3,
    "KMAX_MAP": None, "KMIN_MAP": None, "PMAX_MAP": None,
}

# Keys with no counterpart, and what stands in for them (the value is appended).
_NOT_MAPPED: dict[str, str] = {
    "TRACE_OUTPUT_FILE": "not written: the run directory's counters.sqlite holds every "
                         "port's time series",
    "FCT_OUTPUT_FILE": "the run writes results/fct.txt in HPCC's format instead",
    "PFC_OUTPUT_FILE": "not written: pause frames are counted per port in counters.sqlite",
    "QLEN_MON_FILE": "not written: queue lengths are sampled per port in counters.sqlite",
    "QLEN_MON_START": "not mapped (queue sampling covers the whole run)",
    "QLEN_MON_END": "not mapped (queue sampling covers the whole run)",
    "ENABLE_TRACE": "not mapped: there is no packet trace; counters are always recorded",
    "PAUSE_TIME": "not mapped: our PFC agents pause with XOFF/XON frames, not timed pauses",
    "DATA_RATE": "ignored, as third.cc ignores it (each link's rate is in the topology)",
    "LINK_DELAY": "ignored, as third.cc ignores it (each link's delay is in the topology)",
    "L2_CHUNK_SIZE": "not mapped: our RC transport retransmits go-back-N from the NAKed "
                     "packet, not from a chunk boundary",
    "L2_BACK_TO_ZERO": "not mapped: our transport is go-back-N from the lost packet",
    "L2_ACK_INTERVAL": "not mapped: our responder ACKs once per 16 packets and at each "
                       "message's end (docs/roce.md), and sends CNPs of its own, one per CE "
                       "packet with the hpcc-ns3 preset (cnp_interval 0), as HPCC's "
                       "CNP-flagged ACKs do with an interval of 1",
    "GLOBAL_T": "not mapped: our window is per QP (window: auto), not HPCC's max-BDP T",
    "VAR_WIN": "not mapped: our window is fixed per QP (window: auto)",
    "FAST_REACT": "HPCC/TIMELY-only (per-ACK reaction): not used by DCQCN/DCTCP",
    "U_TARGET": "HPCC-only (eta): not used by DCQCN/DCTCP",
    "MI_THRESH": "HPCC-only (maxStage): not used by DCQCN/DCTCP",
    "INT_MULTI": "HPCC-only (INT units): no INT header here",
    "MULTI_RATE": "HPCC-only: not used by DCQCN/DCTCP",
    "SAMPLE_FEEDBACK": "HPCC-only: not used by DCQCN/DCTCP",
    "PINT_LOG_BASE": "HPCC-PINT-only: not used by DCQCN/DCTCP",
    "PINT_PROB": "HPCC-PINT-only: not used by DCQCN/DCTCP",
    "RATE_BOUND": "not mapped: our senders always pace at the congestion-control rate",
    "ACK_HIGH_PRIO": "not mapped: ACKs travel in the data's class (tc 3), as HPCC with "
                     "ACK_HIGH_PRIO 0; with 1 HPCC puts them in queue 0, ahead of data",
}


class HpccImportError(ValueError):
    """Input we cannot translate; the message names the file, the key and the value."""


@dataclass
class _Config:
    path: str
    values: dict[str, list[str]] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    unknown: list[tuple[int, str]] = field(default_factory=list)

    def has(self, key: str) -> bool:
        return key in self.values

    def one(self, key: str) -> str:
        return self.values[key][0]

    def where(self, key: str) -> str:
        return f"{self.path}:{self.lines[key]}: {key} {' '.join(self.values[key])}"


@dataclass(frozen=True)
class _Link:
    src: int
    dst: int
    rate_bps: int
    delay_ns: int
    error_rate: float


@dataclass(frozen=True)
class _Flow:
    src: int
    dst: int
    pg: int
    dport: int
    size_bytes: int
    start_ns: int


@dataclass
class Translation:
    """The fabric config (a dict for the normal loader) and the notes for its header."""

    config: dict[str, Any]
    notes: list[str]

    def to_yaml(self) -> str:
        """Deterministic YAML: the header comment, then the config in insertion order."""
        header = []
        for note in self.notes:
            if not note:
                header.append("#")
                continue
            indent = len(note) - len(note.lstrip(" "))
            for i, line in enumerate(textwrap.wrap(note.strip(), 96 - indent,
                                                   break_on_hyphens=False)):
                pad = " " * (indent + (2 if i and note.lstrip().startswith("-") else 0))
                header.append(f"# {pad}{line}".rstrip())
        body = yaml.safe_dump(self.config, sort_keys=False, default_flow_style=None,
                              width=120, allow_unicode=False)
        return "\n".join(header) + "\n" + body


# ---------------------------------------------------------------- reading HPCC's files

def _tokens(text: str) -> list[str]:
    """The whitespace-separated tokens, after any leading `#` lines (our fixtures name
    their source there; HPCC's own files have none)."""
    lines = text.splitlines()
    while lines and lines[0].lstrip().startswith("#"):
        lines.pop(0)
    return "\n".join(lines).split()


def parse_config(text: str, path: str) -> _Config:
    """`KEY value...` lines as third.cc reads them (one key per line in every HPCC file)."""
    conf = _Config(path)
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split()
        if not words or words[0].startswith("#"):
            continue
        key, rest = words[0], words[1:]
        if key not in KEYS:
            conf.unknown.append((number, raw.strip()))
            continue
        arity = KEYS[key]
        if arity is None:
            try:
                n = int(rest[0])
            except (IndexError, ValueError):
                raise HpccImportError(f"{path}:{number}: {key}: expected `n rate1 value1 ... "
                                      f"rate_n value_n`, got {' '.join(rest)!r}") from None
            arity = 1 + 2 * n
        if len(rest) < arity:
            raise HpccImportError(f"{path}:{number}: {key}: expected {arity} value(s), "
                                  f"got {len(rest)}")
        conf.values[key] = rest[:arity]
        conf.lines[key] = number
    return conf


_NS3_RATE = re.compile(r"^([0-9.eE+-]+)\s*([A-Za-z/]*)$")
_RATE_BITS = {"bps": 1, "b/s": 1, "kbps": 10**3, "kb/s": 10**3, "mbps": 10**6, "mb/s": 10**6,
              "gbps": 10**9, "gb/s": 10**9, "tbps": 10**12, "tb/s": 10**12,
              "kibps": 2**10, "mibps": 2**20, "gibps": 2**30}


def ns3_rate_bps(text: str, where: str) -> int:
    """An ns-3 DataRate string ('100Gbps', '50Mb/s', '10GBps' in bytes) in bit/s."""
    m = _NS3_RATE.match(text)
    if not m:
        raise HpccImportError(f"{where}: {text!r} is not an ns-3 data rate (e.g. 100Gbps)")
    unit = m.group(2)
    bits_per_unit = 1
    if "B" in unit:                   # ns-3: upper-case B is bytes
        bits_per_unit, unit = 8, unit.replace("B", "b")
    mult = _RATE_BITS.get(unit.lower())
    if mult is None:
        raise HpccImportError(f"{where}: unknown rate unit in {text!r} (e.g. 100Gbps, 50Mb/s)")
    try:
        return int(Decimal(m.group(1)) * mult * bits_per_unit)
    except InvalidOperation:
        raise HpccImportError(f"{where}: {text!r} is not an ns-3 data rate") from None


_TIME_NS = {"s": Decimal(10**9), "ms": Decimal(10**6), "us": Decimal(10**3), "ns": Decimal(1),
            "ps": Decimal("0.001"), "min": Decimal(60 * 10**9), "h": Decimal(3600 * 10**9)}


def ns3_time_ns(text: str, where: str) -> int:
    """An ns-3 Time string ('0.001ms', '1000ns'; a bare number is seconds) in ns."""
    m = re.match(r"^([0-9.eE+-]+)([a-z]*)$", text)
    unit = m.group(2) if m else ""
    if not m or (unit and unit not in _TIME_NS):
        raise HpccImportError(f"{where}: {text!r} is not an ns-3 time (e.g. 1000ns, 0.001ms)")
    try:
        return int((Decimal(m.group(1)) * _TIME_NS[unit or "s"]).to_integral_value())
    except InvalidOperation:
        raise HpccImportError(f"{where}: {text!r} is not an ns-3 time") from None


def _int(token: str, where: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise HpccImportError(f"{where}: expected an integer, got {token!r}") from None


def _float(token: str, where: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise HpccImportError(f"{where}: expected a number, got {token!r}") from None


class _Reader:
    """Tokens of one file, consumed in order, with a position for error messages."""

    def __init__(self, text: str, path: str) -> None:
        self.tokens = _tokens(text)
        self.path = path
        self.i = 0

    def take(self, what: str) -> str:
        if self.i >= len(self.tokens):
            raise HpccImportError(f"{self.path}: ends before {what} (token {self.i + 1})")
        self.i += 1
        return self.tokens[self.i - 1]

    def where(self, what: str) -> str:
        return f"{self.path}: {what}"

    @property
    def left(self) -> int:
        return len(self.tokens) - self.i


def parse_topology(text: str, path: str) -> tuple[int, set[int], list[_Link], int]:
    """(node count, switch ids, links, tokens left unread) as third.cc reads them."""
    r = _Reader(text, path)
    node_num = _int(r.take("node_num"), r.where("node_num"))
    switch_num = _int(r.take("switch_num"), r.where("switch_num"))
    link_num = _int(r.take("link_num"), r.where("link_num"))
    switches: set[int] = set()
    for k in range(switch_num):
        sid = _int(r.take(f"switch id {k + 1}"), r.where(f"switch id {k + 1}"))
        if not 0 <= sid < node_num:
            raise HpccImportError(f"{path}: switch id {sid} is not below node_num {node_num}")
        switches.add(sid)
    links = []
    for k in range(link_num):
        what = f"link {k + 1} of {link_num}"
        src = _int(r.take(what), r.where(what))
        dst = _int(r.take(what), r.where(what))
        rate = ns3_rate_bps(r.take(what), r.where(what))
        delay = ns3_time_ns(r.take(what), r.where(what))
        err = _float(r.take(what), r.where(what))
        for node in (src, dst):
            if not 0 <= node < node_num:
                raise HpccImportError(f"{path}: {what}: node {node} is not below node_num "
                                      f"{node_num}")
        if src == dst:
            raise HpccImportError(f"{path}: {what}: links node {src} to itself")
        links.append(_Link(src, dst, rate, delay, err))
    return node_num, switches, links, r.left


def parse_flows(text: str, path: str) -> tuple[list[_Flow], int]:
    """(flows, tokens left unread): the count, then `src dst pg dport size start_s`."""
    r = _Reader(text, path)
    count = _int(r.take("the flow count"), r.where("flow count"))
    flows = []
    for k in range(count):
        what = f"flow {k + 1} of {count}"
        src, dst, pg, dport, size = (_int(r.take(what), r.where(what)) for _ in range(5))
        start = ns3_time_ns(r.take(what), r.where(what))     # seconds, as Seconds(double)
        flows.append(_Flow(src, dst, pg, dport, size, start))
    return flows, r.left


# ---------------------------------------------------------------- formatting our units

def fmt_rate(bps: int) -> str:
    for unit, mult in (("Tbps", 10**12), ("Gbps", 10**9), ("Mbps", 10**6), ("kbps", 10**3)):
        if bps % mult == 0:
            return f"{bps // mult}{unit}"
    return f"{bps}bps"


def fmt_duration(ns: int) -> str:
    for unit, mult in (("ms", 10**6), ("us", 10**3)):
        if ns and ns % mult == 0:
            return f"{ns // mult}{unit}"
    return f"{ns}ns"


def fmt_size(nbytes: int) -> str:
    """Bytes as HPCC's maps count them: KB of 1000 bytes."""
    if nbytes and nbytes % 1000 == 0:
        return f"{nbytes // 1000}KB"
    return f"{nbytes}B"


def _us_duration(value: str, where: str) -> str:
    """HPCC's microsecond doubles (RP_TIMER 900, ALPHA_RESUME_INTERVAL 1) as a duration."""
    try:
        ns = int((Decimal(value) * 1000).to_integral_value())
    except InvalidOperation:
        raise HpccImportError(f"{where}: expected a number of microseconds") from None
    return fmt_duration(ns)


def _class_name(rate_bps: int) -> str:
    if rate_bps % 10**9 == 0:
        return f"r{rate_bps // 10**9}g"
    return f"r{rate_bps // 10**6}m"


# ---------------------------------------------------------------- links: rate + delay -> PHY

def _port_for(rate_bps: int, delay_ns: int) -> tuple[PortType, float, bool]:
    """The first catalogue port of this MAC rate whose reach covers the length that gives
    `delay_ns` (propagation at the PHY model's ns/m + the port's FEC delay), the length,
    and whether the delay was met (False: the longest-reach port at its reach)."""
    ports = [p for p in PORT_TYPES.values() if p.mac_rate_gbps * 10**9 == rate_bps]
    if not ports:
        rates = sorted({p.mac_rate_gbps for p in PORT_TYPES.values()})
        raise ValueError(f"no port type runs at {fmt_rate(rate_bps)} (the PHY catalogue has "
                         f"{', '.join(f'{r}Gbps' for r in rates)})")
    for p in ports:
        per_m = (DEFAULT_ASSUMPTIONS.twinax_ns_per_m if p.is_copper
                 else DEFAULT_ASSUMPTIONS.fiber_ns_per_m)
        length = max(0.0, (delay_ns - p.fec_delay_ns) / per_m)
        # round down to the centimetre: the delay stays at or below HPCC's
        length = math.floor(length * 100) / 100
        if length <= p.max_reach_m:
            return p, length, delay_ns >= p.fec_delay_ns
    longest = max(ports, key=lambda p: p.max_reach_m)
    return longest, longest.max_reach_m, False


def _length(length_m: float) -> str:
    text = f"{length_m:.2f}".rstrip("0").rstrip(".")
    return f"{text}m"


# ---------------------------------------------------------------- the translation

def _resolve(conf: _Config, key: str, cwd: Path) -> Path:
    if not conf.has(key):
        raise HpccImportError(f"{conf.path}: no {key}: HPCC needs it and so does the import")
    name = conf.one(key)
    path = Path(name)
    if not path.is_absolute():
        path = cwd / path
    if not path.is_file():
        raise HpccImportError(
            f"{conf.where(key)}: no such file {str(path)!r}; HPCC opens {key} relative to "
            "the working directory, not the config's: run the import from the directory "
            "HPCC's run.py runs in (simulation/, where mix/ is)")
    return path


def _cc_of(conf: _Config, override: str | None) -> tuple[str, list[str]]:
    mode = _int(conf.one("CC_MODE"), conf.where("CC_MODE")) if conf.has("CC_MODE") else 1
    meaning = CC_MODES.get(mode, "not a mode third.cc knows")
    supported = ", ".join(f"{k} ({CC_MODES[k]})" for k in SUPPORTED_CC)
    if override:
        note = (f"CC_MODE {mode} ({meaning}) replaced by cc: {override}, as asked "
                f"(--cc {override}); the file's {override.upper()} keys are used")
        return override, [note]
    if mode not in SUPPORTED_CC:
        where = conf.where("CC_MODE") if conf.has("CC_MODE") else f"{conf.path}: CC_MODE"
        raise HpccImportError(
            f"{where}: CC_MODE {mode} is {meaning} in HPCC's ns-3, which this testbed does "
            f"not run; supported: {supported}. Pass --cc dcqcn or --cc dctcp to run that "
            "instead with the file's other settings")
    cc = SUPPORTED_CC[mode]
    return cc, [f"CC_MODE {mode} ({meaning}) -> cc: {cc}"]


def _ecn_classes(conf: _Config, rates: list[int], nic_rate_bps: int,
                 mapped: list[str], unmapped: list[str]) -> dict[str, Any]:
    maps: dict[str, dict[int, str]] = {}
    for key in ("KMIN_MAP", "KMAX_MAP", "PMAX_MAP"):
        if not conf.has(key):
            raise HpccImportError(f"{conf.path}: no {key}: third.cc aborts without an entry "
                                  "for every link rate ('must set kmin for each link speed')")
        vals = conf.values[key][1:]
        maps[key] = {_int(vals[i], conf.where(key)): vals[i + 1]
                     for i in range(0, len(vals), 2)}
    qos: dict[str, Any] = {}
    for rate in rates:
        missing = [k for k in maps if rate not in maps[k]]
        if missing:
            raise HpccImportError(
                f"{conf.where(missing[0])}: no entry for {rate} bit/s, a link rate of the "
                "topology (third.cc aborts: 'must set kmin for each link speed')")
        kmin = _int(maps["KMIN_MAP"][rate], conf.where("KMIN_MAP")) * 1000
        kmax = _int(maps["KMAX_MAP"][rate], conf.where("KMAX_MAP")) * 1000
        pmax = _float(maps["PMAX_MAP"][rate], conf.where("PMAX_MAP"))
        if kmin >= kmax:
            # HPCC marks every packet above kmax; with kmin = kmax that is a step at K
            ecn: dict[str, Any] = {"k": fmt_size(kmax)}
            shape = f"step at {fmt_size(kmax)}"
        else:
            ecn = {"kmin": fmt_size(kmin), "kmax": fmt_size(kmax), "pmax": pmax}
            shape = f"{fmt_size(kmin)} / {fmt_size(kmax)} / {pmax:g}"
        shift, r = 3, rate
        while r > nic_rate_bps and shift > 0:     # third.cc's pfc_a_shift per port rate
            shift, r = shift - 1, r // 2
        name = _class_name(rate)
        qos[name] = {"ecn": ecn, "pfc": {"mode": "dynamic", "alpha": 1 / (1 << shift)}}
        mapped.append(f"KMIN_MAP/KMAX_MAP/PMAX_MAP at {fmt_rate(rate)} -> qos.{name}.ecn "
                      f"({shape}); PFC alpha 1/{1 << shift} (third.cc's pfc_a_shift {shift} at "
                      f"this rate with a {fmt_rate(nic_rate_bps)} NIC) -> qos.{name}.pfc.alpha")
    for key, entries in maps.items():
        extra = sorted(r for r in entries if r not in rates)
        if extra:
            unmapped.append(f"{key} entries at {', '.join(fmt_rate(r) for r in extra)}: no link "
                            "of the topology runs at that rate (unused by HPCC too)")
    return qos


@dataclass
class _Notes:
    """What the header lists: each mapped key with its field, each other with what was done."""

    mapped: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)


def _dcqcn_params(conf: _Config, notes: _Notes) -> dict[str, Any]:
    params: dict[str, Any] = {}

    def put(key: str, ours: str, value: Any) -> None:
        params[ours] = value
        notes.mapped.append(f"{key} {' '.join(conf.values[key])} -> cc_params.{ours}: {value}")

    for key, ours in (("ALPHA_RESUME_INTERVAL", "alpha_timer"), ("RP_TIMER", "increase_timer"),
                      ("RATE_DECREASE_INTERVAL", "rate_decrease_interval")):
        if conf.has(key):
            put(key, ours, _us_duration(conf.one(key), conf.where(key)))
    if conf.has("EWMA_GAIN"):
        put("EWMA_GAIN", "g", _float(conf.one("EWMA_GAIN"), conf.where("EWMA_GAIN")))
    if conf.has("FAST_RECOVERY_TIMES"):
        steps = _int(conf.one("FAST_RECOVERY_TIMES"), conf.where("FAST_RECOVERY_TIMES"))
        if steps >= 1:
            put("FAST_RECOVERY_TIMES", "fast_recovery_steps", steps)
        else:
            notes.unmapped.append(f"FAST_RECOVERY_TIMES {steps}: ours needs at least 1; the "
                                  "preset's value is used")
    for key, ours in (("RATE_AI", "rai"), ("RATE_HAI", "rhai"), ("MIN_RATE", "min_rate")):
        if conf.has(key):
            put(key, ours, fmt_rate(ns3_rate_bps(conf.one(key), conf.where(key))))
    if conf.has("CLAMP_TARGET_RATE"):
        clamp = _int(conf.one("CLAMP_TARGET_RATE"), conf.where("CLAMP_TARGET_RATE"))
        put("CLAMP_TARGET_RATE", "target_clamp", "always" if clamp else "after_increase")
    if conf.has("DCTCP_RATE_AI"):
        notes.unmapped.append(f"DCTCP_RATE_AI {conf.one('DCTCP_RATE_AI')}: DCTCP-only, not used "
                              "by DCQCN")
    return params


_DCQCN_ONLY = ("ALPHA_RESUME_INTERVAL", "RP_TIMER", "RATE_DECREASE_INTERVAL",
               "FAST_RECOVERY_TIMES", "RATE_AI", "RATE_HAI", "CLAMP_TARGET_RATE")


def _dctcp_params(conf: _Config, roce_mtu: int, notes: _Notes) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if conf.has("EWMA_GAIN"):
        params["g"] = _float(conf.one("EWMA_GAIN"), conf.where("EWMA_GAIN"))
    for key, ours in (("DCTCP_RATE_AI", "rai"), ("MIN_RATE", "min_rate")):
        if conf.has(key):
            params[ours] = fmt_rate(ns3_rate_bps(conf.one(key), conf.where(key)))
    for key, ours in (("EWMA_GAIN", "g"), ("DCTCP_RATE_AI", "rai"), ("MIN_RATE", "min_rate")):
        if conf.has(key):
            notes.mapped.append(f"{key} {conf.one(key)} -> cc_params.{ours}: {params[ours]}")
    params["mss"] = f"{roce_mtu}B"
    notes.mapped.append(f"cc_params.mss: {roce_mtu}B, our packet payload (roce_mtu), as HPCC's "
                        "DCTCP counts packets of PACKET_PAYLOAD_SIZE")
    for key in _DCQCN_ONLY:
        if conf.has(key):
            notes.unmapped.append(f"{key} {' '.join(conf.values[key])}: DCQCN-only, not used by "
                                  "DCTCP")
    return params


@dataclass(frozen=True)
class _Topology:
    node_num: int
    switches: set[int]
    links: list[_Link]
    left: int                   # tokens after the last link

    def name(self, node: int) -> str:
        return f"s{node}" if node in self.switches else f"h{node}"

    @property
    def linked(self) -> list[int]:
        return sorted({n for link in self.links for n in (link.src, link.dst)})

    @property
    def hosts(self) -> list[int]:
        return [n for n in self.linked if n not in self.switches]


def _links(conf: _Config, topo: _Topology, topo_name: str,
           notes: _Notes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """links[] (PHY port of the link's rate, HPCC's delay as a fibre length) and
    impairments[] (the error rates)."""
    default_err = (_float(conf.one("ERROR_RATE_PER_LINK"), conf.where("ERROR_RATE_PER_LINK"))
                   if conf.has("ERROR_RATE_PER_LINK") else 0.0)
    out, impairments = [], []
    used: dict[tuple[int, int], tuple[str, str]] = {}
    short: dict[tuple[int, int], tuple[str, float]] = {}
    for k, link in enumerate(topo.links):
        try:
            port, length_m, met = _port_for(link.rate_bps, link.delay_ns)
        except ValueError as exc:
            raise HpccImportError(f"{topo_name}: link {k + 1} ({link.src} {link.dst}): "
                                  f"{exc}") from None
        a, b = topo.name(link.src), topo.name(link.dst)
        out.append({"a": a, "b": b, "port": port.name, "length": _length(length_m),
                    "qos": _class_name(link.rate_bps)})
        used[(link.rate_bps, link.delay_ns)] = (port.name, _length(length_m))
        if not met:
            per_m = (DEFAULT_ASSUMPTIONS.twinax_ns_per_m if port.is_copper
                     else DEFAULT_ASSUMPTIONS.fiber_ns_per_m)
            short[(link.rate_bps, link.delay_ns)] = (port.name,
                                                    port.fec_delay_ns + length_m * per_m)
        loss = link.error_rate if link.error_rate > 0 else default_err
        if loss > 0:
            impairments.append({"link": [a, b], "direction": "both", "loss": loss})
    for (rate, delay), (port_name, length) in sorted(used.items()):
        notes.mapped.append(f"links at {fmt_rate(rate)} with delay {delay} ns -> port "
                            f"{port_name}, length {length} (the PHY model's delay: FEC/DSP + "
                            f"{DEFAULT_ASSUMPTIONS.fiber_ns_per_m} ns/m of fibre)")
    for (rate, delay), (port_name, got) in sorted(short.items()):
        notes.unmapped.append(f"delay {delay} ns at {fmt_rate(rate)}: no {fmt_rate(rate)} port "
                              f"type gives it within its reach; {port_name} gives {got:.0f} ns")
    if conf.has("ERROR_RATE_PER_LINK"):
        notes.mapped.append(
            f"ERROR_RATE_PER_LINK {conf.one('ERROR_RATE_PER_LINK')} and the topology's error "
            "rates -> impairments[] loss, both directions (third.cc puts the error model on "
            "both ends; a link's own rate wins when above 0)"
            + ("" if impairments else "; all 0 here, so none"))
    if topo.left:
        notes.unmapped.append(f"{topo_name}: {topo.left} token(s) after the last link, ignored "
                              "(as third.cc ignores them)")
    return out, impairments


def _roce_mtu(conf: _Config, notes: _Notes) -> int:
    payload = (_int(conf.one("PACKET_PAYLOAD_SIZE"), conf.where("PACKET_PAYLOAD_SIZE"))
               if conf.has("PACKET_PAYLOAD_SIZE") else 1000)
    fitting = [m for m in ROCE_MTUS if m <= payload]
    roce_mtu = fitting[-1] if fitting else ROCE_MTUS[0]
    notes.mapped.append(f"PACKET_PAYLOAD_SIZE {payload} -> roce_mtu: {roce_mtu} (our RoCE MTUs "
                        f"are {', '.join(map(str, ROCE_MTUS))}; the largest not above {payload}"
                        + ("" if fitting else "; none is, so the smallest") + ")")
    return roce_mtu


def _buffer(conf: _Config, notes: _Notes) -> dict[str, Any]:
    mib = (_int(conf.one("BUFFER_SIZE"), conf.where("BUFFER_SIZE"))
           if conf.has("BUFFER_SIZE") else 16)
    notes.mapped.append(f"BUFFER_SIZE {mib} -> switch_buffer.size: {mib}MiB (MiB per switch in "
                        "third.cc); reserve 4KiB and resume_offset 3KiB are SwitchMmu's")
    if conf.has("USE_DYNAMIC_PFC_THRESHOLD"):
        v = conf.one("USE_DYNAMIC_PFC_THRESHOLD")
        notes.mapped.append(f"USE_DYNAMIC_PFC_THRESHOLD {v} -> pfc.mode: dynamic"
                            + (" (HPCC's SwitchMmu is dynamic whatever the key says: it only "
                               "sets QbbNetDevice::DynamicThreshold, which nothing reads)"
                               if v == "0" else ""))
    return {"size": f"{mib}MiB"}


def _cc_entry(conf: _Config, cc: str, roce_mtu: int, notes: _Notes) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": ENTRY_NAME, "kind": "flows", "tclass": DATA_CLASS}
    enable_qcn = (not conf.has("ENABLE_QCN")
                  or _int(conf.one("ENABLE_QCN"), conf.where("ENABLE_QCN")) != 0)
    if not enable_qcn:
        entry["cc"] = "none"
        notes.mapped.append("ENABLE_QCN 0 -> cc: none (HPCC's switches mark nothing, so its "
                            "senders never slow down)")
        return entry
    entry["cc"] = cc
    entry["cc_preset"] = "hpcc-ns3"
    params = (_dcqcn_params(conf, notes) if cc == "dcqcn"
              else _dctcp_params(conf, roce_mtu, notes))
    if params:
        entry["cc_params"] = params
    mode = {"dcqcn": 1, "dctcp": 8}[cc]
    notes.mapped.append(f"cc_preset: hpcc-ns3 (run.py's --cc {cc}, CC_MODE {mode}) for every "
                        "parameter the file leaves out"
                        + (" and the DCQCN behaviour switches of rdma-hw.cc (alpha = 1 on the "
                           "first CNP, alpha every period, no byte counter)"
                           if cc == "dcqcn" else ""))
    if conf.has("ENABLE_QCN"):
        notes.mapped.append("ENABLE_QCN 1 -> the roce class marks ECN (ecn: true)")
    if conf.has("HAS_WIN"):
        cap = ("caps each QP at the largest BDP in flight" if conf.one("HAS_WIN") != "0"
               else "has no window")
        notes.unmapped.append(f"HAS_WIN {conf.one('HAS_WIN')}: HPCC {cap}; ours keeps window: "
                              "auto (enough for the longest round trip with the class's queues "
                              "full)")
    return entry


def _check_flow(k: int, f: _Flow, hosts: set[int], flow_name: str) -> None:
    if f.src not in hosts or f.dst not in hosts:
        node = f.src if f.src not in hosts else f.dst
        raise HpccImportError(f"{flow_name}: flow {k + 1}: node {node} is not a linked host "
                              "(third.cc asserts that both ends are hosts)")
    if f.src == f.dst:
        raise HpccImportError(f"{flow_name}: flow {k + 1}: source and destination are both "
                              f"{f.src}")
    if f.pg != ROCE_TC_PG:
        raise HpccImportError(f"{flow_name}: flow {k + 1}: priority group {f.pg}; only "
                              f"{ROCE_TC_PG} is mapped (our lossless ECN class roce, tc 3)")
    if f.size_bytes < 1:
        raise HpccImportError(f"{flow_name}: flow {k + 1}: size {f.size_bytes} bytes")


def _flows(conf: _Config, flows: list[_Flow], left: int, topo: _Topology, flow_name: str,
           entry: dict[str, Any], notes: _Notes) -> int:
    """Fill the entry's flows and time_offset; returns t0, HPCC's earliest start (ns)."""
    stop_ns = (ns3_time_ns(conf.one("SIMULATOR_STOP_TIME"), conf.where("SIMULATOR_STOP_TIME"))
               if conf.has("SIMULATOR_STOP_TIME") else 3_010_000_000)   # third.cc's default
    kept = [f for f in flows if f.start_ns < stop_ns]
    hosts = set(topo.hosts)
    for k, f in enumerate(kept):
        _check_flow(k, f, hosts, flow_name)
    if not kept:
        raise HpccImportError(f"{flow_name}: no flow starts before SIMULATOR_STOP_TIME "
                              f"({stop_ns} ns): nothing to run")
    t0 = min(f.start_ns for f in kept)
    entry["flows"] = [{"src": topo.name(f.src), "dst": topo.name(f.dst), "size": f.size_bytes,
                       "start": fmt_duration(f.start_ns - t0)} for f in kept]
    entry["time_offset"] = f"{t0}ns"
    notes.mapped.append(f"{flow_name}: {len(kept)} flow(s) -> workload.traffic[0].flows (start "
                        f"relative to the earliest, time_offset {t0} ns: fct.txt keeps HPCC's "
                        "absolute start times)")
    if left:
        notes.unmapped.append(f"{flow_name}: {left} token(s) after flow {len(flows)}, ignored "
                              "(third.cc reads only the count its first line gives)")
    if conf.has("SIMULATOR_STOP_TIME"):
        dropped = len(flows) - len(kept)
        notes.unmapped.append(
            f"SIMULATOR_STOP_TIME {conf.one('SIMULATOR_STOP_TIME')}: no stop time; the run "
            "waits for every flow" + (f"; {dropped} flow(s) starting at or after it dropped, as "
                                      "HPCC never starts them" if dropped else ""))
    dports = sorted({f.dport for f in kept})
    if len(dports) == 1:
        # HPCC's analysis/fct_analysis.py picks flows by fct.txt's dport (100, 200)
        entry["fct_dport"] = dports[0]
        notes.mapped.append(f"flow dport {dports[0]} -> workload.traffic[0].fct_dport: fct.txt "
                            "shows it, so HPCC's analysis script selects these flows as it "
                            "does ns-3's (the agents' own UDP ports carry the packets)")
    else:
        notes.unmapped.append(f"flow dports {', '.join(map(str, dports))}: not mapped; one "
                              "entry has one fct_dport, so fct.txt carries the agents' own "
                              "port for these flows")
    notes.unmapped.append("flow sport: our agents pick it (each flow a QP of its own with its "
                          "own UDP source port; HPCC's sport is 10000 + a per-pair count)")
    return t0


def _link_down(conf: _Config, topo: _Topology, t0: int, notes: _Notes) -> list[dict[str, Any]]:
    if not conf.has("LINK_DOWN"):
        return []
    words = " ".join(conf.values["LINK_DOWN"])
    at_us, a, b = (_int(v, conf.where("LINK_DOWN")) for v in conf.values["LINK_DOWN"])
    if at_us <= 0:
        notes.mapped.append(f"LINK_DOWN {words}: no link down")
        return []
    down_ns = 2_000_000_000 + at_us * 1000            # third.cc: Seconds(2) + MicroSeconds(a)
    pairs = {(x.src, x.dst) for x in topo.links} | {(x.dst, x.src) for x in topo.links}
    if (a, b) not in pairs:
        raise HpccImportError(f"{conf.where('LINK_DOWN')}: nodes {a} and {b} share no link")
    if down_ns < t0:
        notes.unmapped.append(f"LINK_DOWN {words}: at {down_ns} ns, before the first flow; "
                              "not mapped")
        return []
    notes.mapped.append(f"LINK_DOWN {words} -> events[0] link_down at 2 s + {at_us} us, routes "
                        "reconverge at once (converge 0), as third.cc recomputes them")
    return [{"at": fmt_duration(down_ns - t0), "kind": "link_down",
             "link": [topo.name(a), topo.name(b)]}]


def _leftovers(conf: _Config, cwd: Path, notes: _Notes) -> None:
    if conf.has("TRACE_FILE"):
        trace = Path(conf.one("TRACE_FILE"))
        trace = trace if trace.is_absolute() else cwd / trace
        state = "read" if trace.is_file() else f"not found at {str(trace)!r} (not needed)"
        notes.unmapped.append(f"TRACE_FILE {conf.one('TRACE_FILE')} ({state}): no packet trace; "
                              "every node's counters are recorded")
    for key in KEYS:
        if conf.has(key) and key in _NOT_MAPPED:
            notes.unmapped.append(f"{key} {' '.join(conf.values[key])}: {_NOT_MAPPED[key]}")
    for number, line in conf.unknown:
        notes.unmapped.append(f"{conf.path}:{number}: {line!r}: not a key third.cc reads; "
                              "skipped there too")


def translate(config_path: str | Path, *, cwd: str | Path | None = None,
              cc_override: str | None = None, lab: str = "hpcc") -> Translation:
    """Read HPCC's CONFIG.txt (and the files it names, relative to `cwd`, default the
    process's working directory, as third.cc opens them) and translate it."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    config_path = Path(config_path)
    shown = str(config_path)
    full = config_path if config_path.is_absolute() else cwd / config_path
    try:
        text = full.read_text(encoding="utf-8")
    except OSError as exc:
        raise HpccImportError(f"{shown}: cannot read: {exc.strerror}") from None
    conf = parse_config(text, shown)
    cc, cc_notes = _cc_of(conf, cc_override)
    notes = _Notes(mapped=list(cc_notes))

    topo_path, flow_path = _resolve(conf, "TOPOLOGY_FILE", cwd), _resolve(conf, "FLOW_FILE", cwd)
    topo_name, flow_name = conf.one("TOPOLOGY_FILE"), conf.one("FLOW_FILE")
    topo = _Topology(*parse_topology(topo_path.read_text(encoding="utf-8"), topo_name))
    flows, flow_left = parse_flows(flow_path.read_text(encoding="utf-8"), flow_name)

    notes.mapped.append(f"TOPOLOGY_FILE {topo_name} -> nodes[] and links[] (one port class "
                        "per link rate)")
    notes.mapped.append(f"FLOW_FILE {flow_name} -> workload.traffic[0] (kind: flows)")
    linked = topo.linked
    unlinked = [n for n in range(topo.node_num) if n not in set(linked)]
    if unlinked:
        notes.unmapped.append(f"nodes without a link ({', '.join(map(topo.name, unlinked[:10]))}"
                              f"{', ...' if len(unlinked) > 10 else ''}): left out")
    if not topo.hosts:
        raise HpccImportError(f"{topo_name}: no host has a link")
    # third.cc's nic_rate: the rate of the first host's first device (its first link)
    first = topo.hosts[0]
    nic_rate = next(x.rate_bps for x in topo.links if first in (x.src, x.dst))
    rates = sorted({x.rate_bps for x in topo.links})
    qos = _ecn_classes(conf, rates, nic_rate, notes.mapped, notes.unmapped)
    links, impairments = _links(conf, topo, topo_name, notes)
    roce_mtu = _roce_mtu(conf, notes)
    switch_buffer = _buffer(conf, notes)
    entry = _cc_entry(conf, cc, roce_mtu, notes)
    t0 = _flows(conf, flows, flow_left, topo, flow_name, entry, notes)
    events = _link_down(conf, topo, t0, notes)
    _leftovers(conf, cwd, notes)

    config: dict[str, Any] = {
        "name": lab, "roce_mtu": roce_mtu, "qos": qos, "switch_buffer": switch_buffer,
        "nodes": [{"name": topo.name(n), "role": "switch" if n in topo.switches else "host"}
                  for n in linked],
        "links": links}
    if impairments:
        config["impairments"] = impairments
    config["workload"] = {"traffic": [entry]}
    if events:
        config["events"] = events
    header = _header(shown, topo_name, flow_name, notes, len(topo.hosts),
                     len(linked) - len(topo.hosts))
    return Translation(config, header)


def _header(config: str, topo: str, flows: str, notes: _Notes, hosts: int,
            switches: int) -> list[str]:
    lines = [
        f"Generated by `testbed import hpcc-ns3 {config}` from HPCC's ns-3 experiment "
        "(alibaba-edu/High-Precision-Congestion-Control, simulation/scratch/third.cc).",
        f"Read: {config}, {topo} (TOPOLOGY_FILE), {flows} (FLOW_FILE), relative to the working "
        "directory as third.cc opens them.",
        f"Names: HPCC node i is h<i> if a host, s<i> if a switch ({hosts} host(s), "
        f"{switches} switch(es)).",
        "",
        "Mapped:",
        *(f"  - {m}" for m in notes.mapped),
        "",
        "Not mapped (and what was done instead):",
        *(f"  - {u}" for u in notes.unmapped),
        "",
        "Fabric-wide differences:",
        "  - link delay: the plan carries each link's delay (PHY model), but a kernel or "
        "datapath without netem runs the links with no added delay; the run's fidelity "
        "notes say so, and base RTTs (ideal FCT) use the planned delays",
        "  - buffer: the lossless class draws from the shared switch_buffer (HPCC's "
        "SwitchMmu); our lossy classes keep per-port buffers, HPCC has none; PFC headroom is "
        "our formula (docs/config.md), not third.cc's 3 x rate x delay",
        "  - packets: HPCC sends PACKET_PAYLOAD_SIZE bytes per packet; ours carry roce_mtu "
        "bytes, so a flow is more, smaller packets",
        "  - time: HPCC simulates; ours runs at a dilation D (fabric time), and starts, FCTs "
        "and fct.txt are fabric ns",
    ]
    return lines
