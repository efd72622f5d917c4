"""The collective kind's packet accounts for the run's conservation invariant
(testbed/run/invariants.py): what every stream of a collective entry sent, what arrived,
and what the fabric dropped on its flow, from the counters its agents report.

A collective's streams are not one agent's each, so they are named by their ends:

- `<entry> r<i>->r<j>`: everything rank i's RoCE endpoint sent to rank j's, on the one
  UDP flow between their ports: rank i's data packets (retransmissions included) AND its
  ACKs, NAKs and CNPs for rank j's data, since both directions of an RC QP share the
  ports. Counting only data would leave a lost ACK without a place, as the flow's drops
  include it. Sent is the sum over rank i's QPs to j of `packets_sent` (every packet the
  QP put out), received the sum over rank j's QPs to i of `packets_received` (every
  packet handed to them). A datagram rank j's endpoint took but gave to no QP (malformed,
  an unknown QPN, a wrong peer) is counted per endpoint, not per sender: it is the
  account's `socket_drops`, shared out over the streams into rank j that miss packets.
  Out-of-order drops with nothing lost on the flow are reordering, as for RoCE entries.
- `<entry> r<i>->r<j>` with transport: uet (`uet_accounts`): every datagram rank i's UET
  NIC sent to rank j's UDP 4793, from its PDC counters (requests, retransmissions
  included, ACKs, NACKs, CREDIT and CREDIT_REQ), against what rank j's NIC took from rank
  i, and the fabric's drops on those flows over every source port (the packets are
  sprayed). Out-of-order arrival is spraying's, never counted as reordering.
- `<entry> r<i>->agg@<switch>` and `<entry> agg@<switch>->r<i>` (algorithm ina): a rank's
  REQUESTs to its leaf aggregator (its `ina.packets_sent`; the aggregator's
  `peers[ip:port].received`), and the RESULTs back (the aggregator's `sent`; the rank's
  `ina.packets_received`).
- `<entry> agg@<leaf>->agg@<root>` and back: a leaf's PARTIALs up, the root's RESULTs down.

An INA account's `discarded` is what its receiver took in and refused (an aggregator:
malformed, an unknown job, a drop reason such as stale; a rank: foreign, bad or stale
results): received and then refused is not lost, so it is beside the account, not in
it. Datagrams from addresses the job does not configure (a non-member's) belong to no
stream; the aggregator's fidelity notes name them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from testbed.workloads.base import AgentSpec, Results, RunView, account, arg_of, flow_drops_of


@dataclass(frozen=True)
class _Peer:
    ip: str
    udp: int


def _peers(argv: Sequence[str]) -> list[_Peer]:
    """Each rank's RoCE address from a rank's --peers (IP:TCPPORT:UDPPORT,...)."""
    out = []
    for item in (arg_of(argv, "--peers") or "").split(","):
        ip, _tcp, udp = item.rsplit(":", 2)
        out.append(_Peer(ip, int(udp)))
    return out


def _addr(text: str) -> tuple[str, int]:
    ip, _, port = text.rpartition(":")
    return ip, int(port)


def _qps(res: dict, peer: int) -> list[dict]:
    per_peer = ((res.get("counters") or {}).get("per_peer") or {}).get(str(peer)) or {}
    return list((per_peer.get("qps") or {}).values())


def _endpoint_drops(res: dict) -> int:
    """Datagrams a rank's endpoint received and handed to no QP."""
    ep = (res.get("counters") or {}).get("endpoint") or {}
    return (sum(int(v) for v in (ep.get("malformed") or {}).values())
            + int(ep.get("unknown_qp", 0)) + int(ep.get("wrong_peer", 0)))


def roce_accounts(traffic: str, kind: str, ranks: Sequence[AgentSpec], results: Results,
                  flow_drops: Sequence[dict]) -> list[dict]:
    """One account per ordered pair of ranks (`ranks` in rank order)."""
    if not ranks:
        return []
    peers = _peers(ranks[0].argv)
    res = [results.get(s.name) or {} for s in ranks]
    out: list[dict] = []
    missing: dict[int, list[tuple[dict, int]]] = {}
    for i, src in enumerate(ranks):
        for j, dst in enumerate(ranks):
            if i == j:
                continue
            mine, theirs = _qps(res[i], j), _qps(res[j], i)
            sent = sum(int(q.get("packets_sent", 0)) for q in mine)
            received = sum(int(q.get("packets_received", 0)) for q in theirs)
            ooo = sum(int((q.get("responder") or {}).get("ooo_drops", 0)) for q in theirs)
            sports = {int(q["sport"]) for q in mine if "sport" in q} or {peers[i].udp}
            drops = flow_drops_of(flow_drops, {peers[i].ip}, peers[j].ip, peers[j].udp,
                                  sports)
            drops["injected"] = sum(int(q.get("injected_drops", 0)) for q in mine)
            a = account(f"{traffic} r{i}->r{j}", kind, src.node, dst.node, sent=sent,
                        received=received, drops=drops,
                        reordered=0 if any(drops.values()) else ooo,
                        complete=bool(res[i] and res[j]))
            a["socket_drops"] = 0
            out.append(a)
            short = sent - received - a["fabric_drops"]
            if short > 0:
                missing.setdefault(j, []).append((a, short))
    for j, items in missing.items():
        budget = _endpoint_drops(res[j])
        for a, short in sorted(items, key=lambda x: -x[1]):
            a["socket_drops"] = min(budget, short)
            budget -= a["socket_drops"]
    return out


@dataclass(frozen=True)
class _Aggregator:
    spec: AgentSpec
    port: int
    job: dict
    parent: tuple[str, int] | None
    peers: dict[str, dict]          # "ip:port" -> {received, discarded, sent}
    reported: bool


def _aggregator(spec: AgentSpec, results: Results) -> _Aggregator:
    res = results.get(spec.name) or {}
    parent = arg_of(spec.argv, "--parent")
    (job,) = json.loads(arg_of(spec.argv, "--jobs") or "[]")    # one job per aggregator
    return _Aggregator(spec, int(arg_of(spec.argv, "--port") or 0), job,
                       _addr(parent) if parent else None, res.get("peers") or {}, bool(res))


# What a rank's aggregation socket received and did not take: not its job's RESULT from
# its aggregator, a result that fits no chunk sent, a result of no chunk of this call
# (agents.collectives.ina.WorkerCounters; repeats of a result it has are not counted).
_RANK_DISCARDS = ("foreign", "bad_results", "stale_results")


def _ina_account(name: str, kind: str, src: str, dst: str, *, sent: int, received: int,
                 drops: dict[str, int], complete: bool, discarded: int) -> dict:
    a = account(name, kind, src, dst, sent=sent, received=received, drops=drops,
                reordered=0, complete=complete)
    a["discarded"] = discarded
    return a


def ina_accounts(traffic: str, kind: str, ranks: Sequence[AgentSpec],
                 aggregators: Sequence[AgentSpec], results: Results,
                 flow_drops: Sequence[dict], view: RunView) -> list[dict]:
    """Both ways between each rank and its leaf aggregator, and each leaf and the root."""
    aggs = [_aggregator(s, results) for s in aggregators]
    out: list[dict] = []
    for agg in aggs:
        me = f"agg@{agg.spec.node}"
        for rank, ip, port in agg.job.get("members", []):
            spec = ranks[rank]
            res = results.get(spec.name) or {}
            ina = (res.get("counters") or {}).get("ina") or {}
            peer = agg.peers.get(f"{ip}:{port}") or {}
            agg_ip, agg_port = _addr(arg_of(spec.argv, "--aggregator") or ":0")
            done = bool(res) and agg.reported
            out.append(_ina_account(
                f"{traffic} r{rank}->{me}", kind, spec.node, agg.spec.node,
                sent=int(ina.get("packets_sent", 0)), received=int(peer.get("received", 0)),
                drops=flow_drops_of(flow_drops, {ip}, agg_ip, agg_port, {port}),
                complete=done, discarded=int(peer.get("discarded", 0))))
            out.append(_ina_account(
                f"{traffic} {me}->r{rank}", kind, agg.spec.node, spec.node,
                sent=int(peer.get("sent", 0)), received=int(ina.get("packets_received", 0)),
                drops=flow_drops_of(flow_drops, view.addresses(agg.spec.node), ip, port,
                                    {agg.port}),
                complete=done, discarded=sum(int(ina.get(k, 0)) for k in _RANK_DISCARDS)))
        for child_id, ip, port in agg.job.get("children", []):
            child = next((c for c in aggs if c.port == port and c.parent is not None
                          and c.job.get("uplink_id") == child_id
                          and ip in view.addresses(c.spec.node)), None)
            if child is None or child.parent is None:
                continue
            up = child.peers.get(f"{child.parent[0]}:{child.parent[1]}") or {}
            down = agg.peers.get(f"{ip}:{port}") or {}
            done = child.reported and agg.reported
            them = f"agg@{child.spec.node}"
            out.append(_ina_account(
                f"{traffic} {them}->{me}", kind, child.spec.node, agg.spec.node,
                sent=int(up.get("sent", 0)), received=int(down.get("received", 0)),
                drops=flow_drops_of(flow_drops, view.addresses(child.spec.node),
                                    child.parent[0], child.parent[1], {port}),
                complete=done, discarded=int(down.get("discarded", 0))))
            out.append(_ina_account(
                f"{traffic} {me}->{them}", kind, agg.spec.node, child.spec.node,
                sent=int(down.get("sent", 0)), received=int(up.get("received", 0)),
                drops=flow_drops_of(flow_drops, view.addresses(agg.spec.node), ip, port,
                                    {agg.port}),
                complete=done, discarded=int(up.get("discarded", 0))))
    return out


def _pdc(res: dict, peer_ip: str) -> dict:
    """A UET rank's NIC counters of its PDC to `peer_ip` (UetTransport.counters)."""
    return (((res.get("counters") or {}).get("uet") or {}).get("pdcs") or {}).get(peer_ip) or {}


def _n(c: dict, key: str) -> int:
    v = c.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0


#: What a UET NIC sends a peer, by its PDC counters: requests (data, retransmissions
#: included), ACKs, NACKs, CREDIT grants, CREDIT_REQs; all to the peer's UDP 4793.
UET_SENT = ("tx_packets", "acks_sent", "nacks_sent", "credits_granted", "credit_reqs_sent")
#: What it takes from a peer: requests, ACKs, NACKs, CREDITs, and packets with the wrong
#: PDC ids (received, then refused).
UET_RECEIVED = ("rx_packets", "acks_received", "nacks_received", "credits_received",
                "bad_pdcid")


def uet_accounts(traffic: str, kind: str, ranks: Sequence[AgentSpec], results: Results,
                 flow_drops: Sequence[dict]) -> list[dict]:
    """transport: uet: one account per ordered pair of ranks, `<entry> r<i>->r<j>`: every
    datagram rank i's NIC sent to rank j's UDP 4793 (requests, ACKs, NACKs, credit: both
    directions of a PDC pair share the port, so a lost ACK has its place), what rank j's
    NIC took from rank i, and the fabric's drops on those flows, over every source port
    (the packets are sprayed). A CREDIT_REQ has no receive counter: it is taken as
    received (they are rare, one per base RTT of a sender blocked on credit). Datagrams
    rank j's receive socket overflowed on or could not parse are its `socket_drops`,
    shared over the streams into it that miss packets. Out-of-order arrival is what
    spraying does, so none of it is counted as the emulator's reordering."""
    if not ranks:
        return []
    peers = _peers(ranks[0].argv)
    res = [results.get(s.name) or {} for s in ranks]
    out: list[dict] = []
    missing: dict[int, list[tuple[dict, int]]] = {}
    for i, src in enumerate(ranks):
        for j, dst in enumerate(ranks):
            if i == j:
                continue
            mine, theirs = _pdc(res[i], peers[j].ip), _pdc(res[j], peers[i].ip)
            sent = sum(_n(mine, k) for k in UET_SENT)
            received = (sum(_n(theirs, k) for k in UET_RECEIVED)
                        + _n(mine, "credit_reqs_sent"))
            drops = flow_drops_of(flow_drops, {peers[i].ip}, peers[j].ip, peers[j].udp, None)
            drops["injected"] = _n(mine, "injected_drops")
            a = account(f"{traffic} r{i}->r{j}", kind, src.node, dst.node, sent=sent,
                        received=received, drops=drops, reordered=0,
                        complete=bool(res[i] and res[j]))
            a["socket_drops"] = 0
            out.append(a)
            short = sent - received - a["fabric_drops"]
            if short > 0:
                missing.setdefault(j, []).append((a, short))
    # datagrams rank j's receive socket dropped before the NIC read them (SO_RXQ_OVFL), or
    # read and could not parse: the host's, not a stream's; shared out over the short ones
    for j, items in missing.items():
        sockets = ((res[j].get("counters") or {}).get("uet") or {}).get("sockets") or {}
        budget = _n(sockets, "overflow_drops") + sum(
            int(v) for v in (sockets.get("malformed") or {}).values())
        for a, short in sorted(items, key=lambda x: -x[1]):
            a["socket_drops"] = min(budget, short)
            budget -= a["socket_drops"]
    return out
