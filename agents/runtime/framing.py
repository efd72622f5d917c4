"""What a datagram costs on the Ethernet wire beyond its UDP payload.

The agents pace and report WIRE rates (what a port's line rate is spent on),
so every packet is charged its UDP payload plus this fixed overhead. The UDP
agent's --wire-overhead-bytes defaults to it; the RoCE transport charges it per
packet to its pacer and its congestion control; the control plane uses it to
turn received payload bytes into wire rates.
"""

from __future__ import annotations

#: Bytes an IPv4 UDP datagram costs on an Ethernet wire beyond its UDP payload:
#: 8 UDP header + 20 IPv4 header (no options) + 14 Ethernet header + 4 FCS
#: + 8 preamble/SFD + 12 inter-frame gap = 66 (no VLAN tag).
WIRE_OVERHEAD_BYTES = 8 + 20 + 14 + 4 + 8 + 12
