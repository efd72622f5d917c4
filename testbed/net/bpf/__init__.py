"""BPF sources of the data path. `testbed.net.portprog` compiles and loads the port
program; `testbed.net.rxecc` the rxe congestion counters (compiled the same way)."""

from pathlib import Path

PORT_SOURCE = Path(__file__).with_name("port.bpf.c")
RXE_CC_SOURCE = Path(__file__).with_name("rxe_cc.bpf.c")

__all__ = ["PORT_SOURCE", "RXE_CC_SOURCE"]
