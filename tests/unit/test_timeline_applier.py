"""The run's event applier without a kernel: what it asks of the kernel side and of the
PFC agents for each kind, and how successive events on one port compose."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.config import load_config_text
from testbed.net import events as kernel
from testbed.plan import compile_plan
from testbed.plan.model import EcnPlan, EventPlan, EventPortPlan
from testbed.run.timeline import APPLIED, FabricApplier

CONFIG = """\
name: tlunit
dilation: 1000
topology:
  kind: single_switch
  hosts: 2
  host_link: {port: 100GBASE-CR1, length: 2m}
"""


@pytest.fixture
def plan():
    return compile_plan(load_config_text(CONFIG, "unit.yaml"))


def _event(kind: str, ports: list[EventPortPlan], index: int = 0) -> EventPlan:
    return EventPlan(index=index, at_ns=1_000, kind=kind, target="sw1:swp1",
                     description=f"a {kind} event", ports=ports)


class Agents:
    def __init__(self, reply: dict | None = None) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.reply = reply or {"ok": True, "applied": 1}

    def __call__(self, path: str, request: dict) -> dict:
        self.sent.append((path, request))
        return self.reply


def test_pfc_is_a_command_to_the_nodes_pfc_agent(plan, tmp_path):
    agents = Agents()
    applier = FabricApplier(plan, tmp_path, send=agents)
    facts = applier(_event("pfc", [EventPortPlan(node="sw1", ifname="swp1", tc=3,
                                                 pfc_enabled=False)]), APPLIED)
    assert agents.sent == [(str(tmp_path / "sw1-pfc.cmd.sock"),
                            {"op": "pfc", "port": "swp1", "tc": 3, "enabled": False})]
    assert facts["changes"] == [{"port": "sw1:swp1", "tclass": 3, "enabled": False,
                                 "agent": {"applied": 1}}]


def test_host_drain_tells_the_hosts_agent_its_rates_and_thresholds(plan, tmp_path):
    agents = Agents()
    applier = FabricApplier(plan, tmp_path, send=agents)
    applier(_event("host_drain", [EventPortPlan(
        node="h2", ifname="eth0", tc=3, drain_rate_bps=0, drain_wall_rate_bps=0,
        xoff_bytes=100_000, xon_bytes=80_000)]), APPLIED)
    assert agents.sent == [(str(tmp_path / "h2-pfc.cmd.sock"), {
        "op": "drain", "port": "eth0", "tc": 3, "rate_bps": 0, "wall_rate_bps": 0,
        "xoff_bytes": 100_000, "xon_bytes": 80_000})]


def test_an_agent_refusal_is_an_error_naming_the_node(plan, tmp_path):
    applier = FabricApplier(plan, tmp_path, send=Agents({"ok": False, "error": "no port"}))
    with pytest.raises(kernel.EventError, match="PFC agent on sw1 refused pfc: no port"):
        applier(_event("pfc", [EventPortPlan(node="sw1", ifname="swp9", tc=3,
                                             pfc_enabled=True)]), APPLIED)


def test_without_pfc_agents_an_agent_event_cannot_be_applied(tmp_path):
    cfg = CONFIG + "qos:\n  default:\n    pfc: {enabled: false}\n"
    applier = FabricApplier(compile_plan(load_config_text(cfg, "u.yaml")), tmp_path,
                            send=Agents())
    with pytest.raises(kernel.EventError, match="no PFC agent runs on sw1"):
        applier(_event("pfc", [EventPortPlan(node="sw1", ifname="swp1", tc=3,
                                             pfc_enabled=False)]), APPLIED)


def test_a_rate_on_pfc_gated_ports_leaves_the_gates_to_the_agent(plan, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "set_port_rate",
                        lambda _plan, node, ifname, egress, gates: calls.append(
                            (node, ifname, egress.rate_bps, gates)))
    agents = Agents()
    egress = plan.node("sw1").interfaces[0].egress.model_copy(update={
        "rate_bps": 25_000_000_000, "wall_rate_bps": 25_000_000, "burst_bytes": 18_076})
    applier = FabricApplier(plan, tmp_path, send=agents)
    facts = applier(_event("rate", [EventPortPlan(node="sw1", ifname="swp1",
                                                  egress=egress)]), APPLIED)
    assert calls == [("sw1", "swp1", 25_000_000_000, False)]
    assert agents.sent[0][1] == {"op": "rate", "port": "swp1", "rate_bps": 25_000_000_000,
                                 "wall_rate_bps": 25_000_000, "burst_bytes": 18_076}
    assert facts["changes"][0]["gates_by_agent"] is True
    assert applier.ports[("sw1", "swp1")].egress.rate_bps == 25_000_000_000


def test_successive_port_events_compose(plan, tmp_path, monkeypatch):
    writes = []
    monkeypatch.setattr(kernel, "set_port_params",
                        lambda _plan, node, ifname, egress, loss: writes.append((egress, loss)))
    applier = FabricApplier(plan, tmp_path, send=Agents())
    curve = EcnPlan(kmin_bytes=5_000, kmax_bytes=50_000, pmax=0.5)
    applier(_event("ecn", [EventPortPlan(node="sw1", ifname="swp2", tc=3, ecn=curve)]),
            APPLIED)
    applier(_event("loss", [EventPortPlan(node="sw1", ifname="swp2", loss_probability=0.01)],
                   index=1), APPLIED)
    egress, loss = writes[-1]
    assert loss == 0.01
    assert next(c.ecn for c in egress.classes if c.tc == 3) == curve   # the ECN change stays


def test_unknown_kind_is_refused(plan, tmp_path):
    with pytest.raises(ValueError, match="unknown event kind"):
        FabricApplier(plan, tmp_path)(_event("meteor", []), APPLIED)


def test_the_command_socket_is_where_the_pfc_agents_are_told_to_serve(tmp_path):
    from testbed.run.fabric_agents import pfc_command_socket
    assert pfc_command_socket(tmp_path, "leaf1", "lab") == str(tmp_path / "leaf1-pfc.cmd.sock")
    long_dir = Path("/tmp") / ("x" * 120)
    assert len(pfc_command_socket(long_dir, "leaf1", "lab")) <= 108
