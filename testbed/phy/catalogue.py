"""The port types the PHY model knows: lanes, modulation, FEC, reach, power.

Keyed by the IEEE 802.3 name ("400GBASE-DR4"). Every figure here is a
published or documented choice; docs/phy.md says where each comes from.
Rates are stored as the published literals (53.125 GBd, 106.25 Gb/s, ...) so
that tests can check them against the 257/256 x FEC arithmetic instead of
re-deriving them from it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Medium = Literal["copper", "mmf", "smf"]
Modulation = Literal["NRZ", "PAM4"]

BITS_PER_SYMBOL: dict[str, int] = {"NRZ": 1, "PAM4": 2}
MEDIUM_NAMES: dict[str, str] = {
    "copper": "passive copper",
    "mmf": "multimode fiber",
    "smf": "single-mode fiber",
}

# 64b/66b blocks are transcoded four at a time into 257-bit blocks before the
# RS encoder (IEEE 802.3 Clause 91): 257 bits carry 256 bits of MAC data.
TRANSCODE_RATIO = Fraction(257, 256)


@dataclass(frozen=True)
class Fec:
    """A Reed-Solomon code over `symbol_bits`-bit symbols: RS(n, k) corrects t = (n-k)/2."""

    name: str             # "RS(544,514) KP4"
    short: str            # "KP4"
    n: int                # symbols per codeword
    k: int                # message symbols per codeword
    symbol_bits: int
    ber_threshold: float  # pre-FEC BER limit quoted for PMDs that use this code

    @property
    def t(self) -> int:
        return (self.n - self.k) // 2

    @property
    def codeword_bits(self) -> int:
        return self.n * self.symbol_bits

    @property
    def message_bits(self) -> int:
        return self.k * self.symbol_bits

    @property
    def rate_overhead(self) -> Fraction:
        """Line bits per message bit, n/k (544/514 for KP4)."""
        return Fraction(self.n, self.k)


# RS(528,514), "KR4" (IEEE 802.3 Clause 91, also Clause 108 for 25G). Threshold
# 5e-5: the pre-FEC BER 802.3bm specifies for 100GBASE-SR4 [check]; see docs/phy.md.
KR4 = Fec("RS(528,514) KR4", "KR4", n=528, k=514, symbol_bits=10, ber_threshold=5e-5)
# RS(544,514), "KP4" (Clause 91 / 119 / 134). Threshold 2.4e-4 (802.3bs/cd optical PMDs).
KP4 = Fec("RS(544,514) KP4", "KP4", n=544, k=514, symbol_bits=10, ber_threshold=2.4e-4)

FEC_TYPES: dict[str, Fec] = {KR4.short: KR4, KP4.short: KP4}


@dataclass(frozen=True)
class PortType:
    """One IEEE 802.3 PHY (or a common industry one, see `standard`)."""

    name: str
    medium: Medium
    lanes: int
    modulation: Modulation
    baud_gbd: float            # symbol rate per lane, published figure
    lane_rate_gbps: float      # line bit rate per lane, published figure
    mac_rate_gbps: int
    fec: Fec
    max_reach_m: float
    power_w: float             # one module (one link end); a passive DAC is one cable
    fec_delay_ns: float        # FEC encode + decode + DSP, once per hop (one direction)
    standard: str
    nominal_ber: float | None = None   # optics: in-spec pre-FEC BER; copper: None (modelled)
    notes: str = ""

    @property
    def bits_per_symbol(self) -> int:
        return BITS_PER_SYMBOL[self.modulation]

    @property
    def raw_rate_gbps(self) -> float:
        return self.lanes * self.lane_rate_gbps

    @property
    def nyquist_ghz(self) -> float:
        return self.baud_gbd / 2

    @property
    def is_copper(self) -> bool:
        return self.medium == "copper"


class UnknownPortType(ValueError):
    """A port type that is not in the catalogue; the message suggests close names."""

    def __init__(self, name: str, suggestions: list[str]):
        self.name = name
        self.suggestions = suggestions
        if suggestions:
            hint = "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
        else:
            hint = " (list the known ones with: testbed phy --list)"
        super().__init__(f"unknown port type {name!r}{hint}")


def _copper(name: str, lanes: int, modulation: Modulation, baud: float, lane: float,
            mac: int, fec: Fec, reach: float, fec_delay_ns: float, standard: str,
            notes: str = "") -> PortType:
    # Passive DAC: no electronics in the cable beyond the ID EEPROM.
    return PortType(name, "copper", lanes, modulation, baud, lane, mac, fec, reach,
                    power_w=0.1, fec_delay_ns=fec_delay_ns, standard=standard, notes=notes)


def _optic(name: str, medium: Medium, lanes: int, modulation: Modulation, baud: float,
           lane: float, mac: int, fec: Fec, reach: float, power_w: float, fec_delay_ns: float,
           nominal_ber: float, standard: str, notes: str = "") -> PortType:
    return PortType(name, medium, lanes, modulation, baud, lane, mac, fec, reach, power_w,
                    fec_delay_ns, standard, nominal_ber=nominal_ber, notes=notes)


# FEC + DSP delay per hop (docs/phy.md, "Delay"): KP4 with a PAM4 DSP receiver
# 110 ns (the middle of the 100-120 ns usually quoted); KR4 at 100G over NRZ (no
# ADC/DSP) 90 ns; RS(528,514) on a single 25G lane 250 ns, because filling one
# 5280-bit codeword at 25.78 Gb/s alone takes 205 ns.
_KP4_NS = 110.0
_KR4_100G_NS = 90.0
_RS528_25G_NS = 250.0

# Nominal in-spec pre-FEC BER of optics (typical modules, not spec limits).
_NRZ_OPTIC_BER = 1e-8
_PAM4_50G_OPTIC_BER = 1e-7
_PAM4_100G_OPTIC_BER = 1e-6
_PAM4_200G_OPTIC_BER = 1e-6

_ALL: list[PortType] = [
    # 25 Gb/s per lane, NRZ, RS(528,514) (Clause 108 for 25G, Clause 91 for 100G).
    _copper("25GBASE-CR", 1, "NRZ", 25.78125, 25.78125, 25, KR4, 5.0, _RS528_25G_NS,
            "IEEE 802.3by", notes="5 m with RS-FEC (25GBASE-CR-S: 3 m, BASE-R FEC)"),
    _optic("25GBASE-SR", "mmf", 1, "NRZ", 25.78125, 25.78125, 25, KR4, 100.0, 1.0,
           _RS528_25G_NS, _NRZ_OPTIC_BER, "IEEE 802.3by", notes="100 m OM4, 70 m OM3"),
    _copper("100GBASE-CR4", 4, "NRZ", 25.78125, 25.78125, 100, KR4, 5.0, _KR4_100G_NS,
            "IEEE 802.3bj"),
    _optic("100GBASE-SR4", "mmf", 4, "NRZ", 25.78125, 25.78125, 100, KR4, 100.0, 2.5,
           _KR4_100G_NS, _NRZ_OPTIC_BER, "IEEE 802.3bm", notes="100 m OM4, 70 m OM3"),
    # 100 Gb/s per lane, PAM4, KP4.
    _copper("100GBASE-CR1", 1, "PAM4", 53.125, 106.25, 100, KP4, 2.0, _KP4_NS,
            "IEEE 802.3ck"),
    _optic("100GBASE-DR", "smf", 1, "PAM4", 53.125, 106.25, 100, KP4, 500.0, 4.0,
           _KP4_NS, _PAM4_100G_OPTIC_BER, "IEEE 802.3cd"),
    # 50 Gb/s per lane, PAM4, KP4.
    _copper("200GBASE-CR4", 4, "PAM4", 26.5625, 53.125, 200, KP4, 3.0, _KP4_NS,
            "IEEE 802.3cd"),
    _optic("200GBASE-SR4", "mmf", 4, "PAM4", 26.5625, 53.125, 200, KP4, 100.0, 5.0,
           _KP4_NS, _PAM4_50G_OPTIC_BER, "IEEE 802.3cd", notes="100 m OM4, 70 m OM3"),
    _optic("200GBASE-DR4", "smf", 4, "PAM4", 26.5625, 53.125, 200, KP4, 500.0, 6.5,
           _KP4_NS, _PAM4_50G_OPTIC_BER, "IEEE 802.3bs"),
    _copper("400GBASE-CR8", 8, "PAM4", 26.5625, 53.125, 400, KP4, 3.0, _KP4_NS,
            "industry name (QSFP-DD/OSFP 8x50G DAC) [check: no 802.3 PMD clause found]"),
    _optic("400GBASE-SR8", "mmf", 8, "PAM4", 26.5625, 53.125, 400, KP4, 100.0, 10.0,
           _KP4_NS, _PAM4_50G_OPTIC_BER, "IEEE 802.3cm", notes="100 m OM4, 70 m OM3"),
    # 400G on 100 Gb/s lanes.
    _copper("400GBASE-CR4", 4, "PAM4", 53.125, 106.25, 400, KP4, 2.0, _KP4_NS,
            "IEEE 802.3ck"),
    _optic("400GBASE-DR4", "smf", 4, "PAM4", 53.125, 106.25, 400, KP4, 500.0, 8.5,
           _KP4_NS, _PAM4_100G_OPTIC_BER, "IEEE 802.3bs"),
    _optic("400GBASE-FR4", "smf", 4, "PAM4", 53.125, 106.25, 400, KP4, 2000.0, 10.0,
           _KP4_NS, _PAM4_100G_OPTIC_BER, "IEEE 802.3cu", notes="4 CWDM wavelengths"),
    _optic("400GBASE-LR4-6", "smf", 4, "PAM4", 53.125, 106.25, 400, KP4, 6000.0, 11.0,
           _KP4_NS, _PAM4_100G_OPTIC_BER, "IEEE 802.3cu",
           notes="4 CWDM wavelengths; the 10 km 400G-LR4-10 is an MSA part, not 802.3"),
    # 800G on 100 Gb/s lanes.
    _copper("800GBASE-CR8", 8, "PAM4", 53.125, 106.25, 800, KP4, 2.0, _KP4_NS,
            "IEEE 802.3df"),
    _optic("800GBASE-DR8", "smf", 8, "PAM4", 53.125, 106.25, 800, KP4, 500.0, 16.0,
           _KP4_NS, _PAM4_100G_OPTIC_BER, "IEEE 802.3df"),
    # 1.6T on 200 Gb/s lanes.
    _copper("1.6TBASE-CR8", 8, "PAM4", 106.25, 212.5, 1600, KP4, 1.0, _KP4_NS,
            "IEEE 802.3dj"),
    _optic("1.6TBASE-DR8", "smf", 8, "PAM4", 106.25, 212.5, 1600, KP4, 500.0, 25.0,
           _KP4_NS, _PAM4_200G_OPTIC_BER, "IEEE 802.3dj",
           notes="802.3dj adds a Hamming(128,120)-based inner FEC on 200G/lane optics, "
                 "which raises the optical symbol rate; not modelled (figures are the "
                 "end-to-end KP4 ones)"),
]

PORT_TYPES: dict[str, PortType] = {p.name: p for p in _ALL}


def suggest_port_types(name: str, known: list[str] | None = None) -> list[str]:
    """The closest catalogue names to `name` (difflib), best first; at most three.

    Only names about as close as the best one are kept, so '400G-DR4' suggests
    '400GBASE-DR4' and not every 400G type.
    """
    known = list(PORT_TYPES) if known is None else known
    by_upper = {k.upper(): k for k in known}
    target = name.strip().upper()
    scored = sorted(
        ((difflib.SequenceMatcher(None, target, k).ratio(), k) for k in by_upper),
        key=lambda pair: (-pair[0], pair[1]),
    )
    if not scored or scored[0][0] < 0.5:
        return []
    best = scored[0][0]
    return [by_upper[k] for ratio, k in scored[:3] if ratio >= best - 0.05]


def get_port_type(name: str) -> PortType:
    """The catalogue entry for `name` (exact IEEE spelling); UnknownPortType otherwise."""
    try:
        return PORT_TYPES[name]
    except (KeyError, TypeError):
        raise UnknownPortType(str(name), suggest_port_types(str(name))) from None
