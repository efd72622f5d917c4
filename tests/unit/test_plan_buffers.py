"""How the plan sizes switch buffers: egress protection against the fan-in's headroom,
the shared pool's set-asides, host NICs without a marking curve (no root)."""

from __future__ import annotations

from testbed.config import load_config_text
from testbed.plan import compile_plan

NINE_PORT_SWITCH = """\
name: fanin
dilation: 1000
topology: {{kind: single_switch, hosts: 9, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
{extra}
"""


def _plan(extra: str = ""):
    return compile_plan(load_config_text(NINE_PORT_SWITCH.format(extra=extra), "fanin.yaml"),
                        max_wall_port_rate_bps=200_000_000)


def _roce(plan, node: str):
    return [c for i in plan.node(node).interfaces for c in i.egress.classes if c.tc == 3]


def test_egress_protection_leaves_room_for_every_upstream_ports_headroom():
    # the failing config: 410 KB a port, XOFF 400 KB, a headroom sized for one
    # upstream port, eight senders into one port
    plan = _plan("qos: {default: {buffer: {3: 410KB}, pfc: {xoff: 400KB, headroom: 10KB}}}")
    [cls] = {(c.limit_bytes, c.pfc.xoff_bytes, c.pfc.headroom_bytes, c.pfc.egress_xoff_bytes)
             for c in _roce(plan, "sw1")}
    limit, xoff, headroom, egress_xoff = cls
    assert egress_xoff == limit - 8 * headroom < xoff
    assert any("egress protection pauses the upstream ports at" in w and "8 ports" in w
               for w in plan.warnings), plan.warnings


def test_a_buffer_that_cannot_take_the_fan_ins_headroom_is_a_plan_warning():
    plan = _plan("qos: {default: {buffer: {3: 180KB}, ecn: {kmin: 20KB, kmax: 60KB},"
                 " pfc: {xoff: 90KB, headroom: 25KB}}}")
    assert any("cannot absorb its 8 upstream ports' PFC headroom" in w for w in plan.warnings)
    assert all(c.pfc.egress_xoff_bytes == 0 for c in _roce(plan, "sw1"))


def test_an_explicit_headroom_below_what_the_link_needs_is_a_plan_warning():
    plan = _plan("qos: {default: {pfc: {headroom: 5KB}}}")
    assert any("pfc.headroom 5KB is below what 9 links (first h1-sw1)" in w
               for w in plan.warnings), plan.warnings


def _plan_at(dilation: int, extra: str = ""):
    text = NINE_PORT_SWITCH.format(extra=extra).replace("dilation: 1000",
                                                        f"dilation: {dilation}")
    return compile_plan(load_config_text(text, "fanin.yaml"),
                        max_wall_port_rate_bps=200_000_000)


def test_the_auto_headroom_covers_the_emulated_pfc_loops_wall_time_response():
    # 2 ms of wall time is 1 us of fabric time at D = 2000 and 4 us at D = 500: at
    # 100 Gb/s that is 12.5 KB and 50 KB the upstream port sends before its gate closes,
    # both longer than 802.1Qbb's 60 quanta (3840 B). Two 9038 B frames + 2 x 120 ns at
    # 100 Gb/s (3000 B) + the response.
    for dilation, response in ((2000, 12_500), (500, 50_000)):
        [headroom] = {c.pfc.headroom_bytes for c in _roce(_plan_at(dilation), "sw1")}
        assert headroom == 2 * 9038 + 3000 + response, dilation
    # at a D where 2 ms of wall time is shorter than 60 quanta, Cisco's figure stands
    [headroom] = {c.pfc.headroom_bytes for c in _roce(_plan_at(100_000), "sw1")}
    assert headroom == 2 * 9038 + 3000 + 3840


def test_an_explicit_headroom_that_covers_hardware_but_not_the_emulator_is_a_warning():
    plan = _plan_at(500, "qos: {default: {pfc: {headroom: 30KB}}}")
    [warning] = [w for w in plan.warnings if "pfc.headroom 30KB" in w]
    assert "9 links" in warning and "emulated PFC loop" in warning and "D = 500" in warning
    quiet = _plan_at(500, "qos: {default: {pfc: {headroom: 80KB}}}")
    assert not [w for w in quiet.warnings if "pfc.headroom" in w]


def test_the_shared_pool_sets_aside_every_ingress_ports_headroom_and_reserve():
    plan = _plan("switch_buffer: {size: 2MiB}")
    sw = plan.node("sw1")
    roce = _roce(plan, "sw1")
    assert sw.buffer.mode == "shared" and sw.buffer.tracked == [3]
    assert sw.buffer.total_headroom_bytes == sum(c.pfc.headroom_bytes for c in roce)
    assert sw.buffer.total_reserve_bytes == 9 * 4096
    assert all(c.shared and c.limit_bytes == 2 << 20 and c.pfc.mode == "dynamic"
               and c.pfc.egress_xoff_bytes == 0 for c in roce)
    # lossy classes keep their per-port buffers
    assert all(not c.shared for i in sw.interfaces for c in i.egress.classes if c.tc != 3)


def test_host_nics_never_mark_and_account_nothing_per_ingress():
    plan = _plan()
    host = plan.node("h1")
    assert host.buffer.mode == "none" and host.buffer.tracked == []
    assert all(c.ecn is None for i in host.interfaces for c in i.egress.classes)
    assert all(c.ecn is not None for c in _roce(plan, "sw1"))


def test_dynamic_pfc_without_a_switch_buffer_pools_the_ports_buffers_and_says_so():
    plan = _plan("qos: {default: {buffer: {3: 1MB}, pfc: {mode: dynamic}}}")
    sw = plan.node("sw1")
    assert sw.buffer.mode == "shared" and sw.buffer.pool_bytes == 9 * 1_000_000
    assert all(c.shared and c.pfc.mode == "dynamic" for c in _roce(plan, "sw1"))
    assert any("sw1: PFC mode dynamic without a switch_buffer" in w and "9MB" in w
               for w in plan.warnings), plan.warnings
    assert plan.node("h1").buffer.mode == "none"


def test_where_the_buffer_has_no_room_for_the_emulators_headroom_it_is_capped_and_said():
    # at D = 100 the emulated loop's 20 us of fabric time is 250 KB at 100 Gb/s; a 260 KB
    # class buffer with XOFF 200 KB has 60 KB above XOFF, more than the hardware's
    # 24.9 KB: sound in hardware, so a plan with a warning, not an error
    plan = _plan_at(100, "qos: {default: {buffer: {3: 260KB}, ecn: {kmin: 50KB, kmax: 150KB},"
                         " pfc: {xoff: 200KB}}}")
    assert {c.pfc.headroom_bytes for c in _roce(plan, "sw1")} == {60_000}
    [warning] = [w for w in plan.warnings if "auto PFC headroom" in w]
    assert "60KB, all the buffer has room for" in warning and "D = 100" in warning


def test_the_shared_pools_auto_headroom_takes_at_most_half_of_it():
    # 2 MiB pool, 9 ports x one lossless class, 4 KiB reserve each: the emulator's
    # allowance is capped at (pool - reserves) / 2 / 9 a port (114 KB); at D = 100 the
    # emulated loop would want 271 KB a port, which would leave the pool nothing to share
    plan = _plan_at(100, "switch_buffer: {size: 2MiB}")
    reserves = 9 * 4096
    cap = (2 * 2**20 - reserves) // 18
    [headroom] = {c.pfc.headroom_bytes for c in _roce(plan, "sw1")}
    assert headroom == cap
    sw = plan.node("sw1").buffer
    assert sw.pool_bytes - sw.total_headroom_bytes - reserves >= (sw.pool_bytes - reserves) // 2
    assert any("auto PFC headroom" in w and "114.46KB" in w for w in plan.warnings)
