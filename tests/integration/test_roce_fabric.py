"""The user-space RoCEv2 transport across a real emulated fabric.

One switch, three hosts on 100GBASE-CR1 (2 m), dilation 1000: a 100 Gb/s port
runs at 100 Mb/s of wall rate, so one 4 KB packet takes ~333 us of wall time
and 64 MiB take ~5.5 s. `python -m agents.roce` runs in the hosts' namespaces
(`ip netns exec NS ...`). The kernel here has no sch_netem, so loss is injected
by the client's hidden `--drop-prob` option: the packet is paced and counted
as sent but never handed to the socket, as if the wire had lost it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from testbed.net.counters import read_counters
from testbed.plan import Plan
from testbed.plan.paths import host_address
from tests.conftest import REPO
from tests.integration.conftest import built_lab

pytestmark = pytest.mark.root

D = 1000
MIB = 1 << 20
# 300 us of fabric time (0.3 s wall): a tail loss costs one of these; the RTT is a few us
TIMEOUT = ["--timeout-ns", "300000"]

FABRIC_YAML = """\
name: {name}
dilation: {d}
topology: {{kind: single_switch, hosts: 3, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
"""


@pytest.fixture(scope="module")
def fabric() -> Iterator[Plan]:
    with built_lab(FABRIC_YAML, "roce", d=D) as plan:
        yield plan


def _ns(plan: Plan, host: str) -> str:
    return plan.node(host).netns


def _ip(plan: Plan, host: str) -> str:
    return host_address(plan, host)


def _agent(plan: Plan, host: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", _ns(plan, host), sys.executable, "-m", "agents.roce", *argv]


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


class Pair:
    """A server on `server_host` and the client runs against it."""

    def __init__(self, plan: Plan, tmp_path, test: str, server_host: str = "h2",
                 port: int = 18515, roce_port: int = 4791, server_args=()) -> None:
        self.plan, self.test, self.server_host, self.port = plan, test, server_host, port
        ready = tmp_path / f"ready-{server_host}-{port}"
        self.server = subprocess.Popen(
            _agent(plan, server_host, "server", test, "--bind", _ip(plan, server_host),
                   "--port", str(port), "--roce-port", str(roce_port), "--dilation", str(D),
                   "--ready-file", str(ready), *TIMEOUT, *server_args),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"server not ready: {self.server.communicate()}")
            time.sleep(0.02)

    def client_argv(self, client_host: str, *args: str) -> list[str]:
        return _agent(self.plan, client_host, "client", self.test, "--server",
                      _ip(self.plan, self.server_host), "--port", str(self.port),
                      "--dilation", str(D), *TIMEOUT, *args)

    def finish(self, timeout: float = 120) -> dict:
        out, err = self.server.communicate(timeout=timeout)
        assert self.server.returncode == 0, err + out
        return _last_json(out)

    def kill(self) -> None:
        if self.server.poll() is None:
            self.server.kill()
            self.server.wait()


def _run_client(pair: Pair, client_host: str, *args: str, timeout: float = 300) -> tuple[dict, str]:
    res = subprocess.run(pair.client_argv(client_host, *args), cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr + res.stdout
    return _last_json(res.stdout), res.stderr


def _class_packets(plan: Plan, host: str, tc: int) -> int:
    _, classes = read_counters(plan)
    return sum(c.packets for c in classes if c.node == host and c.tc == tc)


def _qp(counters: dict) -> dict:
    (qp,) = counters["qps"].values()
    return qp


def test_64mib_rdma_write_crosses_the_fabric_byte_exact_at_line_rate(fabric, tmp_path):
    pair = Pair(fabric, tmp_path, "write_bw", port=18515)
    try:
        c, table = _run_client(pair, "h1", "--size", str(64 * MIB), "--iters", "1", "--verify")
        s = pair.finish()
    finally:
        pair.kill()
    pps = c["data_packets_sent"] / (c["elapsed_wall_ns"] / 1e9)
    print(f"\nfabric D={D}: 64 MiB RDMA WRITE h1 -> h2, {c['bw_fabric_bps'] / 1e9:.2f} Gb/s "
          f"fabric, {pps:,.0f} data packets/s (wall), {c['elapsed_wall_ns'] / 1e9:.2f} s wall")
    print(table)
    assert c["verified"] is True and s["verified"] is True
    assert c["bytes"] == 64 * MIB
    rq = _qp(c)["requester"]
    assert rq["packets_sent"] == 64 * MIB // 4096 and rq["retransmissions"] == 0
    assert _qp(s)["responder"]["payload_bytes_received"] == 64 * MIB
    assert sum(s["malformed"].values()) == 0 and sum(c["malformed"].values()) == 0
    # paced at the 100 Gb/s line rate (wire bytes), the dilated host port carries it
    assert 85e9 < c["bw_fabric_bps"] <= 100e9
    # data went out DSCP 26 / ECT(0) from an rxe-style source port
    assert _qp(c)["sport"] >= 0xC000


def test_64mib_write_with_1_percent_loss_is_byte_exact_via_nak_and_go_back_n(fabric, tmp_path):
    pair = Pair(fabric, tmp_path, "write_bw", port=18516)
    try:
        c, _ = _run_client(pair, "h3", "--size", str(64 * MIB), "--iters", "1", "--verify",
                           "--drop-prob", "0.01", "--drop-seed", "7")
        s = pair.finish()
    finally:
        pair.kill()
    qc, qs = _qp(c), _qp(s)
    rq, rs = qc["requester"], qs["responder"]
    pps = c["data_packets_sent"] / (c["elapsed_wall_ns"] / 1e9)
    print(f"\nfabric D={D}: 64 MiB with 1 % loss h3 -> h2: {qc['injected_drops']} lost, "
          f"{rq['naks_received']} NAKs, {rq['retransmissions']} retransmitted, "
          f"{rq['timeouts']} timeouts, {rs['ooo_drops']} out-of-order drops; "
          f"{c['bw_fabric_bps'] / 1e9:.2f} Gb/s fabric, {pps:,.0f} packets/s wall")
    assert c["verified"] is True and s["verified"] is True
    assert 64 * MIB // 4096 * 0.005 < qc["injected_drops"] < 64 * MIB // 4096 * 0.02
    assert rq["naks_received"] > 0 and rs["naks_sent"] == rq["naks_received"]
    assert rq["retransmissions"] >= qc["injected_drops"]
    assert rs["ooo_drops"] > 0
    # every loss is repaired by a NAK or (tail / lost retransmission) a timeout
    assert rs["naks_sent"] + rq["timeouts"] >= 0.9 * qc["injected_drops"] / 2
    assert rq["state"] == "rts" and rs["state"] == "rts"


def test_send_bw_and_write_lat_across_the_fabric(fabric, tmp_path):
    pair = Pair(fabric, tmp_path, "send_bw", server_host="h3", port=18517)
    try:
        c, _ = _run_client(pair, "h1", "--size", "100000", "--iters", "200", "--verify",
                           "--qps", "2")
        s = pair.finish()
    finally:
        pair.kill()
    assert s["verified"] is True
    assert sum(q["responder"]["send_messages"] for q in s["qps"].values()) == 400
    # two QPs, two rxe source ports
    assert len({q["sport"] for q in c["qps"].values()}) == 2

    pair = Pair(fabric, tmp_path, "write_lat", server_host="h3", port=18518)
    try:
        c, table = _run_client(pair, "h2", "--size", "64", "--iters", "100", "--verify")
        s = pair.finish()
    finally:
        pair.kill()
    lat = c["latency_fabric_us"]
    print(f"\nfabric D={D}: write_lat 64 B h2 <-> h3: t_min {lat['t_min']:.2f} us, t_avg "
          f"{lat['t_avg']:.2f} us, p99 {lat['p99']:.2f} us (fabric)")
    print(table)
    assert s["verified"] is True
    assert c["messages"] == 100
    # two 100G hops each way (serialisation; propagation only where sch_netem exists) plus
    # Python's turnaround, ~50 us of wall time = 0.05 us of fabric time at D=1000
    assert 0 < lat["t_min"] <= lat["t_avg"] < 50


def test_incast_ce_marks_become_cnps_and_dcqcn_cuts_both_senders(fabric, tmp_path):
    """h1 and h3 write to h2 at once: the switch port to h2 queues, its port program
    marks CE, h2's responders send CNPs (DSCP 48), the requesters' DCQCN cuts Rc."""
    from testbed.net import portprog

    sw = next(n for n in fabric.nodes if n.name.startswith("sw"))
    port = next(i for i in sw.interfaces if i.peer.node == "h2")
    try:
        handle = portprog.attach_port(fabric.lab, sw.name, sw.netns, port.ifname,
                                      portprog.params_from_egress(port.egress),
                                      peer=(fabric.node("h2").netns, port.peer.ifname))
    except (portprog.PortProgError, OSError) as exc:
        pytest.skip(f"cannot attach the ECN-marking port program: {exc}")
    before = portprog.read_counters(handle)[3]
    cnp_class_before = _class_packets(fabric, "h2", 6)
    pairs = [Pair(fabric, tmp_path, "write_bw", port=18520 + k, roce_port=4791 + k)
             for k in range(2)]
    try:
        start = time.monotonic_ns() + 2_000_000_000
        clients = [subprocess.Popen(
            p.client_argv(h, "--size", str(16 * MIB), "--iters", "1", "--verify",
                          "--cc", "dcqcn", "--cc-preset", "paper",
                          "--start-at-mono-ns", str(start)),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for p, h in zip(pairs, ("h1", "h3"), strict=True)]
        cs = []
        for proc in clients:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err + out
            cs.append(_last_json(out))
        ss = [p.finish() for p in pairs]
    finally:
        for p in pairs:
            p.kill()
    after = portprog.read_counters(handle)[3]
    cnp_class = _class_packets(fabric, "h2", 6) - cnp_class_before
    marks = after.ce_marks - before.ce_marks
    print(f"\nincast h1 + h3 -> h2: {marks} CE marks at {sw.name}/{port.ifname}; "
          + "; ".join(f"{_qp(s)['responder']['cnps_sent']} CNPs, Rc "
                      f"{_qp(c)['rc_bps'] / 1e9:.1f} Gb/s, {c['bw_fabric_bps'] / 1e9:.1f} Gb/s"
                      for c, s in zip(cs, ss, strict=True)))
    assert all(c["verified"] is True for c in cs) and all(s["verified"] is True for s in ss)
    assert marks > 0
    for c, s in zip(cs, ss, strict=True):
        rs, rq = _qp(s)["responder"], _qp(c)["requester"]
        assert rs["ce_packets_received"] > 0
        assert rs["cnps_sent"] > 0 and rq["cnps_received"] == rs["cnps_sent"]
        assert _qp(c)["rc_bps"] < 100e9
    # the CNPs left h2 in the CNP class (DSCP 48 -> TC6)
    assert cnp_class >= sum(_qp(s)["responder"]["cnps_sent"] for s in ss)
    # together they never beat the bottleneck
    assert sum(c["bytes"] for c in cs) * 8 / (
        max(c["elapsed_fabric_ns"] for c in cs) / 1e9) <= 101e9
