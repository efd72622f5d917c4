"""Congestion control for the user-space RoCE transport, as pure state machines.

- `DcqcnRp`: DCQCN reaction point (sender side, one per QP);
- `DcqcnNp`: DCQCN notification point (receiver side, one per QP): when to send a CNP;
- `DctcpRp`: a rate-based DCTCP with the same transport-facing interface;
- `NoCc`: always line rate, same interface;
- `DcqcnParams` / `PRESETS` / `preset()`: named parameter sets (paper, ns3-rdma, hpcc-ns3,
  hpcc-ns3-paper, hpcc-ns3-config), each naming its source in `source`; their names
  are `DCQCN_PRESET_NAMES`;
- `DctcpParams` / `DCTCP_PRESETS` / `dctcp_preset()`, names in `DCTCP_PRESET_NAMES`;
- `make_cc(kind, preset_name, line_rate_bps, now_ns)`: the factory the transport calls.

Nothing here reads a clock, sleeps or touches a socket. Every time is FABRIC
nanoseconds, passed in by the caller as `now_ns` (normally
`agents.timebase.FabricClock.now_ns()`); every rate is fabric bits per second.
Timers are deadlines compared against the `now_ns` the caller passes: a call
first fires, in time order, every timer due at or before `now_ns`, then handles
its own event. A `now_ns` earlier than one already seen is treated as the latest
time seen (time never runs backwards here).

docs/dcqcn.md describes the algorithms, the sources (DCQCN paper, the ns-3 code
of the DCQCN authors, HPCC's ns-3) and every place they differ; each difference
is a field of `DcqcnParams` / `DctcpParams`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, NamedTuple, Protocol, TypedDict, get_args, runtime_checkable

US = 1_000  # fabric ns per fabric microsecond
MBPS = 1_000_000
GBPS = 1_000_000_000

AlphaUpdate = Literal["on_cnp", "periodic"]
TargetClamp = Literal["always", "after_increase"]
IncreaseRule = Literal["qcn", "mlx"]
NpMode = Literal["interval", "timer"]
Scaling = Literal["absolute", "per_reference"]

PHASE_INIT = "init"  # no rate decrease yet: at line rate, no increase timer
PHASE_FAST = "fast_recovery"
PHASE_ADDITIVE = "additive"
PHASE_HYPER = "hyper"
INCREASE_KINDS = (PHASE_FAST, PHASE_ADDITIVE, PHASE_HYPER)


# --- parameters -------------------------------------------------------------------------


class _Rule(NamedTuple):
    """A check on one parameter field: `ok(value)`, and what the value `must` be if not."""

    ok: Callable[[Any], bool]
    must: str


_POSITIVE = _Rule(lambda v: v > 0, "must be > 0")
_NONNEGATIVE = _Rule(lambda v: v >= 0, "must be >= 0")
_GAIN = _Rule(lambda v: 0 < v <= 1, "must be in (0, 1]")
_FRACTION = _Rule(lambda v: 0 <= v <= 1, "must be in [0, 1]")
_STEPS = _Rule(lambda v: isinstance(v, int) and v >= 1, "must be an integer >= 1")


def _or_none(rule: _Rule) -> _Rule:
    return _Rule(lambda v: v is None or rule.ok(v), f"{rule.must} or None")


def _one_of(choices: object) -> _Rule:
    allowed = get_args(choices)
    return _Rule(lambda v: v in allowed, f"must be one of {list(allowed)}")


def _problems(params: DcqcnParams | DctcpParams, rules: Mapping[str, _Rule]) -> list[str]:
    """What is wrong with `params`, one sentence per field that breaks its rule, in the
    rules' order; then the one rule across fields both kinds share."""
    problems = []
    for name, rule in rules.items():
        value = getattr(params, name)
        if not rule.ok(value):
            problems.append(f"{name} {rule.must}, got {value!r}")
    if params.scaling == "per_reference" and not (params.reference_rate_bps or 0) > 0:
        problems.append("scaling 'per_reference' needs reference_rate_bps > 0")
    return problems


@dataclass(frozen=True)
class DcqcnParams:
    """One DCQCN parameter set. Rates are absolute bits/s for the link they are used on
    (`preset()` scales them); times are fabric ns; sizes are bytes.

    The fields after `pmax` choose between the behaviours of the sources where they
    differ; their defaults are the paper's reading (docs/dcqcn.md, "Where the sources
    differ").
    """

    name: str
    alpha_timer_ns: float  # alpha update / decay period
    increase_timer_ns: float  # rate-increase timer T
    byte_counter_bytes: int | None  # byte counter BC; None = no byte counter
    g: float  # alpha gain
    fast_recovery_steps: int  # F
    rai_bps: float  # additive increase R_AI
    rhai_bps: float  # hyper increase R_HAI
    min_rate_bps: float
    initial_alpha: float = 1.0
    # NP (receiver) side, carried here so one preset describes a whole deployment
    cnp_interval_ns: float = 50 * US
    np_mode: NpMode = "interval"
    # CP (switch) RED marking, for information / for whoever configures the switch
    kmin_bytes: int = 0
    kmax_bytes: int = 0
    pmax: float = 0.0
    # where the sources differ
    alpha_update: AlphaUpdate = "on_cnp"
    cut_with_updated_alpha: bool = False
    rate_decrease_interval_ns: float | None = None
    target_clamp: TargetClamp = "always"
    increase_rule: IncreaseRule = "qcn"
    hyper_scaled: bool = True
    hyper_halves_periods: bool = False
    rt_shrink_quirk: bool = False
    # how preset() adapts the rate/size fields to a link speed
    reference_rate_bps: float | None = None
    scaling: Scaling = "absolute"
    checks: tuple[str, ...] = ()  # fields whose value only a secondary source gives
    source: str = ""  # where the values come from (file, setting)

    def __post_init__(self) -> None:
        problems = _problems(self, _DCQCN_RULES)
        if problems:
            raise ValueError(f"DCQCN parameters {self.name!r}: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return asdict(self)


#: What each DcqcnParams field must be, in the order problems are reported.
_DCQCN_RULES: dict[str, _Rule] = {
    "alpha_timer_ns": _POSITIVE,
    "increase_timer_ns": _POSITIVE,
    "byte_counter_bytes": _or_none(_POSITIVE),
    "g": _GAIN,
    "fast_recovery_steps": _STEPS,
    "rai_bps": _NONNEGATIVE,
    "rhai_bps": _NONNEGATIVE,
    "min_rate_bps": _POSITIVE,
    "initial_alpha": _FRACTION,
    "cnp_interval_ns": _NONNEGATIVE,
    "rate_decrease_interval_ns": _or_none(_POSITIVE),
    "alpha_update": _one_of(AlphaUpdate),
    "target_clamp": _one_of(TargetClamp),
    "increase_rule": _one_of(IncreaseRule),
    "np_mode": _one_of(NpMode),
    "scaling": _one_of(Scaling),
}

#: HPCC's ns-3 DCQCN (rdma-hw.cc, CC_MODE 1, "Mellanox's version of DCQCN"): the knobs its
#: code fixes, whatever the timers. Its run.py and config.txt set the rest.
class _Knobs(TypedDict):
    """DcqcnParams fields a family of presets shares (the keyword arguments it spreads)."""

    byte_counter_bytes: int | None
    g: float
    fast_recovery_steps: int
    initial_alpha: float
    cnp_interval_ns: float
    np_mode: NpMode
    pmax: float
    alpha_update: AlphaUpdate
    cut_with_updated_alpha: bool
    target_clamp: TargetClamp
    increase_rule: IncreaseRule
    hyper_scaled: bool
    hyper_halves_periods: bool
    rt_shrink_quirk: bool
    checks: tuple[str, ...]


_HPCC_MLX = _Knobs(
    byte_counter_bytes=None,  # no byte counter in rdma-hw.cc
    g=1 / 256,  # EWMA_GAIN 0.00390625
    fast_recovery_steps=1,  # FAST_RECOVERY_TIMES 1
    initial_alpha=1.0,  # cnp_received_mlx: alpha = 1 on the first CNP
    cnp_interval_ns=0,  # L2_ACK_INTERVAL 1: every ACK of a CE packet carries the CNP flag
    np_mode="interval",
    pmax=0.2,  # PMAX_MAP 0.2
    alpha_update="periodic",
    cut_with_updated_alpha=False,
    target_clamp="after_increase",  # CLAMP_TARGET_RATE 0
    increase_rule="mlx",
    hyper_scaled=False,
    hyper_halves_periods=False,
    rt_shrink_quirk=False,
    checks=(),
)
_HPCC = "alibaba-edu/High-Precision-Congestion-Control simulation/"

#: The named DCQCN parameter sets, with rates/sizes as the source gives them at its
#: `reference_rate_bps`. Use `preset(name, line_rate_bps)` to get one for a link.
#: docs/dcqcn.md tabulates them with their sources.
PRESETS: dict[str, DcqcnParams] = {
    # DCQCN paper (Zhu et al., SIGCOMM 2015), its 40 Gb/s testbed. No value is checked
    # against the paper's text yet (every field is in `checks`); R_HAI, the minimum rate
    # and the initial alpha were not among the values read from it: R_HAI and the
    # minimum rate are borrowed from the authors' ns-3 code (bobzhuyb/ns3-rdma).
    "paper": DcqcnParams(
        name="paper",
        alpha_timer_ns=55 * US,
        increase_timer_ns=55 * US,
        byte_counter_bytes=10_000_000,
        g=1 / 256,
        fast_recovery_steps=5,
        rai_bps=40 * MBPS,
        rhai_bps=200 * MBPS,
        min_rate_bps=100 * MBPS,
        initial_alpha=1.0,
        cnp_interval_ns=50 * US,
        np_mode="interval",
        kmin_bytes=5_000,
        kmax_bytes=200_000,
        pmax=0.01,
        reference_rate_bps=40 * GBPS,
        scaling="absolute",
        checks=("alpha_timer_ns", "increase_timer_ns", "byte_counter_bytes", "g",
                "fast_recovery_steps", "rai_bps", "rhai_bps", "min_rate_bps", "initial_alpha",
                "kmin_bytes", "kmax_bytes", "pmax"),
        source="DCQCN paper (Zhu et al., SIGCOMM 2015), values not yet checked against "
               "the paper's text; R_HAI and min rate from bobzhuyb/ns3-rdma",
    ),
    # bobzhuyb/ns3-rdma: qbb-net-device.cc + mix/config.txt (40 Gb/s topology).
    "ns3-rdma": DcqcnParams(
        name="ns3-rdma",
        alpha_timer_ns=55 * US,
        increase_timer_ns=60 * US,
        byte_counter_bytes=300_000,
        g=1 / 256,
        fast_recovery_steps=5,
        rai_bps=40 * MBPS,
        rhai_bps=200 * MBPS,
        min_rate_bps=100 * MBPS,
        initial_alpha=0.5,
        cnp_interval_ns=50 * US,
        np_mode="timer",
        kmin_bytes=40_000,
        kmax_bytes=1_000_000,
        pmax=1.0,
        alpha_update="on_cnp",
        cut_with_updated_alpha=True,
        target_clamp="always",
        increase_rule="qcn",
        hyper_scaled=True,
        hyper_halves_periods=True,
        rt_shrink_quirk=True,
        reference_rate_bps=40 * GBPS,
        scaling="absolute",
        checks=("kmin_bytes", "kmax_bytes"),
        source="bobzhuyb/ns3-rdma src/point-to-point/model/qbb-net-device.cc + "
               "windows/ns-3-dev/mix/config.txt (40 Gb/s topology)",
    ),
    # HPCC's run.py `--cc dcqcn`: ALPHA_RESUME_INTERVAL 1, RATE_DECREASE_INTERVAL 4,
    # RP_TIMER 300 (us); RATE_AI 5 x bw/25, RATE_HAI 50 x bw/25 Mb/s (per 25G), MIN_RATE
    # 1000Mb/s (not scaled), KMIN/KMAX 100/400 KB x bw/25.
    "hpcc-ns3": DcqcnParams(
        name="hpcc-ns3",
        alpha_timer_ns=1 * US,
        increase_timer_ns=300 * US,
        rate_decrease_interval_ns=4 * US,
        rai_bps=5 * MBPS,
        rhai_bps=50 * MBPS,
        min_rate_bps=1 * GBPS,
        kmin_bytes=100_000,
        kmax_bytes=400_000,
        reference_rate_bps=25 * GBPS,
        scaling="per_reference",
        source=_HPCC + "run.py --cc dcqcn (CC_MODE 1) + src/point-to-point/model/rdma-hw.cc",
        **_HPCC_MLX,
    ),
    # HPCC's run.py `--cc dcqcn_paper`: the same but ALPHA_RESUME_INTERVAL 50,
    # RATE_DECREASE_INTERVAL 50, RP_TIMER 55 (us). The default DCQCN preset of a workload.
    "hpcc-ns3-paper": DcqcnParams(
        name="hpcc-ns3-paper",
        alpha_timer_ns=50 * US,
        increase_timer_ns=55 * US,
        rate_decrease_interval_ns=50 * US,
        rai_bps=5 * MBPS,
        rhai_bps=50 * MBPS,
        min_rate_bps=1 * GBPS,
        kmin_bytes=100_000,
        kmax_bytes=400_000,
        reference_rate_bps=25 * GBPS,
        scaling="per_reference",
        source=_HPCC + "run.py --cc dcqcn_paper (CC_MODE 1) + "
                       "src/point-to-point/model/rdma-hw.cc",
        **_HPCC_MLX,
    ),
    # HPCC's example simulation/mix/config.txt: its DCQCN keys (the file itself runs
    # CC_MODE 3, HPCC) for its 100 Gb/s topology.txt, as absolute values: RP_TIMER 900,
    # RATE_AI 50Mb/s, RATE_HAI 100Mb/s, MIN_RATE 100Mb/s; KMIN/KMAX at 100G 400/1600 KB.
    "hpcc-ns3-config": DcqcnParams(
        name="hpcc-ns3-config",
        alpha_timer_ns=1 * US,
        increase_timer_ns=900 * US,
        rate_decrease_interval_ns=4 * US,
        rai_bps=50 * MBPS,
        rhai_bps=100 * MBPS,
        min_rate_bps=100 * MBPS,
        kmin_bytes=400_000,
        kmax_bytes=1_600_000,
        reference_rate_bps=100 * GBPS,
        scaling="absolute",
        source=_HPCC + "mix/config.txt (DCQCN keys; the file runs CC_MODE 3) + "
                       "src/point-to-point/model/rdma-hw.cc",
        **_HPCC_MLX,
    ),
}

#: The DCQCN preset names, in table order: what --cc-preset and a workload's cc_preset
#: accept with cc "dcqcn". Derived from PRESETS, so a new preset is named here by itself.
DCQCN_PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
#: The agent's DCQCN preset when none is named (a workload names its own default).
DEFAULT_DCQCN_PRESET = "paper"

_SCALED_RATE_FIELDS = ("rai_bps", "rhai_bps")
_SCALED_SIZE_FIELDS = ("kmin_bytes", "kmax_bytes")


def _unknown(what: str, name: object, known) -> ValueError:
    return ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(known))}")


def preset(name: str, line_rate_bps: float, *, scale: bool | None = None) -> DcqcnParams:
    """The DCQCN preset `name` for a link of `line_rate_bps`.

    A preset whose `scaling` is "per_reference" (hpcc-ns3: "per 25G") has R_AI, R_HAI,
    Kmin and Kmax multiplied by line_rate_bps / reference_rate_bps; an "absolute" one
    (paper, ns3-rdma: values of a 40G testbed) keeps them. `scale=True/False` overrides.
    """
    try:
        p = PRESETS[name]
    except KeyError:
        raise _unknown("DCQCN preset", name, PRESETS) from None
    if not line_rate_bps > 0:
        raise ValueError(f"line_rate_bps must be > 0, got {line_rate_bps!r}")
    do_scale = p.scaling == "per_reference" if scale is None else scale
    if not do_scale or p.reference_rate_bps is None:
        return p
    ref = p.reference_rate_bps
    changes: dict = {f: getattr(p, f) * line_rate_bps / ref for f in _SCALED_RATE_FIELDS}
    changes.update({f: round(getattr(p, f) * line_rate_bps / ref) for f in _SCALED_SIZE_FIELDS})
    return replace(p, **changes)


@dataclass(frozen=True)
class DctcpParams:
    """A rate-based DCTCP: one "window" is `window_ns` of fabric time (an RTT estimate)."""

    name: str
    window_ns: float
    g: float = 1 / 16
    rai_bps: float | None = None  # per window without marks; None = one MSS per window
    mss_bytes: int = 1024
    min_rate_bps: float = 100 * MBPS
    initial_alpha: float = 1.0
    cnp_marked_bytes: int | None = None  # bytes one CNP stands for; None = mss_bytes
    k_bytes: int = 0  # switch step-marking threshold K, for information
    reference_rate_bps: float | None = None
    scaling: Scaling = "absolute"
    checks: tuple[str, ...] = ()
    source: str = ""  # where the values come from (file, setting)

    def __post_init__(self) -> None:
        problems = _problems(self, _DCTCP_RULES)
        if problems:
            raise ValueError(f"DCTCP parameters {self.name!r}: " + "; ".join(problems))

    @property
    def additive_increase_bps(self) -> float:
        if self.rai_bps is not None:
            return self.rai_bps
        return self.mss_bytes * 8 * 1e9 / self.window_ns

    @property
    def cnp_bytes(self) -> int:
        return self.mss_bytes if self.cnp_marked_bytes is None else self.cnp_marked_bytes

    def to_dict(self) -> dict:
        return asdict(self)


#: What each DctcpParams field must be, in the order problems are reported.
_DCTCP_RULES: dict[str, _Rule] = {
    "window_ns": _POSITIVE,
    "g": _GAIN,
    "rai_bps": _or_none(_NONNEGATIVE),
    "mss_bytes": _POSITIVE,
    "min_rate_bps": _POSITIVE,
    "initial_alpha": _FRACTION,
    "scaling": _one_of(Scaling),
}

DCTCP_PRESETS: dict[str, DctcpParams] = {
    # RFC 8257 gain and once-per-window cut; the window (RTT estimate) is ours [check per
    # topology]; K is Linux's guidance of 65 packets at 10 Gb/s, as 1500-byte packets.
    "rfc8257": DctcpParams(
        name="rfc8257",
        window_ns=10 * US,
        g=1 / 16,
        rai_bps=None,
        mss_bytes=1024,
        min_rate_bps=100 * MBPS,
        initial_alpha=1.0,
        k_bytes=65 * 1500,
        reference_rate_bps=10 * GBPS,
        scaling="absolute",
        checks=("window_ns", "k_bytes"),
        source="RFC 8257 (g = 1/16, one cut per window); K: Linux's guidance of 65 packets "
               "at 10 Gb/s [check]; the window is ours",
    ),
    # HPCC ns-3 run.py "dctcp" (CC_MODE 8): EWMA_GAIN 0.0625, DCTCP_RATE_AI 615 Mb/s (run.py:
    # one 1 KB MTU per 13 us RTT, which is also our window), K = 30 KB per 10G (KMIN = KMAX,
    # PMAX 1), MIN_RATE 1000Mb/s, PACKET_PAYLOAD_SIZE 1000.
    "hpcc-ns3": DctcpParams(
        name="hpcc-ns3",
        window_ns=13 * US,
        g=1 / 16,
        rai_bps=615 * MBPS,
        mss_bytes=1000,
        min_rate_bps=1 * GBPS,
        initial_alpha=1.0,
        k_bytes=30_000,
        reference_rate_bps=10 * GBPS,
        scaling="per_reference",
        checks=(),
        source=_HPCC + "run.py --cc dctcp (CC_MODE 8) + src/point-to-point/model/rdma-hw.cc",
    ),
}


#: The DCTCP preset names, in table order (cc "dctcp"), derived from DCTCP_PRESETS.
DCTCP_PRESET_NAMES: tuple[str, ...] = tuple(DCTCP_PRESETS)
#: The agent's DCTCP preset when none is named.
DEFAULT_DCTCP_PRESET = "rfc8257"


def dctcp_preset(name: str, line_rate_bps: float, *, scale: bool | None = None) -> DctcpParams:
    """The DCTCP preset `name` for a link of `line_rate_bps` (only K scales)."""
    try:
        p = DCTCP_PRESETS[name]
    except KeyError:
        raise _unknown("DCTCP preset", name, DCTCP_PRESETS) from None
    if not line_rate_bps > 0:
        raise ValueError(f"line_rate_bps must be > 0, got {line_rate_bps!r}")
    do_scale = p.scaling == "per_reference" if scale is None else scale
    if not do_scale or p.reference_rate_bps is None:
        return p
    return replace(p, k_bytes=round(p.k_bytes * line_rate_bps / p.reference_rate_bps))


# --- per-workload overrides --------------------------------------------------------------

# Not tunable: bookkeeping, and the switch's marking curve (the CP), which the controllers
# never read; a fabric sets that on its port classes (qos.<class>.ecn).
_BOOKKEEPING = ("name", "reference_rate_bps", "scaling", "checks", "source")
SWITCH_FIELDS = ("kmin_bytes", "kmax_bytes", "pmax", "k_bytes")
#: The fields `with_overrides` may set, per kind: every behaviour a preset fixes.
DCQCN_TUNABLE = tuple(f.name for f in fields(DcqcnParams)
                      if f.name not in _BOOKKEEPING + SWITCH_FIELDS)
DCTCP_TUNABLE = tuple(f.name for f in fields(DctcpParams)
                      if f.name not in _BOOKKEEPING + SWITCH_FIELDS)


def with_overrides(params: DcqcnParams | DctcpParams,
                   overrides: Mapping[str, object] | None) -> DcqcnParams | DctcpParams:
    """`params` with `overrides` (field name -> value) in place of its values.

    The values are absolute, for the link `params` was made for: apply them to what
    `preset()` / `dctcp_preset()` returned for the sender's line rate, so a per-25G preset
    is scaled first and an overridden R_AI is the R_AI this link gets. An overridden field
    leaves `checks` (its value is the caller's now). Unknown or untunable names, and values
    the parameter set refuses, raise ValueError naming them.
    """
    if not overrides:
        return params
    dcqcn = isinstance(params, DcqcnParams)
    tunable = DCQCN_TUNABLE if dcqcn else DCTCP_TUNABLE
    other = DCTCP_TUNABLE if dcqcn else DCQCN_TUNABLE
    kind = "DCQCN" if dcqcn else "DCTCP"
    problems = []
    for name in overrides:
        if name in tunable:
            continue
        if name in SWITCH_FIELDS:
            problems.append(f"{name} is the switch's ECN marking, not a {kind} parameter")
        elif name in other:
            problems.append(f"{name} is a {'DCTCP' if dcqcn else 'DCQCN'} parameter, not a "
                            f"{kind} one")
        else:
            import difflib  # only to name a typo: ~0.35 MB an agent would hold

            close = difflib.get_close_matches(name, tunable, n=1)
            problems.append(f"unknown {kind} parameter {name!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))
    if problems:
        raise ValueError(f"{kind} overrides: {'; '.join(problems)}; {kind} parameters: "
                         f"{', '.join(tunable)}")
    # Any: the values are the caller's (JSON from the command line); the dataclass's own
    # checks (__post_init__) judge them.
    changes: dict[str, Any] = dict(overrides)
    return replace(params, **changes,
                   checks=tuple(c for c in params.checks if c not in overrides))


def effective_params(kind: str, preset_name: str | None, line_rate_bps: float,
                     overrides: Mapping[str, object] | None = None
                     ) -> DcqcnParams | DctcpParams | None:
    """The parameter set a QP of `kind` runs with on a link of `line_rate_bps`: the preset,
    scaled to the link, then the overrides (absolute values). None for kind "none"."""
    if kind in ("dcqcn", "dctcp"):
        if preset_name is None:
            raise ValueError(f"congestion control {kind!r} needs a preset name")
        if kind == "dcqcn":
            return with_overrides(preset(preset_name, line_rate_bps), overrides)
        return with_overrides(dctcp_preset(preset_name, line_rate_bps), overrides)
    if kind == "none":
        if overrides:
            raise ValueError("congestion control 'none' has no parameters to override")
        return None
    raise _unknown("congestion control kind", kind, CC_KINDS)


# --- the transport-facing interface ------------------------------------------------------


@runtime_checkable
class RateController(Protocol):
    """What the transport sees of a congestion controller (one per QP).

    Every method takes the fabric time of the event and returns the current rate;
    `advance` only fires due timers. `next_event_ns` is when the next timer fires
    (None: no timer armed), so the sender can sleep until min(next packet, next event).
    """

    kind: str
    line_rate_bps: float

    @property
    def rate_bps(self) -> float: ...

    def on_cnp(self, now_ns: float) -> float: ...

    def on_ecn_echo(self, marked_bytes: int, total_bytes: int, now_ns: float) -> float: ...

    def on_bytes_sent(self, nbytes: int, now_ns: float) -> float: ...

    def advance(self, now_ns: float) -> float: ...

    def next_event_ns(self) -> float | None: ...

    def snapshot(self) -> dict: ...


def _check_line_rate(line_rate_bps: float, min_rate_bps: float, name: str) -> float:
    if not line_rate_bps > 0:
        raise ValueError(f"line_rate_bps must be > 0, got {line_rate_bps!r}")
    if min_rate_bps > line_rate_bps:
        raise ValueError(f"{name}: min_rate_bps {min_rate_bps:g} is above the line rate "
                         f"{line_rate_bps:g}; pick a lower minimum rate")
    return float(line_rate_bps)


# --- DCQCN reaction point ----------------------------------------------------------------

_ALPHA, _DECREASE, _INCREASE = 0, 1, 2  # timer ids; at equal deadlines they fire in this order


def _byte_counter_period(p: DcqcnParams) -> float:
    """Bytes from a rate cut to the first byte-counter event (never, without a counter)."""
    return math.inf if p.byte_counter_bytes is None else p.byte_counter_bytes


class DcqcnRp:
    """DCQCN reaction point of one QP: current rate Rc, target rate Rt, alpha, timers.

    Events: `on_cnp` (a CNP arrived), `on_bytes_sent` (feeds the byte counter),
    `on_ecn_echo` (an ACK-borne congestion echo; counts as a CNP when marked_bytes > 0),
    `advance` (fire due timers). Timers (alpha, the optional rate-decrease tick, the
    rate-increase timer T) are periodic from their last reset and are not armed until the
    first CNP; the byte counter counts from the last rate decrease.
    """

    kind = "dcqcn"

    def __init__(self, params: DcqcnParams, line_rate_bps: float, now_ns: float) -> None:
        self.params = params
        self.line_rate_bps = _check_line_rate(line_rate_bps, params.min_rate_bps, params.name)
        self._now = now_ns
        self._rc = self.line_rate_bps
        self._rt = self.line_rate_bps
        self._alpha = float(params.initial_alpha)
        self._seen_cnp = False
        self._deadline: list[float | None] = [None, None, None]  # alpha, decrease, increase
        self._alpha_cnp_flag = False  # "periodic" alpha: a CNP arrived this period
        self._decrease_pending = False  # deferred decrease: a CNP arrived since last tick
        self._t_stage = 0
        self._bc_stage = 0
        self._bc_bytes: float = 0     # counted since the last cut (a threshold may be half)
        self._bc_threshold = _byte_counter_period(params)
        self._phase = PHASE_INIT
        self._c = {"cnps": 0, "ecn_echoes": 0, "rate_decreases": 0, "alpha_updates": 0,
                   "timer_events": 0, "byte_events": 0, "decrease_ticks": 0, "bytes_sent": 0}
        self._increases = dict.fromkeys(INCREASE_KINDS, 0)

    # -- read side

    @property
    def rate_bps(self) -> float:
        return self._rc

    @property
    def target_rate_bps(self) -> float:
        return self._rt

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def phase(self) -> str:
        return self._phase

    def next_event_ns(self) -> float | None:
        armed = [d for d in self._deadline if d is not None]
        return min(armed) if armed else None

    def snapshot(self) -> dict:
        return {
            "kind": self.kind,
            "preset": self.params.name,
            "line_rate_bps": self.line_rate_bps,
            "rate_bps": self._rc,
            "rc_bps": self._rc,
            "rt_bps": self._rt,
            "alpha": self._alpha,
            "phase": self._phase,
            "stages": {"timer": self._t_stage, "byte_counter": self._bc_stage},
            "byte_counter_bytes": self._bc_bytes,
            "timers_ns": {"alpha": self._deadline[_ALPHA], "decrease": self._deadline[_DECREASE],
                          "increase": self._deadline[_INCREASE]},
            "next_event_ns": self.next_event_ns(),
            "counters": {**self._c, "increases": dict(self._increases)},
        }

    # -- events

    def advance(self, now_ns: float) -> float:
        now = self._clock(now_ns)
        while True:
            due = self._next_due()
            if due is None or due[0] > now:
                break
            deadline, timer = due
            if timer == _ALPHA:
                self._fire_alpha(deadline)
            elif timer == _DECREASE:
                self._fire_decrease(deadline)
            else:
                self._fire_increase(deadline)
        return self._rc

    def on_cnp(self, now_ns: float) -> float:
        self.advance(now_ns)
        now = self._now
        p = self.params
        self._c["cnps"] += 1
        first = not self._seen_cnp
        self._seen_cnp = True
        if p.alpha_update == "periodic":
            if first:  # Mellanox model: alpha starts at its initial value on the first CNP
                self._alpha = float(p.initial_alpha)
                self._deadline[_ALPHA] = now + p.alpha_timer_ns
            else:
                self._alpha_cnp_flag = True
        if p.rate_decrease_interval_ns is None:
            if p.alpha_update == "on_cnp":
                if p.cut_with_updated_alpha:
                    self._alpha_on_cnp(now)
                    self._cut(now)
                else:
                    self._cut(now)
                    self._alpha_on_cnp(now)
            else:
                self._cut(now)
        else:
            if p.alpha_update == "on_cnp":
                self._alpha_on_cnp(now)
            self._decrease_pending = True
            if first:
                self._deadline[_DECREASE] = now + p.rate_decrease_interval_ns
        return self._rc

    def on_ecn_echo(self, marked_bytes: int, total_bytes: int, now_ns: float) -> float:
        """An ACK that echoes congestion: any marked byte counts as one CNP."""
        self._c["ecn_echoes"] += 1
        if marked_bytes > 0:
            return self.on_cnp(now_ns)
        return self.advance(now_ns)

    def bulk_bytes_budget(self, now_ns: float) -> float:
        """Bytes `on_bytes_sent` may be told at `now_ns`, in any number of calls, with
        every call returning the current rate and the state after them the same as after
        one call with their sum: 0 when a timer is due (the next call fires it), else the
        bytes left before the byte counter's next event (inf without one). The fast path
        (agents.rdma.qp.RcRequester.build_batch) batches packets within this budget and
        leaves the packet that reaches it to the per-packet path."""
        for d in self._deadline:
            if d is not None and d <= now_ns:
                return 0.0
        if self.params.byte_counter_bytes is None or self._phase == PHASE_INIT:
            return math.inf
        return self._bc_threshold - self._bc_bytes

    def on_bytes_sent(self, nbytes: int, now_ns: float) -> float:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.advance(now_ns)
        self._c["bytes_sent"] += nbytes
        bc = self.params.byte_counter_bytes
        if bc is None or self._phase == PHASE_INIT:
            return self._rc
        self._bc_bytes += nbytes
        while self._bc_bytes >= self._bc_threshold:
            self._bc_bytes -= self._bc_threshold
            halve = self.params.hyper_halves_periods and self._phase == PHASE_HYPER
            self._bc_threshold = bc / 2 if halve else bc
            self._bc_stage += 1
            self._c["byte_events"] += 1
            self._increase()
        return self._rc

    # -- internals

    def _clock(self, now_ns: float) -> float:
        if now_ns > self._now:
            self._now = now_ns
        return self._now

    def _next_due(self) -> tuple[float, int] | None:
        best = None
        for timer, deadline in enumerate(self._deadline):
            if deadline is not None and (best is None or deadline < best[0]):
                best = (deadline, timer)
        return best

    def _alpha_on_cnp(self, now: float) -> None:
        g = self.params.g
        self._alpha = (1 - g) * self._alpha + g
        self._deadline[_ALPHA] = now + self.params.alpha_timer_ns  # "no CNP for a period"

    def _fire_alpha(self, deadline: float) -> None:
        p = self.params
        self._c["alpha_updates"] += 1
        if p.alpha_update == "periodic":
            self._alpha = (1 - p.g) * self._alpha + (p.g if self._alpha_cnp_flag else 0.0)
            self._alpha_cnp_flag = False
        else:
            self._alpha = (1 - p.g) * self._alpha
        self._deadline[_ALPHA] = deadline + p.alpha_timer_ns

    def _fire_decrease(self, deadline: float) -> None:
        self._c["decrease_ticks"] += 1
        interval = self.params.rate_decrease_interval_ns   # armed only when there is one
        self._deadline[_DECREASE] = None if interval is None else deadline + interval
        if self._decrease_pending:
            self._decrease_pending = False
            self._cut(deadline)

    def _fire_increase(self, deadline: float) -> None:
        p = self.params
        halve = p.hyper_halves_periods and self._phase == PHASE_HYPER
        self._deadline[_INCREASE] = deadline + (p.increase_timer_ns / 2 if halve
                                                else p.increase_timer_ns)
        self._t_stage += 1
        self._c["timer_events"] += 1
        self._increase()

    def _clamp(self, rate: float) -> float:
        return min(self.line_rate_bps, max(self.params.min_rate_bps, rate))

    def _cut(self, now: float) -> None:
        """One rate decrease: Rt = Rc (per target_clamp), Rc *= 1 - alpha/2, reset T and BC."""
        p = self.params
        if p.target_clamp == "always" or self._t_stage + self._bc_stage > 0:
            self._rt = self._rc
        self._rc = self._clamp(self._rc * (1 - self._alpha / 2))
        self._rt = self._clamp(self._rt)
        self._t_stage = 0
        self._bc_stage = 0
        self._bc_bytes = 0
        self._bc_threshold = _byte_counter_period(p)
        self._deadline[_INCREASE] = now + p.increase_timer_ns
        self._phase = PHASE_FAST
        self._c["rate_decreases"] += 1

    def _increase(self) -> None:
        """One rate-increase event (its stage counter was just incremented)."""
        p = self.params
        big_f = p.fast_recovery_steps
        i = 1
        if p.increase_rule == "qcn":
            t = self._t_stage
            b = self._bc_stage if p.byte_counter_bytes is not None else 0
            if t < big_f and b < big_f:
                phase = PHASE_FAST
            elif t >= big_f and b >= big_f:
                phase = PHASE_HYPER
                i = min(t, b) - big_f + 1
            else:
                phase = PHASE_ADDITIVE
        else:  # "mlx": count of increase events since the decrease, before this one
            s = self._t_stage + self._bc_stage - 1
            if s < big_f:
                phase = PHASE_FAST
            elif s == big_f:
                phase = PHASE_ADDITIVE
            else:
                phase = PHASE_HYPER
                i = s - big_f
        if not p.hyper_scaled:
            i = 1
        step = {PHASE_FAST: 0.0, PHASE_ADDITIVE: p.rai_bps, PHASE_HYPER: i * p.rhai_bps}[phase]
        rt = self._rt
        if (p.rt_shrink_quirk and (self._t_stage == 1 or self._bc_stage == 1)
                and rt > 10 * self._rc):
            rt = rt / 8
        else:
            rt = rt + step
        self._rt = self._clamp(rt)
        self._rc = self._clamp((self._rt + self._rc) / 2)
        self._phase = phase
        self._increases[phase] += 1


# --- DCQCN notification point ------------------------------------------------------------


class DcqcnNp:
    """DCQCN notification point of one QP: decides when a CE-marked packet earns a CNP.

    mode "interval" (paper): a CE packet triggers a CNP if no CNP was sent in the last
    `cnp_interval_ns` (the first CE packet after the interval has passed triggers it).
    mode "timer" (NIC firmware / ns3-rdma style): a per-QP timer started by the first CE
    packet divides time into slots of `cnp_interval_ns`; the first CE packet of a slot
    triggers a CNP, so two CNPs can be closer than the interval across a slot boundary.
    An interval of 0 sends a CNP for every CE packet.
    """

    def __init__(self, cnp_interval_ns: float, mode: NpMode = "interval") -> None:
        if not cnp_interval_ns >= 0:
            raise ValueError(f"cnp_interval_ns must be >= 0, got {cnp_interval_ns!r}")
        if mode not in get_args(NpMode):
            raise ValueError(f"mode must be one of {list(get_args(NpMode))}, got {mode!r}")
        self.cnp_interval_ns = cnp_interval_ns
        self.mode = mode
        self._last_cnp_ns: float | None = None
        self._anchor_ns: float | None = None
        self._last_slot: int | None = None
        self._c = {"packets": 0, "ce_packets": 0, "cnps_sent": 0, "ce_coalesced": 0}

    def on_packet(self, ce: bool, now_ns: float) -> bool:
        """Account one data packet; True when a CNP should be sent for it now."""
        self._c["packets"] += 1
        if not ce:
            return False
        self._c["ce_packets"] += 1
        send = self._due(now_ns)
        if send:
            self._c["cnps_sent"] += 1
            self._last_cnp_ns = now_ns
        else:
            self._c["ce_coalesced"] += 1
        return send

    def on_unmarked_packets(self, n: int) -> None:
        """`n` data packets without a CE mark at once: what `n` calls of
        `on_packet(False, ...)` do (the fast path's in-order runs)."""
        self._c["packets"] += n

    def _due(self, now: float) -> bool:
        interval = self.cnp_interval_ns
        if interval == 0:
            return True
        if self.mode == "interval":
            return self._last_cnp_ns is None or now - self._last_cnp_ns >= interval
        if self._anchor_ns is None:
            self._anchor_ns = now
        slot = math.floor((now - self._anchor_ns) / interval)
        if slot == self._last_slot:
            return False
        self._last_slot = slot
        return True

    def snapshot(self) -> dict:
        return {"cnp_interval_ns": self.cnp_interval_ns, "mode": self.mode,
                "last_cnp_ns": self._last_cnp_ns, "counters": dict(self._c)}


# --- rate-based DCTCP --------------------------------------------------------------------


class DctcpRp:
    """DCTCP (RFC 8257) for a rate-based sender; one window = `params.window_ns`.

    Windows are back to back from the creation time. In each window the controller
    counts bytes sent, bytes acknowledged and bytes marked (from `on_ecn_echo`; a CNP
    stands for `params.cnp_bytes` marked bytes). The first mark in a window cuts the rate
    once: rate *= 1 - alpha/2 (floor min_rate). When a window with traffic closes:
    F = marked / acknowledged (or / sent when nothing was acknowledged), alpha = (1-g)
    alpha + g F, and if nothing was marked the rate grows by the additive step (one MSS
    per window unless `rai_bps` is given), capped at line rate. Windows with no traffic
    change nothing.
    """

    kind = "dctcp"
    # the window being counted, from its start (_reset_window)
    _win_sent: int
    _win_acked: int
    _win_marked: int
    _win_cut: bool

    def __init__(self, params: DctcpParams, line_rate_bps: float, now_ns: float) -> None:
        self.params = params
        self.line_rate_bps = _check_line_rate(line_rate_bps, params.min_rate_bps, params.name)
        self._now = now_ns
        self._rate = self.line_rate_bps
        self._alpha = float(params.initial_alpha)
        self._window_end = now_ns + params.window_ns
        self._reset_window()
        self._last_f = 0.0
        self._c = {"cnps": 0, "ecn_echoes": 0, "rate_decreases": 0, "windows": 0,
                   "bytes_sent": 0}
        self._increases = {PHASE_ADDITIVE: 0}

    @property
    def rate_bps(self) -> float:
        return self._rate

    @property
    def alpha(self) -> float:
        return self._alpha

    def next_event_ns(self) -> float | None:
        return self._window_end

    def snapshot(self) -> dict:
        return {
            "kind": self.kind,
            "preset": self.params.name,
            "line_rate_bps": self.line_rate_bps,
            "rate_bps": self._rate,
            "alpha": self._alpha,
            "last_fraction": self._last_f,
            "window": {"end_ns": self._window_end, "sent_bytes": self._win_sent,
                       "acked_bytes": self._win_acked, "marked_bytes": self._win_marked,
                       "cut": self._win_cut},
            "next_event_ns": self._window_end,
            "counters": {**self._c, "increases": dict(self._increases)},
        }

    def advance(self, now_ns: float) -> float:
        if now_ns > self._now:
            self._now = now_ns
        now = self._now
        w = self.params.window_ns
        while self._window_end <= now:
            if self._win_sent or self._win_acked or self._win_marked:
                self._close_window()
                self._window_end += w
            else:  # idle windows change nothing: skip them all at once
                skip = math.floor((now - self._window_end) / w) + 1
                self._window_end += skip * w
        return self._rate

    def on_ecn_echo(self, marked_bytes: int, total_bytes: int, now_ns: float) -> float:
        if marked_bytes < 0 or total_bytes < 0:
            raise ValueError(f"byte counts must be >= 0, got {marked_bytes}, {total_bytes}")
        self._c["ecn_echoes"] += 1
        return self._feedback(marked_bytes, total_bytes, now_ns)

    def on_cnp(self, now_ns: float) -> float:
        self._c["cnps"] += 1
        return self._feedback(self.params.cnp_bytes, 0, now_ns)

    def bulk_bytes_budget(self, now_ns: float) -> float:
        """As DcqcnRp.bulk_bytes_budget: bytes sent only add to the window's count, so
        any amount, unless the window closes at `now_ns` (0: the next call closes it)."""
        return 0.0 if self._window_end <= now_ns else math.inf

    def on_bytes_sent(self, nbytes: int, now_ns: float) -> float:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.advance(now_ns)
        self._win_sent += nbytes
        self._c["bytes_sent"] += nbytes
        return self._rate

    def _feedback(self, marked_bytes: int, total_bytes: int, now_ns: float) -> float:
        self.advance(now_ns)
        self._win_marked += marked_bytes
        self._win_acked += total_bytes
        if marked_bytes > 0 and not self._win_cut:  # at most one cut per window
            self._win_cut = True
            self._rate = max(self.params.min_rate_bps, self._rate * (1 - self._alpha / 2))
            self._c["rate_decreases"] += 1
        return self._rate

    def _reset_window(self) -> None:
        self._win_sent = 0
        self._win_acked = 0
        self._win_marked = 0
        self._win_cut = False

    def _close_window(self) -> None:
        p = self.params
        denominator = self._win_acked if self._win_acked > 0 else self._win_sent
        if denominator > 0:
            f = min(1.0, self._win_marked / denominator)
        else:
            f = 1.0 if self._win_marked > 0 else 0.0
        self._last_f = f
        self._alpha = (1 - p.g) * self._alpha + p.g * f
        if self._win_marked == 0:
            self._rate = min(self.line_rate_bps, self._rate + p.additive_increase_bps)
            self._increases[PHASE_ADDITIVE] += 1
        self._c["windows"] += 1
        self._reset_window()


# --- no congestion control ---------------------------------------------------------------


class NoCc:
    """Always line rate; counts what it is told so snapshots stay comparable."""

    kind = "none"

    def __init__(self, line_rate_bps: float, now_ns: float = 0) -> None:
        self.line_rate_bps = _check_line_rate(line_rate_bps, 0, "none")
        self._now = now_ns
        self._c = {"cnps": 0, "ecn_echoes": 0, "rate_decreases": 0, "bytes_sent": 0}

    @property
    def rate_bps(self) -> float:
        return self.line_rate_bps

    def next_event_ns(self) -> float | None:
        return None

    def advance(self, now_ns: float) -> float:
        self._now = max(self._now, now_ns)
        return self.line_rate_bps

    def on_cnp(self, now_ns: float) -> float:
        self._c["cnps"] += 1
        return self.advance(now_ns)

    def on_ecn_echo(self, marked_bytes: int, total_bytes: int, now_ns: float) -> float:
        self._c["ecn_echoes"] += 1
        return self.advance(now_ns)

    def bulk_bytes_budget(self, now_ns: float) -> float:
        """As DcqcnRp.bulk_bytes_budget: the rate never changes."""
        return math.inf

    def on_bytes_sent(self, nbytes: int, now_ns: float) -> float:
        self._c["bytes_sent"] += nbytes
        if now_ns > self._now:          # advance(), inlined: this runs once per packet
            self._now = now_ns
        return self.line_rate_bps

    def snapshot(self) -> dict:
        return {"kind": self.kind, "preset": None, "line_rate_bps": self.line_rate_bps,
                "rate_bps": self.line_rate_bps, "next_event_ns": None,
                "counters": {**self._c, "increases": {}}}


# --- factory -----------------------------------------------------------------------------

CC_KINDS = ("dcqcn", "dctcp", "none")


def make_cc(kind: str, preset_name: str | None, line_rate_bps: float, now_ns: float,
            overrides: Mapping[str, object] | None = None) -> DcqcnRp | DctcpRp | NoCc:
    """A congestion controller for one QP on a link of `line_rate_bps`, born at `now_ns`.

    kind "dcqcn" takes a name from PRESETS, "dctcp" one from DCTCP_PRESETS, "none"
    ignores the preset name. `overrides` replace preset values (`effective_params`).
    """
    params = effective_params(kind, preset_name, line_rate_bps, overrides)   # checks them
    if isinstance(params, DcqcnParams):
        return DcqcnRp(params, line_rate_bps, now_ns)
    if isinstance(params, DctcpParams):
        return DctcpRp(params, line_rate_bps, now_ns)
    return NoCc(line_rate_bps, now_ns)          # kind "none": no parameters
