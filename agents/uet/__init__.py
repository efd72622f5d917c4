"""Ultra Ethernet transport (UET) endpoints in user space over UDP 4793.

The packet delivery sublayer's reliable unordered mode (RUD) with per-packet entropy
(spraying over ECMP), selective ACK and retransmission, NACKs for packets a switch trimmed,
and two congestion controls, sender-based (NSCC-style) and receiver credit (EQDS-style):
`pds` (reliability), `ses` (WRITE/SEND messages), `entropy` (source-port choice), `cc`
(congestion control), `nic` (sockets and engine), and the host agent in `__main__`.
Wire formats are in `agents.wire.uet`. docs/uet.md describes the whole from the user's
side; docs/uet-transport.md the transport (state machines, timers, sockets, counters,
deviations from UEC 1.0), docs/uet-cc.md the congestion control, docs/uet-wire.md the
packets.
"""
