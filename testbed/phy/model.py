"""The PHY model: port type + length -> rates, delay, error ratios, power, warnings.

Pure functions, no I/O. The formulas, their calibration and their sources are
in docs/phy.md; the constants that are choices (not standard figures) live in
`PhyAssumptions` so a caller can change them instead of editing this file.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import asdict, dataclass, fields

from testbed.phy.catalogue import MEDIUM_NAMES, TRANSCODE_RATIO, Fec, PortType, get_port_type

PAM4_SNR_PENALTY_DB = 20 * math.log10(3)   # eye amplitude one third: 9.54 dB


@dataclass(frozen=True)
class PhyAssumptions:
    """Model choices with their documented defaults (docs/phy.md)."""

    fiber_ns_per_m: float = 4.9          # group index ~1.47
    twinax_ns_per_m: float = 4.76        # velocity factor ~0.7
    # Twinax insertion loss per metre at frequency f (GHz): skin_db * sqrt(f) + dielectric_db * f.
    # Only the slope matters: copper BER is anchored at the published reach.
    twinax_skin_db_per_m: float = 0.8
    twinax_dielectric_db_per_m: float = 0.05
    # dB of slicer SNR lost per dB of extra cable loss after equalization: near-end
    # crosstalk and receiver noise do not shrink with the signal, far-end crosstalk does.
    copper_snr_db_per_loss_db: float = 0.5
    # Cabled fiber attenuation (informational): OM4 at 850 nm, OS2 at 1310 nm.
    mmf_loss_db_per_km: float = 3.0
    smf_loss_db_per_km: float = 0.4
    # Optics beyond reach: electrical SNR penalty per reach-length of excess.
    optical_excess_db_per_reach: float = 10.0
    ethernet_overhead_bytes: int = 18    # 14 B header + 4 B FCS on top of the MTU
    frame_loss_warning: float = 1e-9


DEFAULT_ASSUMPTIONS = PhyAssumptions()

@dataclass(frozen=True)
class PhyResult:
    """What one link of `port_type` and `length_m` looks like to a packet (one direction)."""

    port_type: str
    length_m: float
    mtu_bytes: int
    medium: str                      # "copper" | "mmf" | "smf"
    lanes: int
    modulation: str                  # "NRZ" | "PAM4"
    bits_per_symbol: int
    baud_gbd: float
    lane_rate_gbps: float
    raw_rate_gbps: float             # lanes x lane_rate_gbps
    fec: str                         # "RS(544,514) KP4"
    fec_t: int                       # symbols corrected per codeword
    fec_ber_threshold: float
    mac_rate_gbps: float
    mac_rate_bps: int
    propagation_delay_ns: float
    fec_delay_ns: float              # FEC encode + decode + DSP, once
    delay_ns: float                  # propagation + FEC/DSP: one-way link delay
    snr_penalty_db: float            # modulation penalty vs NRZ (PAM4 9.54 dB)
    insertion_loss_db: float         # copper: cable loss at Nyquist; fiber: attenuation
    fec_margin_db: float             # SNR above the FEC threshold (negative: beyond it)
    pre_fec_ber: float
    symbol_error_ratio: float        # per RS symbol, independent bit errors
    post_fec_codeword_error: float   # P(more than t symbol errors in a codeword)
    codewords_per_frame: int
    frame_loss_ratio: float          # P(an MTU-sized frame touches a bad codeword)
    power_w: float                   # one module (one end of the link)
    link_power_w: float              # both ends
    max_reach_m: float
    within_reach: bool
    warnings: list[str]

    def to_dict(self) -> dict:
        """JSON-ready: exactly the field names, plain ints/floats/strings/lists."""
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        return d


PHY_RESULT_FIELDS = tuple(f.name for f in fields(PhyResult))


# ---- error-rate maths ------------------------------------------------------

def q_function(x: float) -> float:
    """Gaussian tail P(N(0,1) > x)."""
    return 0.5 * math.erfc(x / math.sqrt(2))


def ber_from_q(q: float, modulation: str) -> float:
    """Pre-FEC BER for a slicer with peak signal / rms noise `q` (NRZ-equivalent).

    NRZ: Q(q). PAM4 on the same swing: three eyes of a third of the height, symbol
    error 2(1 - 1/4) Q(q/3) = 3/2 Q(q/3), Gray-coded so one bit of two is wrong:
    BER = 3/4 Q(q/3).
    """
    if modulation == "NRZ":
        return q_function(q)
    if modulation == "PAM4":
        return 0.75 * q_function(q / 3)
    raise ValueError(f"unknown modulation {modulation!r}")


@functools.lru_cache(maxsize=256)
def q_for_ber(ber: float, modulation: str) -> float:
    """Inverse of ber_from_q (bisection in log space)."""
    ceiling = ber_from_q(0.0, modulation)
    if not 0 < ber < ceiling:
        raise ValueError(f"BER {ber!r} is outside (0, {ceiling}) for {modulation}")
    lo, hi = 0.0, 200.0
    target = math.log(ber)
    for _ in range(200):
        mid = (lo + hi) / 2
        value = ber_from_q(mid, modulation)
        if value > 0 and math.log(value) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13:
            break
    return hi   # ber_from_q(hi) <= ber: never above the asked BER


def db(x: float) -> float:
    return 20 * math.log10(x)


def from_db(x_db: float) -> float:
    return 10 ** (x_db / 20)


def symbol_error_probability(ber: float, symbol_bits: int) -> float:
    """1 - (1 - BER)^m: an m-bit symbol is wrong if any of its bits is (independent errors)."""
    if ber <= 0:
        return 0.0
    if ber >= 1:
        return 1.0
    return -math.expm1(symbol_bits * math.log1p(-ber))


def codeword_error_probability(n: int, t: int, p_symbol: float) -> float:
    """P(X > t) for X ~ Binomial(n, p_symbol): the decoder's uncorrectable case.

    Summed in log space (lgamma, log-sum-exp) so a tail of 1e-80 is as exact as
    one of 1e-3; underflows to 0.0 only below ~1e-308.
    """
    if p_symbol <= 0:
        return 0.0
    if p_symbol >= 1:
        return 1.0 if t < n else 0.0
    if t >= n:
        return 0.0
    log_p = math.log(p_symbol)
    log_q = math.log1p(-p_symbol)
    log_n_fact = math.lgamma(n + 1)
    terms = [
        log_n_fact - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q
        for k in range(t + 1, n + 1)
    ]
    top = max(terms)
    total = top + math.log(math.fsum(math.exp(x - top) for x in terms))
    return min(1.0, math.exp(total))


def codewords_per_frame(frame_bytes: int, fec: Fec) -> int:
    """Codewords an Ethernet frame of `frame_bytes` can touch.

    The frame takes frame_bits x 257/256 bits of FEC message; it starts anywhere
    in a codeword, so it can touch one more codeword than it fills (worst case).
    """
    message_bits = frame_bytes * 8 * TRANSCODE_RATIO
    return math.ceil(message_bits / fec.message_bits) + 1


def frame_loss_probability(p_codeword: float, codewords: int) -> float:
    """1 - (1 - p_cw)^codewords."""
    if p_codeword <= 0:
        return 0.0
    if p_codeword >= 1:
        return 1.0
    return -math.expm1(codewords * math.log1p(-p_codeword))


# ---- channel models --------------------------------------------------------

def twinax_loss_db_per_m(f_ghz: float, assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS
                         ) -> float:
    """Twinax insertion loss per metre at f (skin effect ~ sqrt(f), dielectric ~ f)."""
    return (assumptions.twinax_skin_db_per_m * math.sqrt(f_ghz)
            + assumptions.twinax_dielectric_db_per_m * f_ghz)


def copper_snr0_db(port: PortType, assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Equalized slicer SNR (20 log10 q) of a zero-length DAC of this type.

    Calibrated so that the SNR left after `max_reach_m` of cable is exactly the
    SNR at which the pre-FEC BER equals the FEC threshold.
    """
    needed = db(q_for_ber(port.fec.ber_threshold, port.modulation))
    return needed + _copper_snr_slope_db_per_m(port, assumptions) * port.max_reach_m


def _copper_snr_slope_db_per_m(port: PortType, assumptions: PhyAssumptions) -> float:
    return (assumptions.copper_snr_db_per_loss_db
            * twinax_loss_db_per_m(port.nyquist_ghz, assumptions))


def slicer_snr_db(port: PortType, length_m: float,
                  assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Slicer SNR (20 log10 q) after `length_m` of this port's medium."""
    if port.is_copper:
        slope = _copper_snr_slope_db_per_m(port, assumptions)
        return copper_snr0_db(port, assumptions) - slope * length_m
    assert port.nominal_ber is not None, f"optic {port.name} has no nominal BER"
    nominal = db(q_for_ber(port.nominal_ber, port.modulation))
    return nominal - optical_excess_penalty_db(port, length_m, assumptions)


def optical_excess_penalty_db(port: PortType, length_m: float,
                              assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS) -> float:
    """0 within reach; then `optical_excess_db_per_reach` per reach-length beyond it."""
    excess = max(0.0, length_m - port.max_reach_m)
    return assumptions.optical_excess_db_per_reach * excess / port.max_reach_m


def pre_fec_ber(port: PortType, length_m: float,
                assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Pre-FEC BER of one lane: copper from the cable loss, optics nominal until reach."""
    if not port.is_copper and length_m <= port.max_reach_m:
        assert port.nominal_ber is not None
        return port.nominal_ber
    return ber_from_q(from_db(slicer_snr_db(port, length_m, assumptions)), port.modulation)


def insertion_loss_db(port: PortType, length_m: float,
                      assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS) -> float:
    if port.is_copper:
        return twinax_loss_db_per_m(port.nyquist_ghz, assumptions) * length_m
    per_km = (assumptions.mmf_loss_db_per_km if port.medium == "mmf"
              else assumptions.smf_loss_db_per_km)
    return per_km * length_m / 1000


def propagation_delay_ns(port: PortType, length_m: float,
                         assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS) -> float:
    per_m = assumptions.twinax_ns_per_m if port.is_copper else assumptions.fiber_ns_per_m
    return round(per_m * length_m, 6)


# ---- the stage -------------------------------------------------------------

def _fmt(x: float) -> str:
    """2.4e-4 rather than 2.4e-04."""
    if x == 0:
        return "0"
    if abs(x) >= 0.01:
        return f"{x:.2g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    mantissa = mantissa.removesuffix(".0")
    return f"{mantissa}e{int(exponent)}"


def _fmt_m(x: float) -> str:
    return f"{x:g} m"


def evaluate(port_type: str, length_m: float, mtu_bytes: int = 9000, *,
             assumptions: PhyAssumptions = DEFAULT_ASSUMPTIONS) -> PhyResult:
    """Evaluate one link. Raises UnknownPortType, or ValueError for a bad length or MTU."""
    port = get_port_type(port_type)
    if isinstance(length_m, bool) or not isinstance(length_m, numbers.Real):
        raise ValueError(f"length must be a number of metres, got {length_m!r}")
    length_m = float(length_m)
    if not math.isfinite(length_m) or length_m < 0:
        raise ValueError(f"length must be a finite number of metres >= 0, got {length_m!r}")
    if isinstance(mtu_bytes, bool) or not isinstance(mtu_bytes, numbers.Integral) or mtu_bytes <= 0:
        raise ValueError(f"MTU must be a positive whole number of bytes, got {mtu_bytes!r}")

    fec = port.fec
    snr_db = slicer_snr_db(port, length_m, assumptions)
    threshold_snr_db = db(q_for_ber(fec.ber_threshold, port.modulation))
    ber = pre_fec_ber(port, length_m, assumptions)
    p_sym = symbol_error_probability(ber, fec.symbol_bits)
    p_cw = codeword_error_probability(fec.n, fec.t, p_sym)
    frame_bytes = mtu_bytes + assumptions.ethernet_overhead_bytes
    n_cw = codewords_per_frame(frame_bytes, fec)
    flr = frame_loss_probability(p_cw, n_cw)
    prop_ns = propagation_delay_ns(port, length_m, assumptions)
    within = length_m <= port.max_reach_m

    warnings: list[str] = []
    # A relative tolerance: at exactly the reach a DAC sits on the threshold by calibration.
    above = ber > fec.ber_threshold * (1 + 1e-9)
    ber_note = (f"pre-FEC BER {_fmt(ber)} is above the {fec.short} threshold "
                f"{_fmt(fec.ber_threshold)}")
    if not within:
        msg = (f"{_fmt_m(length_m)} exceeds the {_fmt_m(port.max_reach_m)} reach of "
               f"{port.name} {MEDIUM_NAMES[port.medium]}")
        warnings.append(f"{msg}; {ber_note}" if above else msg)
    elif above:
        warnings.append(ber_note)
    if flr > assumptions.frame_loss_warning:
        warnings.append(f"post-FEC frame loss {_fmt(flr)} for {mtu_bytes}-byte frames is "
                        f"above {_fmt(assumptions.frame_loss_warning)}")

    mac_rate_bps = port.mac_rate_gbps * 10**9
    return PhyResult(
        port_type=port.name,
        length_m=length_m,
        mtu_bytes=int(mtu_bytes),
        medium=port.medium,
        lanes=port.lanes,
        modulation=port.modulation,
        bits_per_symbol=port.bits_per_symbol,
        baud_gbd=port.baud_gbd,
        lane_rate_gbps=port.lane_rate_gbps,
        raw_rate_gbps=port.raw_rate_gbps,
        fec=fec.name,
        fec_t=fec.t,
        fec_ber_threshold=fec.ber_threshold,
        mac_rate_gbps=float(port.mac_rate_gbps),
        mac_rate_bps=int(mac_rate_bps),
        propagation_delay_ns=prop_ns,
        fec_delay_ns=port.fec_delay_ns,
        delay_ns=prop_ns + port.fec_delay_ns,
        snr_penalty_db=PAM4_SNR_PENALTY_DB if port.modulation == "PAM4" else 0.0,
        insertion_loss_db=insertion_loss_db(port, length_m, assumptions),
        fec_margin_db=snr_db - threshold_snr_db,
        pre_fec_ber=ber,
        symbol_error_ratio=p_sym,
        post_fec_codeword_error=p_cw,
        codewords_per_frame=n_cw,
        frame_loss_ratio=flr,
        power_w=port.power_w,
        link_power_w=2 * port.power_w,
        max_reach_m=port.max_reach_m,
        within_reach=within,
        warnings=warnings,
    )
