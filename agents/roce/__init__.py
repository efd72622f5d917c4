"""perftest-style tests over the user-space RoCEv2 transport (`python -m agents.roce`).

- `agents.roce.perftest`: write_bw, write_lat and send_bw, their set-up and verification;
- `agents.roce.__main__`: the command line.

The transport itself (RC QPs, DCQCN, sockets and the event loop) is the shared
library `agents.rdma`, which other agents use too. docs/roce.md describes the design;
docs/dcqcn.md the congestion control.
"""
