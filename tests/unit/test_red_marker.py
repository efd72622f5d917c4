"""The RED marker's pure parts: the curve -> sch_red parameters (checked against Linux's
red_action, simulated in its integer arithmetic), the plan it compiles to, the netlink
message, the config checks and the kernel feature it needs (no root, no sch_red)."""

from __future__ import annotations

import numpy as np
import pytest

from agents import portmaps
from testbed.config import ConfigError, load_config_text
from testbed.net import portprog
from testbed.net.qdisc import install_port_queues, red_options
from testbed.plan import compile_plan, red
from testbed.run.requirements import needed_features

FABRIC = """\
name: redplan
dilation: 1000
topology: {{kind: single_switch, hosts: 2, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
{qos}
"""


def _plan(qos: str, **kw):
    return compile_plan(load_config_text(FABRIC.format(qos=qos), "red.yaml", **kw),
                        max_wall_port_rate_bps=200_000_000)


@pytest.mark.parametrize("pmax", [0.01, 0.1, 0.2, 0.5, 1.0])
def test_reds_fraction_at_a_standing_queue_follows_the_curve(pmax):
    """The fit, run through Linux's red_action (integer arithmetic, count-based spacing):
    the fraction marked at a standing queue is the curve's p(q) within the fit's error
    plus the sampling spread."""
    kmin, kmax = 30_000, 150_000
    params = red.red_params(kmin, kmax, pmax, 4_000_000)
    quality = red.fit(pmax)
    assert quality.max_error <= 0.1 * pmax
    rng = np.random.default_rng(7)
    n = 60_000
    for x in (0.1, 0.3, 0.5, 0.7, 0.9, 1.0):
        q = kmin + round(x * (kmax - kmin))
        got = float(np.mean(red.simulate(params, [q] * n, rng)))
        want = portmaps.mark_probability(q, kmin, kmax, pmax)
        assert abs(got - want) <= quality.max_error + 4 * (want / n) ** 0.5 + 2 / n, (x, got)
    # outside the ramp RED is exact: nothing at or below kmin, everything above kmax
    assert not any(red.simulate(params, [kmin] * 1000, rng))
    assert all(red.simulate(params, [kmax + 1] * 1000, rng))


def test_a_step_curve_marks_exactly_above_k():
    p = red.red_params(40_000, 40_000, 1.0, 1_000_000)
    assert (p.qth_min_bytes, p.qth_max_bytes) == (40_001, 40_001)
    marks = red.simulate(p, [39_000, 40_000, 40_001, 90_000], np.random.default_rng(1))
    assert marks == [False, False, True, True]


def test_red_params_are_what_the_module_says():
    p = red.red_params(100_000, 400_000, 0.2, 2_000_000)
    assert p.wlog == 0 and p.stab == bytes([31]) * 256          # instantaneous queue
    assert p.flags == red.TC_RED_ECN | red.TC_RED_NODROP         # no harddrop
    assert p.limit_bytes == 2_000_000 and p.qth_max_bytes == 400_001
    assert 100_000 < p.qth_min_bytes < 110_000
    assert 0.5 * 0.2 < p.max_p < 0.6 * 0.2                       # ~ pmax / 2: the spacing
    assert abs(red.kernel_max_p(p) - p.max_p) < 1e-3 * p.max_p


def test_the_plan_puts_red_under_the_pfc_gate_and_in_place_of_bfifo_elsewhere():
    plan = _plan("qos: {default: {ecn: {kmin: 100KB, kmax: 400KB, pmax: 0.2, marker: red}}}")
    sw = plan.node("sw1")
    for iface in sw.interfaces:
        roce = next(c for c in iface.egress.classes if c.tc == 3)
        assert roce.leaf_kind == "tbf" and roce.red is not None
        assert (roce.red.handle, roce.red.parent) == ("203:", "103:1")
        assert roce.red.limit_bytes == roce.limit_bytes
        params = portprog.params_from_egress(iface.egress)
        assert params.classes[3].marker == "red"
        cfg = portmaps.CLASS_CFG.unpack(portmaps.encode_class_cfg(params.classes[3]))
        assert cfg[portmaps.CLASS_CFG_FIELDS.index("ecn_enabled")] == 2  # the program counts
    for iface in plan.node("h1").interfaces:                     # host NICs never mark
        assert all(c.red is None for c in iface.egress.classes)
    plan = _plan("qos: {default: {pfc: {enabled: false}, ecn: {marker: red}}}")
    roce = next(c for c in plan.node("sw1").interfaces[0].egress.classes if c.tc == 3)
    assert (roce.leaf_kind, roce.red.handle, roce.red.parent) == ("red", "103:", "1:13")
    assert needed_features(plan) == {"red": needed_features(plan)["red"]}
    assert "sw1" in needed_features(plan)["red"]


def test_the_bpf_marker_plan_is_unchanged_and_needs_no_red():
    plan = _plan("")
    assert '"marker"' not in plan.to_json() and '"red"' not in plan.to_json()
    assert "red" not in needed_features(plan)


class _Recorder:
    def __init__(self):
        self.calls = []

    def tc(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_the_qdisc_is_encoded_by_pyroute2_with_every_value_as_planned():
    from pyroute2 import IPBatch
    from pyroute2.netlink.rtnl.tcmsg import tcmsg

    plan = _plan("qos: {default: {ecn: {kmin: 100KB, kmax: 400KB, pmax: 0.2, marker: red}}}")
    egress = plan.node("sw1").interfaces[0].egress
    rec = _Recorder()
    install_port_queues(rec, 5, egress)
    reds = [(a, k) for a, k in rec.calls if a[:2] == ("add", "red")]
    assert len(reds) == 1
    roce = next(c for c in egress.classes if c.tc == 3)
    ipb = IPBatch()
    try:
        ipb.tc("add", "red", 5, 0x2030000, **red_options(roce.red))
        msg = tcmsg(bytes(ipb.batch))
        msg.decode()
    finally:
        ipb.close()
    opts = msg.get_attr("TCA_OPTIONS")
    parms = opts.get_attr("TCA_RED_PARMS")
    assert (parms["limit"], parms["qth_min"], parms["qth_max"], parms["Wlog"], parms["flags"]) \
        == (roce.red.limit_bytes, roce.red.qth_min_bytes, roce.red.qth_max_bytes, 0, 0)
    assert opts.get_attr("TCA_RED_MAX_P") == roce.red.max_p_fp
    flags = opts.get_attr("TCA_RED_FLAGS")
    assert flags["bits"] == red.TC_RED_ECN | red.TC_RED_NODROP
    assert msg["parent"] == 0x1030001


@pytest.mark.parametrize(("qos", "where"), [
    # RED keeps max_p / (kmax - kmin) as an integer in units of 2^-32
    ("qos: {default: {buffer: {3: 4MB}, ecn: {kmin: 5KB, kmax: 3MB, pmax: 0.0005, "
     "marker: red}}}", "qos.default.ecn.pmax"),
])
def test_what_sch_red_cannot_do_is_refused_naming_the_field(qos, where):
    with pytest.raises(ConfigError) as err:
        _plan(qos)
    assert where in str(err.value) and "marker red" in str(err.value)


def test_an_ecn_event_on_a_red_port_is_refused_naming_the_marker():
    qos = "qos: {default: {ecn: {marker: red}}}\n"
    events = "events:\n  - {at: 1ms, kind: ecn, node: sw1, tclass: roce, k: 50KB}\n"
    with pytest.raises(ConfigError) as err:
        load_config_text(FABRIC.format(qos=qos) + events, "red.yaml")
    text = str(err.value)
    assert "events.0.kind" in text or "events[0].kind" in text, text
    assert "qos.default.ecn.marker: red" in text


def test_an_unknown_marker_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config_text(FABRIC.format(qos="qos: {default: {ecn: {marker: rde}}}"), "red.yaml")
    assert "qos.default.ecn.marker" in str(err.value)
