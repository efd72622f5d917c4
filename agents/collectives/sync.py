"""How the ranks of a communicator keep in step over their transport (RoCE or UET): a
barrier before each timed operation, and leaving together at the end.

Shared by the collective benchmark (`python -m agents.collectives`) and the training-step
worker (`python -m agents.collectives.training`).
"""

from __future__ import annotations

import os
import time
from argparse import Namespace
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from agents.collectives.roce import RoceConfig, RoceTransport, TransportError, connect
from agents.collectives.transport import RankTransport
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import mark_ready

if TYPE_CHECKING:   # a RoCE rank never loads the UET NIC (~3 MB a process: bench/agent_memory.py)
    from agents.collectives import uet
    from agents.uet.nic import UetOptions

#: Tags at and above this are the worker's own (the barrier); algorithms use smaller ones.
BARRIER_TAG = 0xFFFFFF00
#: Wall seconds the rank keeps answering its peers after the last barrier (a duplicate
#: whose ACK was lost still gets one), before it closes its socket.
LINGER_S = 0.05
#: Wall seconds a finished rank waits for every peer to say it is done too (a peer
#: retransmitting its last message needs us there); a stuck peer does not hold us longer.
LEAVE_TIMEOUT_S = 30.0


def _ready(args: Namespace) -> Callable[[], None]:
    me = args.peer_list[args.rank]
    return lambda: mark_ready(args.ready_file, {
        "rank": args.rank, "tcp_port": me.tcp_port, "udp_port": me.udp_port,
        "pid": os.getpid()})


def open_transport(args: Namespace, life: Lifecycle) -> RoceTransport:
    """Connect this rank (`args.rank` of `args.peer_list`) to every other over the RoCE
    transport, marking its ready file once it listens for its peers' set-up."""
    config = RoceConfig(args=args, qps=args.qps, chunk_bytes=args.chunk_bytes,
                        dilation=args.dilation, connect_timeout_s=args.connect_timeout_s)
    return connect(args.rank, args.peer_list, config, should_stop=life.should_stop,
                   on_listening=_ready(args))


def open_uet_transport(args: Namespace, life: Lifecycle) -> uet.UetTransport:
    """The same over the UET transport: this rank's UET NIC (on its UDP port of
    --peers, 4793) from the worker's --uet-* flags, then the set-up connections."""
    from agents.collectives import uet

    config = uet.UetConfig(options=uet_options(args), chunk_bytes=args.chunk_bytes,
                           dilation=args.dilation, connect_timeout_s=args.connect_timeout_s,
                           udp_port=args.peer_list[args.rank].udp_port)
    return uet.connect(args.rank, args.peer_list, config, should_stop=life.should_stop,
                       on_listening=_ready(args))


def uet_options(args: Namespace) -> UetOptions:
    """The UET NIC's options (agents.uet.nic.UetOptions) from a worker's flags."""
    from agents.uet.nic import UetOptions

    return UetOptions(dscp=args.dscp, ecn=args.uet_ecn, cc=args.uet_cc,
                      entropy=args.uet_entropy, entropies=args.uet_entropies,
                      payload_bytes=args.uet_payload_bytes,
                      line_rate_bps=float(args.line_rate_bps),
                      base_rtt_ns=float(args.uet_base_rtt_ns), trim_dscp=args.uet_trim_dscp,
                      seed=args.seed, spin_ns=args.spin_ns)


def barrier(t: RankTransport, token: tuple[int, int]) -> None:
    """Dissemination barrier over the transport: ceil(log2 n) rounds; in round k a rank
    sends `token` to rank + 2^k and waits for the one from rank - 2^k, so no rank leaves
    before every rank has arrived, and ranks out of step (different tokens) are caught."""
    mine = np.array(token, dtype=np.int64)
    got = np.empty(2, dtype=np.int64)
    k, rnd = 1, 0
    while k < t.size:
        t.send((t.rank + k) % t.size, BARRIER_TAG + rnd, mine)
        t.recv((t.rank - k) % t.size, BARRIER_TAG + rnd, got)
        if not np.array_equal(got, mine):
            raise TransportError(f"rank {t.rank} at {token} met rank "
                                 f"{(t.rank - k) % t.size} at {tuple(got.tolist())}")
        k, rnd = k * 2, rnd + 1


def finish(t: RankTransport) -> None:
    """Leave together. Every send of ours acknowledged, a last barrier, and ours again;
    then a peer's last message to us may still wait for an ACK of ours that was lost,
    and only we can answer its retransmission. So we say 'done' over the set-up
    connection (reliable: TCP), and keep answering until every peer has said so too
    (its sends, ours included, acknowledged), or LEAVE_TIMEOUT_S; then a short linger."""
    t.wait_sends()
    barrier(t, (-1, -1))
    t.wait_sends()
    t.leave("done")
    deadline = time.monotonic() + LEAVE_TIMEOUT_S
    t.drive(lambda: t.peers_done() or time.monotonic() >= deadline)
    end = time.monotonic() + LINGER_S
    t.drive(lambda: time.monotonic() >= end)
