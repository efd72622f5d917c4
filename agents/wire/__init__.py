"""Wire formats shared by agents and tests: RoCEv2 packets (`roce`) and their ICRC
(`icrc`), Ultra Ethernet PDS/SES headers (`uet`; scapy layers for tests and pcaps in
`uet_scapy`, which agents do not import), PFC frames (`pfc`), in-network aggregation
packets (`ina`), netlink attributes (`netlink`)."""

from typing import TypeAlias

#: What the builders and parsers accept as bytes: anything they can slice and
#: memoryview() without copying. (numpy arrays qualify at run time; pass
#: `array.data` where a type checker reads along, since numpy declares the buffer
#: protocol to type checkers only for Python >= 3.12.)
BytesLike: TypeAlias = bytes | bytearray | memoryview
