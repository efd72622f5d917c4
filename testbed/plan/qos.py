"""Resolve a port class into concrete per-class queue, ECN and PFC settings.

Pure. Inputs are fabric units (the port's MAC rate, the link's one-way
delay); outputs are bytes and probabilities, which time dilation leaves
unchanged. The ECN presets live in one table here, each with its source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from testbed.config.models import EcnCurve, PortClass, TrafficClass, trim_target
from testbed.plan.red import red_problems
from testbed.units import format_size

# Per traffic-class buffer when the port class does not say (bytes).
DEFAULT_BUFFER_BYTES = {"lossless": 2_000_000, "strict": 256_000, "lossy": 1_000_000}

# DCQCN CP (switch) marking presets: hpcc-ns3 is HPCC's ns-3 setting (run.py's
# KMIN/KMAX/PMAX maps: 100/400 KB per 25 Gb/s, so 100G 400/1600 KB, Pmax 0.2);
# dcqcn-paper the DCQCN paper's (Zhu et al., SIGCOMM 2015; a secondary source only);
# ns3-rdma that of the DCQCN authors' ns-3 simulator. `per_25g` presets scale with
# the port rate, the way HPCC's scripts do.
ECN_PRESETS = {
    "hpcc-ns3": {"kmin_bytes": 100_000, "kmax_bytes": 400_000, "pmax": 0.2, "per_25g": True},
    "dcqcn-paper": {"kmin_bytes": 5_000, "kmax_bytes": 200_000, "pmax": 0.01, "per_25g": False},
    "ns3-rdma": {"kmin_bytes": 40_000, "kmax_bytes": 1_000_000, "pmax": 1.0, "per_25g": False},
}

# 802.1Qbb response time the Cisco headroom formula allows: 60 pause quanta
# of 512 bit times each.
PFC_RESPONSE_BYTES = 60 * 512 // 8
# Ethernet header + FCS + preamble/IFG that a full-MTU frame occupies on the wire.
ETH_WIRE_OVERHEAD_BYTES = 14 + 4 + 20


@dataclass(frozen=True)
class EcnSettings:
    kmin_bytes: int
    kmax_bytes: int
    pmax: float
    marker: str = "bpf"     # what marks: the port program (bpf) or the class's sch_red (red)


@dataclass(frozen=True)
class PfcSettings:
    priority: int
    xoff_bytes: int
    xon_bytes: int
    headroom_bytes: int
    watchdog_ns: int | None = None
    mode: str = "static"
    alpha: float = 0.125


@dataclass(frozen=True)
class TrimSettings:
    threshold_bytes: int    # queue above which an arriving UET packet is trimmed
    size_bytes: int         # IP bytes the trimmed packet keeps
    tc: int                 # the class it is sent in
    dscp: int               # ... with that class's first DSCP


@dataclass(frozen=True)
class ClassQos:
    tc: int
    name: str
    limit_bytes: int
    ecn: EcnSettings | None
    pfc: PfcSettings | None
    trim: TrimSettings | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QosProblem:
    field: str      # dotted path below the port class, e.g. "pfc.xoff"
    message: str
    allowance: str = ""     # the `allow:` name that turns it into a plan warning, if any


# allow: name of the check that ECN's kmin is below PFC's XOFF.
ECN_ABOVE_XOFF = "ecn-above-xoff"


def headroom_bytes(rate_bps: int, one_way_delay_ns: int, mtu_bytes: int,
                   response_ns: int = 0) -> int:
    """Cisco's PFC headroom: MTU_rx + 2 x cable delay x rate + response time + MTU_tx.

    The response time is 802.1Qbb's 60 quanta, or `response_ns` of fabric time at the
    port's rate where that is longer (the emulated PFC loop's, the plan's
    DilationPlan.pfc_loop_wall_ns converted by the dilation).
    """
    frame = mtu_bytes + ETH_WIRE_OVERHEAD_BYTES
    in_flight = 2 * one_way_delay_ns * rate_bps // 8_000_000_000
    response = max(PFC_RESPONSE_BYTES, response_ns * rate_bps // 8_000_000_000)
    return frame + in_flight + response + frame


def resolve_ecn(port_class: PortClass, rate_bps: int) -> EcnSettings:
    return replace(resolve_ecn_curve(port_class.ecn, rate_bps), marker=port_class.ecn.marker)


def resolve_ecn_curve(ecn: EcnCurve, rate_bps: int) -> EcnSettings:
    """A marking curve at a port of `rate_bps` (per-25G presets scale with it)."""
    if ecn.k_bytes is not None:
        return EcnSettings(ecn.k_bytes, ecn.k_bytes, 1.0)
    if ecn.kmin_bytes is not None and ecn.kmax_bytes is not None:
        return EcnSettings(ecn.kmin_bytes, ecn.kmax_bytes, ecn.pmax if ecn.pmax else 1.0)
    preset = ECN_PRESETS[ecn.preset or "dcqcn-paper"]
    scale = rate_bps / 25e9 if preset["per_25g"] else 1.0
    return EcnSettings(round(preset["kmin_bytes"] * scale), round(preset["kmax_bytes"] * scale),
                       preset["pmax"])


def _default_buffer(tclass: TrafficClass) -> int:
    if tclass.lossless:
        return DEFAULT_BUFFER_BYTES["lossless"]
    if tclass.strict:
        return DEFAULT_BUFFER_BYTES["strict"]
    return DEFAULT_BUFFER_BYTES["lossy"]


def auto_headroom_bytes(hardware_bytes: int, emulated_bytes: int, room_bytes: int | None) -> int:
    """The headroom a port gets when the config names none: what the emulated PFC loop
    needs, as far as the buffer has room for it, and never less than the hardware's
    figure. The emulator's allowance never turns a config that is sound in hardware
    into an error: where the room is short, the plan warns and the run's invariants
    say whether the class dropped."""
    if room_bytes is None:
        return emulated_bytes
    return max(hardware_bytes, min(emulated_bytes, room_bytes))


def resolve_port_qos(port_class: PortClass, tclasses: list[TrafficClass], rate_bps: int,
                     one_way_delay_ns: int, mtu_bytes: int, shared_pool: bool = False,
                     response_ns: int = 0, pool_headroom_room_bytes: int | None = None,
                     ) -> tuple[list[ClassQos], list[QosProblem]]:
    """Concrete settings for every traffic class on one port, and any problems found.

    `shared_pool`: the fabric has a switch_buffer, so lossless classes at switches
    draw from it rather than from their per-port buffer: the per-port XOFF and
    headroom checks do not apply, and PFC defaults to the dynamic threshold.
    `response_ns`: the emulated PFC loop's response in fabric time (headroom_bytes).
    `pool_headroom_room_bytes`: with a shared pool, the most auto headroom a port's
    lossless class may set aside in it (auto_headroom_bytes); per-port buffers give
    the class buffer above XOFF.
    """
    problems: list[QosProblem] = []
    pfc_cfg = port_class.pfc
    lossless_tcs = [t.tc for t in tclasses if t.lossless]
    pfc_tcs = set(lossless_tcs if pfc_cfg.priorities is None else pfc_cfg.priorities)
    ecn = resolve_ecn(port_class, rate_bps)
    out: list[ClassQos] = []
    for tclass in tclasses:
        limit = port_class.buffer.get(tclass.tc, _default_buffer(tclass))
        ecn_here = ecn if tclass.ecn else None
        pfc_here = None
        if pfc_cfg.enabled and tclass.tc in pfc_tcs:
            mode = pfc_cfg.mode if "mode" in pfc_cfg.model_fields_set else (
                "dynamic" if shared_pool else "static")
            xoff = pfc_cfg.xoff_bytes if pfc_cfg.xoff_bytes is not None else limit // 2
            headroom = pfc_cfg.headroom_bytes
            if headroom is None:
                headroom = auto_headroom_bytes(
                    headroom_bytes(rate_bps, one_way_delay_ns, mtu_bytes),
                    headroom_bytes(rate_bps, one_way_delay_ns, mtu_bytes, response_ns),
                    pool_headroom_room_bytes if shared_pool else limit - xoff)
            xon = pfc_cfg.xon_bytes
            if xon is None:
                xon = max(0, xoff - 2 * (mtu_bytes + ETH_WIRE_OVERHEAD_BYTES))
            if not shared_pool and xoff + headroom > limit:
                problems.append(QosProblem(
                    f"buffer.{tclass.tc}",
                    f"TC{tclass.tc} buffer {format_size(limit)} cannot hold XOFF "
                    f"{format_size(xoff)} plus PFC headroom {format_size(headroom)} at "
                    f"{rate_bps / 1e9:g} Gb/s; raise the buffer to at least "
                    f"{format_size(xoff + headroom)} or lower pfc.xoff"))
            if xon > xoff:
                problems.append(QosProblem(
                    "pfc.xon", f"{format_size(xon)} is above XOFF {format_size(xoff)}; "
                    "set xon below xoff"))
            if ecn_here is not None and ecn_here.kmin_bytes >= xoff and mode == "static":
                problems.append(QosProblem(
                    "ecn.kmin",
                    f"{format_size(ecn_here.kmin_bytes)} is not below pfc.xoff "
                    f"{format_size(xoff)} on TC{tclass.tc} at {rate_bps / 1e9:g} Gb/s, so PFC "
                    "will fire before ECN marks; lower ecn.kmin or raise pfc.xoff",
                    allowance=ECN_ABOVE_XOFF))
            pfc_here = PfcSettings(tclass.tc, xoff, xon, headroom, pfc_cfg.watchdog_ns,
                                   mode, pfc_cfg.alpha)
        if ecn_here is not None and ecn_here.kmin_bytes > limit and not (
                shared_pool and pfc_here is not None):
            problems.append(QosProblem(
                "ecn.kmin", f"{format_size(ecn_here.kmin_bytes)} is above the TC{tclass.tc} "
                f"buffer {format_size(limit)} at {rate_bps / 1e9:g} Gb/s, so the class drops "
                "before it marks; lower ecn.kmin or raise the buffer"))
        if ecn_here is not None and ecn_here.marker == "red":
            for field, message in red_problems(ecn_here.kmin_bytes, ecn_here.kmax_bytes,
                                               ecn_here.pmax, limit):
                problems.append(QosProblem(field, f"marker red on TC{tclass.tc} at "
                                           f"{rate_bps / 1e9:g} Gb/s: {message}"))
        out.append(ClassQos(tclass.tc, tclass.name, limit, ecn_here, pfc_here,
                            resolve_trim(port_class, tclasses, tclass, limit)))
    return out, problems


def resolve_trim(port_class: PortClass, tclasses: list[TrafficClass], tclass: TrafficClass,
                 limit_bytes: int) -> TrimSettings | None:
    """A class's trimming at a port: None unless it trims (a lossless class never does,
    and a config without a class to trim into is refused by the checks)."""
    if not tclass.trim or tclass.lossless:
        return None
    cfg = port_class.trim
    target = trim_target(tclasses, cfg.to)
    if target is None or not target.dscp:
        return None
    threshold = limit_bytes if cfg.threshold_bytes is None else min(cfg.threshold_bytes,
                                                                    limit_bytes)
    return TrimSettings(threshold, cfg.size_bytes, target.tc, target.dscp[0])
