"""Collective workers: one process per rank of a communicator (`python -m agents.collectives`).

- `transport`: what the algorithms need of the network, `Transport` (tagged, ordered
  point-to-point messages between ranks);
- `algorithms`: all-reduce (ring, recursive halving-doubling, double binary tree),
  reduce-scatter, all-gather, broadcast and all-to-all over a Transport, on numpy buffers;
- `data`: dtypes, reduction operators, the exact references and error bounds (`#wrong`);
- `ina`: the in-network all-reduce through `python -m agents.aggregator` (docs/ina.md):
  `allreduce_ina`, its pure state machine `InaWorker`, the quantisation and its bound.
"""
