"""Data plane: small programs that run inside the fabric's network namespaces.

The agents, each a package run as `python -m agents.<name>`:

- `agents.udp`: paced UDP sender, counting receiver, echo server and ping;
- `agents.pfc`: a node's 802.1Qbb PFC, sending pauses and obeying them;
- `agents.roce`: perftest-style tests over a user-space RoCEv2 RC transport;
- `agents.collectives`: one rank of a collective benchmark (all-reduce, ...) over it.

What they share lives in packages of its own, never in another agent (no agent
imports another: tests/unit/test_agent_imports.py): `agents.runtime` (lifecycle,
control socket, ready file and counters, socket helpers, waiting, argparse
types, the wire overhead), `agents.rdma` (the user-space RoCEv2 transport: RC
QPs, DCQCN, sockets and event loop), `agents.wire` (wire formats), `agents.timebase`
(fabric versus wall time) and `agents.portmaps` (the port program's maps).
Agents never import the control plane; it imports the shared packages, and an
agent's public names where the two must agree (agents.rdma.cc's preset names).
"""
