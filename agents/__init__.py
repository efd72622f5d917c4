"""Data plane: small programs that run inside the fabric's network namespaces.

Agents share wire formats (`agents.wire`) and the time base (`agents.timebase`)
with the control plane but never import the control plane's internals.
"""
