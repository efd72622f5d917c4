"""Workload kinds: what a run drives on the fabric, one module per kind.

`testbed.workloads.registry.REGISTRY` holds them; `base.WorkloadKind` says what a kind
declares (config model, stream expansion, agent argv, readiness, result rows, fidelity
checks, docs). testbed/workloads/udp.py and roce.py are the built-in kinds; a new kind is
a module beside them and one `REGISTRY.add(...)` line in registry.py.
"""
