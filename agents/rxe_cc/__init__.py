"""DCQCN around kernel Soft-RoCE (rdma_rxe): `python -m agents.rxe_cc` (docs/rxe-cc.md).

- `agents.rxe_cc.logic`: the pure parts (notification point from CE counts, reaction
  point from CNP counts, the class-rate limiter, the CNP frame);
- `agents.rxe_cc.maps`: the counters of testbed/net/bpf/rxe_cc.bpf.c;
- `agents.rxe_cc.__main__`: the agent.
"""
