"""The in-network aggregator (`python -m agents.aggregator`): a switch ALU in software.

- `logic`: the pure ALU model (jobs, slot pools with shadow copies, trees, counters);
- `__main__`: the UDP server that runs it in a switch's namespace.

Its packets are `agents.wire.ina`'s; the workers' side is `agents.collectives.ina`.
"""
