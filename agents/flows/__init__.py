"""Sized flows over the user-space RoCEv2 RC transport: one agent per host that sends the
host's flows on schedule and receives the flows sent to it (`python -m agents.flows`).

Each flow is one RDMA WRITE with immediate on a QP of its own, as HPCC's ns-3 makes one
queue pair per flow: the QP's rate controller starts at line rate (DCQCN's and DCTCP's
initial state) and its UDP source port is its own, so ECMP hashes each flow on its own.
A pool of long-lived QPs would carry one flow's congestion state into the next and put
many flows on one path; the FCTs would then measure the pool, not the fabric.
"""
