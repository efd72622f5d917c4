"""UDP traffic agent: paced sender, counting receiver, echo server and ping.

- `python -m agents.udp` (`agents.udp.__main__`): the program, sockets and modes;
- `agents.udp.logic`: its pure parts (probe header, pacer, sequence accounting).
"""
