"""How the plan resolves packet trimming (traffic_classes[].trim, qos.<class>.trim): the
defaults, switch ports only, and what the port program is told (no root)."""

from __future__ import annotations

import pytest

from testbed.config import ConfigError, load_config_text
from testbed.net import portprog
from testbed.plan import compile_plan

FABRIC = """\
name: trimplan
dilation: 1000
traffic_classes:
  - {{tc: 2, name: uet, dscp: [18, 19], trim: true}}
  - {{tc: 6, name: cnp, dscp: [48, 46], strict: true}}
  - {{tc: 0, name: default, default: true}}
{qos}
topology: {{kind: single_switch, hosts: 2, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
"""


def _plan(qos: str = ""):
    return compile_plan(load_config_text(FABRIC.format(qos=qos), "trim.yaml"),
                        max_wall_port_rate_bps=200_000_000)


def _classes(plan, node: str, tc: int):
    return [c for i in plan.node(node).interfaces for c in i.egress.classes if c.tc == tc]


def test_defaults_trim_at_the_buffer_to_the_strict_class_keeping_128_bytes():
    plan = _plan("qos: {default: {buffer: {2: 300KB}}}")
    trims = {c.trim for c in _classes(plan, "sw1", 2)}
    assert len(trims) == 1
    [trim] = trims
    assert trim is not None
    assert (trim.threshold_bytes, trim.size_bytes, trim.tc, trim.dscp) == (300_000, 128, 6, 48)
    assert next(t for t in plan.traffic_classes if t.tc == 2).trim


def test_host_nics_never_trim_and_other_classes_do_not_either():
    plan = _plan()
    assert all(c.trim is None for c in _classes(plan, "h1", 2) + _classes(plan, "h2", 2))
    assert all(c.trim is None for tc in (0, 6) for c in _classes(plan, "sw1", tc))
    # the default lossy buffer (1 MB) is the threshold when neither is given
    assert {c.trim.threshold_bytes for c in _classes(plan, "sw1", 2)} == {1_000_000}


def test_explicit_threshold_size_and_a_class_by_number():
    plan = _plan("qos: {default: {trim: {threshold: 64KB, size: 88, to: 6}}}")
    [trim] = {c.trim for c in _classes(plan, "sw1", 2)}
    assert (trim.threshold_bytes, trim.size_bytes, trim.tc, trim.dscp) == (64_000, 88, 6, 48)


def test_the_port_program_is_told_the_plans_trim_and_the_dscp_selects_the_trim_class():
    plan = _plan("qos: {default: {trim: {threshold: 64KB, size: 256}}}")
    port = plan.node("sw1").interfaces[0]
    params = portprog.params_from_egress(port.egress)
    params.check()
    assert params.trims == {2: portprog.TrimParams(64_000, 256, 6, 48)}
    assert portprog.dscp_table(params)[48] == 6
    host = portprog.params_from_egress(plan.node("h1").interfaces[0].egress)
    assert host.trims == {}


def test_a_plan_without_trimming_serialises_no_trim_fields():
    text = FABRIC.replace(", trim: true", "").format(qos="")
    plan = compile_plan(load_config_text(text, "plain.yaml"), max_wall_port_rate_bps=200_000_000)
    assert '"trim"' not in plan.to_json()
    assert '"trim"' in _plan().to_json()


@pytest.mark.parametrize(("qos", "where"), [
    ("qos: {default: {trim: {size: 87}}}", "qos.default.trim.size"),
    ("qos: {default: {trim: {to: default}}}", "qos.default.trim.to"),
    ("qos: {default: {buffer: {2: 10KB}, trim: {threshold: 11KB}}}",
     "qos.default.trim.threshold"),
])
def test_bad_trim_settings_are_refused_where_they_are_written(qos: str, where: str):
    with pytest.raises(ConfigError) as err:
        load_config_text(FABRIC.format(qos=qos), "trim.yaml")
    assert where in str(err.value)


def test_a_dscp_remap_of_the_trim_dscp_moves_trimmed_packets_to_the_classs_next_dscp():
    text = FABRIC.format(qos="") + "dscp_remap:\n  - {node: sw1, dscp: 48, tclass: default}\n"
    plan = compile_plan(load_config_text(text, "remap.yaml"), max_wall_port_rate_bps=200_000_000)
    for iface in plan.node("sw1").interfaces:
        params = portprog.params_from_egress(iface.egress)
        params.check()                          # the trim DSCP still selects TC6 here
        assert params.trims[2].dscp == 46


def test_the_plan_says_which_dscp_a_trimmed_packet_of_a_class_carries():
    plan = _plan()
    assert plan.trim_dscp(2) == 48              # what the UET receivers are told
    assert plan.trim_dscp(0) is None and plan.trim_dscp(6) is None
