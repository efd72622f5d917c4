"""BPF sources of the data path. `testbed.net.portprog` compiles and loads them."""

from pathlib import Path

PORT_SOURCE = Path(__file__).with_name("port.bpf.c")

__all__ = ["PORT_SOURCE"]
