"""A scapy layer for the in-network aggregation header (agents.wire.ina), for tests and
for decoding captures: `INA` is bound to UDP port agents.wire.ina.INA_UDP_PORT (either
direction), so `rdpcap(...)` or `Ether(raw)` decodes it by itself. Agents never import
this module: scapy is for tests and captures only.

    from tests.ina_scapy import INA, bind_port
    bind_port(49000)                  # an aggregator on another port
    pkt = IP(raw_bytes); pkt[INA].chunk, pkt[INA].values
"""

from __future__ import annotations

from scapy.fields import (
    BitField,
    ByteEnumField,
    ByteField,
    FieldListField,
    IntField,
    LongField,
    ShortField,
    SignedIntField,
    SignedShortField,
    XByteField,
    XShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from agents.wire.ina import INA_UDP_PORT, MAGIC, VERSION, PacketType


class INA(Packet):
    name = "INA"
    fields_desc = [
        XShortField("magic", MAGIC),
        ByteField("version", VERSION),
        ByteEnumField("type", int(PacketType.REQUEST), {int(t): t.name for t in PacketType}),
        IntField("job", 0),
        IntField("chunk", 0),
        ShortField("slot", 0),
        BitField("flags_reserved", 0, 7),
        BitField("gen", 0, 1),
        XByteField("reserved", 0),
        XShortField("sender", 0),
        ShortField("elements", None),
        SignedShortField("exponent", 0),
        SignedShortField("next_exp", -32768),
        LongField("bitmap", 0),
        FieldListField("values", [], SignedIntField("", 0),
                       count_from=lambda pkt: pkt.elements),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.elements is None:        # filled in from the values, as build() does
            n = len(self.values)
            pkt = pkt[:18] + n.to_bytes(2, "big") + pkt[20:]
        return pkt + pay


def bind_port(port: int) -> None:
    """Decode UDP datagrams to or from `port` as INA too."""
    bind_layers(UDP, INA, dport=port)
    bind_layers(UDP, INA, sport=port)


bind_port(INA_UDP_PORT)
