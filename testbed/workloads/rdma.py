"""What every workload kind over the user-space RoCE transport shares: the in-flight
window rule, the congestion-control presets (named by the agents' own tables) and the
agents' common transport flags. A shared module, not a kind: any RDMA kind imports it."""

from __future__ import annotations

from fractions import Fraction as Exact
from typing import Annotated

from pydantic import WithJsonSchema
from pydantic_core import PydanticCustomError

from agents.rdma.cc import DCQCN_PRESET_NAMES, DCTCP_PRESET_NAMES

# agents.rdma.qp.MAX_WINDOW_PACKETS: the most unacknowledged packets a QP may have.
MAX_ROCE_WINDOW_PACKETS = 1 << 22
# The auto window is never below rxe's RXE_MAX_UNACKED_PSNS (what the transport had
# before the window was sized to the fabric) and never above what the transport allows.
ROCE_MIN_WINDOW_PACKETS = 128
ROCE_MAX_WINDOW_PACKETS = MAX_ROCE_WINDOW_PACKETS      # 2^22
# Wall seconds either side may wait for the other during set-up and tear-down.
ROCE_CONNECT_TIMEOUT_S = 30
# The agents' event loops sleep until each event instead of busy-polling the last
# 150 us: a run has a dozen or more agents on a few cores, where spinning clients
# starve the PFC agents (drops in the lossless class were seen), and at run
# dilations select's wake-up error is a few fabric ns.
ROCE_SPIN_NS = 0

# The agents' preset tables name the presets (agents.rdma.cc, standard library only, so the
# config imports it cheaply); a kind's checks pair a preset with its `cc`.
PRESETS_OF_CC = {"dcqcn": DCQCN_PRESET_NAMES, "dctcp": DCTCP_PRESET_NAMES}
CC_PRESET_NAMES = tuple(dict.fromkeys(n for names in PRESETS_OF_CC.values() for n in names))
CcPresetName = Annotated[str, WithJsonSchema({"type": "string", "enum": list(CC_PRESET_NAMES)})]
# hpcc-ns3-paper (HPCC run.py's dcqcn_paper) is the half of the setting whose switch marking
# the default port class uses; docs/config.md says why it, not run.py's dcqcn, is the default.
DEFAULT_CC_PRESETS = {"dcqcn": "hpcc-ns3-paper", "dctcp": "rfc8257"}
CC_PRESET_DESCRIPTION = "parameter set, one of the agents' presets: " + "; ".join(
    f"{cc.upper()} {', '.join(names)} (default {DEFAULT_CC_PRESETS[cc]})"
    for cc, names in PRESETS_OF_CC.items())


def parse_cc_preset(value: object) -> object:
    """A preset name the agents have, or None; worded as the literal it stands for
    (testbed.config renders literal errors)."""
    if value is None or value in CC_PRESET_NAMES:
        return value
    expected = ", ".join(repr(n) for n in CC_PRESET_NAMES[:-1]) + f" or {CC_PRESET_NAMES[-1]!r}"
    raise PydanticCustomError("literal_error", "Input should be {expected}",
                              {"expected": expected})


def preset_problem(cc: str, preset: str | None) -> tuple[str, str] | None:
    """(field, message) when `preset` does not go with `cc`, else None."""
    presets = {k: tuple(sorted(names)) for k, names in PRESETS_OF_CC.items()}
    if cc == "none" and preset is not None:
        return "cc_preset", (f"cc_preset {preset!r} does nothing with cc: none; remove it or "
                             "pick cc: dcqcn or dctcp")
    if preset is not None and preset not in presets[cc]:
        owner = next(k for k, names in presets.items() if preset in names)
        return "cc_preset", (f"{preset!r} is not a {cc.upper()} preset (it is "
                             f"{owner.upper()}'s); {cc.upper()} presets are "
                             f"{', '.join(presets[cc])}")
    return None


def roce_window_packets(line_rate_bps: int, round_trip_ns: Exact, mtu_bytes: int) -> int:
    """The default in-flight window: RoCE MTU packets that a sender at `line_rate_bps` puts
    on the wire in `round_trip_ns` (the fabric's longest round trip for the class),
    rounded up, within [ROCE_MIN_WINDOW_PACKETS, ROCE_MAX_WINDOW_PACKETS]."""
    bits = line_rate_bps * round_trip_ns / 10**9
    packets = -(-bits // (8 * mtu_bytes))
    return int(min(ROCE_MAX_WINDOW_PACKETS, max(ROCE_MIN_WINDOW_PACKETS, packets)))
