"""What every agent needs and no agent owns: the shared agent runtime.

- `agents.runtime.control`: the live counter snapshot on a UNIX socket
  (--control-sock) and the client that reads it; commands to an agent
  (--command-sock: `serve_commands`, `send_command`, `CommandInbox`);
- `agents.runtime.output`: the ready file (--ready-file) and the final counters
  (stdout and --out);
- `agents.runtime.events`: the events file (--events), JSON lines written in
  batches off the data path, capped;
- `agents.runtime.framing`: WIRE_OVERHEAD_BYTES, what a datagram costs beyond its
  UDP payload on the Ethernet wire;
- `agents.runtime.argtypes`: argparse types of the agents' command lines;
- `agents.runtime.lifecycle`: stop on SIGTERM / SIGINT or when the parent dies;
- `agents.runtime.sockets`: TOS, timeouts, buffer sizes, retried sends;
- `agents.runtime.waiting`: sleep, then spin, until a wall-clock moment.

An agent (`agents.udp`, `agents.pfc`, `agents.roce`, `agents.aggregator`,
`agents.collectives`) may import this package, `agents.rdma`,
`agents.wire`, `agents.timebase` and `agents.portmaps`, never another agent
(tests/unit/test_agent_imports.py holds them to it).
"""
