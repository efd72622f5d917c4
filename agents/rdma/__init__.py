"""The user-space RoCEv2 transport: RC queue pairs over UDP 4791, with DCQCN.

A library, not an agent: the agents that move RDMA traffic (`agents.roce`'s
perftest tool, `agents.collectives`' workers) build on it.

- `agents.rdma.cc`: congestion control state machines (DCQCN RP/NP, DCTCP, no-CC);
- `agents.rdma.qp`: the RC protocol, pure (requester, responder, memory regions, pacer);
- `agents.rdma.transport`: sockets and the event loop (`Endpoint`, `Engine`).

docs/roce.md describes the design; docs/dcqcn.md the congestion control.
"""
