"""The port watchdog judges a port only over intervals it was really backlogged."""

from __future__ import annotations

from agents.timebase import Dilation
from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.results.store import Sample
from testbed.run.fidelity import PortWatchdog

CONFIG = """\
name: wd
dilation: 1000
topology: {kind: single_switch, hosts: 2, host_link: {port: 100GBASE-CR1, length: 2m}}
"""
PERIOD_NS = 100_000_000     # wall, between samples


def _watchdog():
    plan = compile_plan(load_config_text(CONFIG, "wd.yaml"))
    iface = plan.node("sw1").interfaces[0]
    return PortWatchdog(plan), iface.ifname, iface.egress


def _feed(wd, port, rate_share: float, backlog_bytes: int, samples: int = 6) -> None:
    """Samples where sw1:`port` sends `rate_share` of its wall rate with `backlog_bytes`
    in TC3 at every sample."""
    rate = wd.ports[("sw1", port)].wall_rate_bps
    sent = 0
    for i in range(samples):
        wd.observe(i * PERIOD_NS, [Sample("sw1", port, -1, "tx_bytes", sent),
                                   Sample("sw1", port, -1, "tx_packets", 0),
                                   Sample("sw1", port, 3, "backlog_bytes", backlog_bytes)])
        sent += int(rate * rate_share * PERIOD_NS / 1e9 / 8)


def test_a_deep_queue_sent_slowly_is_a_port_that_did_not_keep_up():
    wd, port, egress = _watchdog()
    _feed(wd, port, 0.5, 10 * egress.burst_bytes)
    (note,) = wd.notes(Dilation(1000))
    assert note.startswith(f"port sw1:{port} delivered 50.0 % of its rate")


def test_a_packet_or_two_queued_is_not_judged():
    wd, port, egress = _watchdog()
    _feed(wd, port, 0.2, 2 * 4170)          # a host NIC behind a small socket buffer
    assert 2 * 4170 <= egress.burst_bytes
    assert wd.notes(Dilation(1000)) == []
    assert wd.ports[("sw1", port)].intervals == 0


def test_a_deep_queue_at_line_rate_passes():
    wd, port, egress = _watchdog()
    _feed(wd, port, 1.0, 10 * egress.burst_bytes)
    assert wd.notes(Dilation(1000)) == []
    assert wd.ports[("sw1", port)].intervals == 5


def test_a_port_whose_pause_time_went_unreported_is_not_judged():
    """A deadlocked port is paused and silent; when its PFC agent misses a sample (or has
    stopped) the interval says nothing about the machine, so it must not be blamed."""
    wd, port, egress = _watchdog()
    paused = 0.0
    for i in range(8):
        samples = [Sample("sw1", port, -1, "tx_bytes", 0),
                   Sample("sw1", port, -1, "tx_packets", 0),
                   Sample("sw1", port, 3, "backlog_bytes", 10 * egress.burst_bytes)]
        if i % 2 == 0:      # the agent answers every other sample: paused the whole time
            samples.append(Sample("sw1", port, 3, "paused_ns", paused))
        wd.observe(i * PERIOD_NS, samples)
        paused += Dilation(1000).to_fabric_ns(PERIOD_NS)
    assert wd.notes(Dilation(1000)) == []
    assert wd.ports[("sw1", port)].intervals == 0
