"""User-space RoCE transport: RC queue pairs over UDP 4791, with DCQCN.

- `agents.roce.cc`: congestion control state machines (DCQCN RP/NP, DCTCP, no-CC);
- `agents.roce.qp`: the RC protocol, pure (requester, responder, memory regions, pacer);
- `agents.roce.transport`: sockets and the event loop (`Endpoint`, `Engine`);
- `agents.roce.perftest` and `python -m agents.roce`: write_bw, write_lat, send_bw.

docs/roce.md describes the design; docs/dcqcn.md the congestion control.
"""
