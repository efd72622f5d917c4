"""PHY stage: port type + length -> link rate, delay, frame loss, power, warnings.

Pure functions; see docs/phy.md for the model and its sources.
"""

from testbed.phy.catalogue import (
    FEC_TYPES,
    KP4,
    KR4,
    PORT_TYPES,
    Fec,
    PortType,
    UnknownPortType,
    get_port_type,
    suggest_port_types,
)
from testbed.phy.model import (
    DEFAULT_ASSUMPTIONS,
    PAM4_SNR_PENALTY_DB,
    PhyAssumptions,
    PhyResult,
    codeword_error_probability,
    evaluate,
    pre_fec_ber,
    symbol_error_probability,
)

__all__ = [
    "DEFAULT_ASSUMPTIONS",
    "FEC_TYPES",
    "KP4",
    "KR4",
    "PAM4_SNR_PENALTY_DB",
    "PORT_TYPES",
    "Fec",
    "PhyAssumptions",
    "PhyResult",
    "PortType",
    "UnknownPortType",
    "codeword_error_probability",
    "evaluate",
    "get_port_type",
    "pre_fec_ber",
    "suggest_port_types",
    "symbol_error_probability",
]
