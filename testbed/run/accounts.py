"""Per-stream packet accounts of a run: what each stream sent, what arrived, what was
dropped on its flow and where. Pure: from the workload's agent specs, the agents'
results and the port programs' drops by flow (testbed/net/counters.datapath_snapshot).

A stream is one sender -> receiver pair of a workload entry: a UDP sender's flows
(its source ports) into one receiver port, or a RoCE client's QPs (their source
ports) into one server's UDP port. The conservation invariant
(testbed/run/invariants.py) compares sent with received + counted losses.
"""

from __future__ import annotations

from testbed.plan.model import Plan
from testbed.run.workload import AgentSpec, address_of

UDP = 17


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _addresses(plan: Plan, host: str) -> set[str]:
    """Every address of a host: a multi-homed sender's datagrams leave with the address
    of the NIC its route picked."""
    return {i.address.split("/")[0] for i in plan.node(host).interfaces}


def _drops(flows: list[dict], saddrs: set[str], daddr: str, dport: int,
           sports: set[int] | None) -> dict[str, int]:
    out = {"phy": 0, "tail": 0, "mmu": 0, "desc": 0}
    for f in flows:
        if (f["saddr"] not in saddrs or (f["daddr"], f["dport"], f["proto"])
                != (daddr, dport, UDP)):
            continue
        if sports is not None and f["sport"] not in sports:
            continue
        for k in out:
            out[k] += f[k]
    return out


def stream_accounts(plan: Plan, agents: list[tuple[AgentSpec, object]], results: dict,
                    flow_drops: list[dict]) -> list[dict]:
    """One account per stream: name, kind, src, dst, sent, received, fabric_drops (and by
    cause), reordered, lost_counted."""
    out: list[dict] = []
    specs = [s for s, _ in agents]
    receivers = {(s.traffic, s.dst): s for s in specs
                 if s.role == "receiver" and s.module != "agents.roce"}
    servers = {(s.traffic, s.src, s.dst): s for s in specs
               if s.role == "receiver" and s.module == "agents.roce"}
    for spec in specs:
        if spec.role != "sender":
            continue
        res = results.get(spec.name) or {}
        src_ips, dst_ip = _addresses(plan, spec.src), address_of(plan, spec.dst)
        if spec.module == "agents.roce":
            srv = servers.get((spec.traffic, spec.src, spec.dst))
            srv_res = (results.get(srv.name) if srv else None) or {}
            dport = int(_arg(srv.argv, "--roce-port") or 4791) if srv else 4791
            qps = (res.get("qps") or {}).values()
            sent = sum(int(q.get("requester", {}).get("packets_sent", 0)) for q in qps)
            sports = {int(q["sport"]) for q in qps if "sport" in q}
            injected = sum(int(q.get("injected_drops", 0)) for q in qps)
            srv_qps = (srv_res.get("qps") or {}).values()
            received = sum(int(q.get("responder", {}).get("packets_received", 0))
                           for q in srv_qps)
            ooo = sum(int(q.get("responder", {}).get("ooo_drops", 0)) for q in srv_qps)
            drops = _drops(flow_drops, src_ips, dst_ip, dport, sports or None)
            drops["injected"] = injected
            lost = sum(drops.values())
            # out-of-order arrivals follow every loss until go-back-N resends: only
            # with nothing lost on the flow are they the emulator reordering
            reordered = ooo if not lost else 0
            out.append({"name": spec.name, "kind": spec.kind, "src": spec.src,
                        "dst": spec.dst, "sent": sent, "received": received,
                        "fabric_drops": lost, "drops": drops, "reordered": reordered,
                        "lost_counted": lost > 0, "complete": bool(res and srv_res)})
            continue
        recv = receivers.get((spec.traffic, spec.dst))
        recv_res = (results.get(recv.name) if recv else None) or {}
        dport = int(_arg(spec.argv, "--dport") or 0)
        flows = (res.get("flows") or {}).values()
        sports = {int(f["sport"]) for f in flows if "sport" in f}
        sent = sum(int(f.get("packets", 0)) for f in flows)
        received = reordered = 0
        for key, f in (recv_res.get("flows") or {}).items():
            ip, _, rest = key.partition(":")
            sport = int(rest.split("/")[0]) if rest.split("/")[0].isdigit() else -1
            if ip in src_ips and sport in sports:
                received += int(f.get("received", 0))
                reordered += int(f.get("reordered", 0))
        drops = _drops(flow_drops, src_ips, dst_ip, dport, sports or None)
        lost = sum(drops.values())
        out.append({"name": spec.name, "kind": spec.kind, "src": spec.src, "dst": spec.dst,
                    "sent": sent, "received": received, "fabric_drops": lost, "drops": drops,
                    "reordered": reordered, "lost_counted": lost > 0,
                    "complete": bool(res and recv_res)})
    return out
