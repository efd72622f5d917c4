"""DCQCN end to end: RoCE QPs, ECN marks, CNPs and PFC on emulated fabrics, via `testbed run`.

(a) Two QPs from h1 and h2 to h3 through one switch port (single switch, D = 1000,
    10 ms of fabric time, samples every 20 us): their goodput over the last two
    thirds is an equal share within 20 %, CNPs keep flowing, and the bottleneck queue (sw1's
    port to h3, TC3) peaks in or near the ECN band (Kmin .. 1.25 Kmax) instead of
    growing to PFC's XOFF, and PFC stays quiet after the first ms.
(b) The 7:1 incast of configs/examples/dcqcn-{on,off}.yaml (default fabric,
    PFC on in both, D = 2000, 30 ms): with DCQCN, at least 5x fewer PFC pause
    frames at 90 % of the throughput or better (issue 5's criterion), none in the
    second half; the host NICs' queues hold a packet or two while paused.

What is measured (fabric units throughout):
- shares: bytes each server received (`recv.bytes` time series) over the last
  two thirds of the run, divided by their sum;
- queue: `backlog_bytes` samples of the bottleneck class over the same span;
  Kmin / Kmax / XOFF are the plan's settings for that port (100 KB, 400 KB, 1 MB);
- throughput: message bytes all clients completed over the longest client time
  (first post to last completion);
- pause frames: XOFF frames sent by every port (`totals.pause_frames` of summary.json,
  or `pfc_xoff` events, time-stamped by the PFC agents, for a span of the run).
"""

from __future__ import annotations

import json

import pytest

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import REPO, unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

LOSSLESS = 3

TWO_FLOWS = """\
name: {lab}
dilation: 1000
topology: {{kind: single_switch, hosts: 3, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
workload:
  sample_period: 20us
  drain: 100us
  traffic:
    - {{name: two, kind: roce_incast, senders: [h1, h2], receiver: h3, duration: {duration_us}us}}
"""
DURATION_NS = 10_000_000
INCAST_DURATION_NS = 30_000_000     # configs/examples/dcqcn-{on,off}.yaml
# A WRITE FIRST packet at path MTU 4096 as the qdisc counts it (no FCS):
# Ethernet 14 + IPv4 20 + UDP 8 + BTH 12 + RETH 16 + payload 4096 + ICRC 4.
LARGEST_FRAME_BYTES = 14 + 20 + 8 + 12 + 16 + 4096 + 4


def _run(text: str, name: str, tmp_path_factory):
    loaded = load_config_text(text, name)
    plan = compile_plan(loaded)
    result = run_config(loaded, plan, RunOptions(runs_root=tmp_path_factory.mktemp(name),
                                                 say=lambda _m: None))
    return plan, result.run_dir, json.loads((result.run_dir / "summary.json").read_text())


def _example(example: str, stem: str, tmp_path_factory):
    text = (REPO / "configs" / "examples" / example).read_text()
    lines = [f"name: {unique_lab(stem)}" if line.startswith("name:") else line
             for line in text.splitlines()]
    return _run("\n".join(lines) + "\n", stem, tmp_path_factory)


@pytest.fixture(scope="module")
def two_flows(tmp_path_factory):
    text = TWO_FLOWS.format(lab=unique_lab("dcqcn"), duration_us=DURATION_NS // 1000)
    return _run(text, "twoflows", tmp_path_factory)


@pytest.fixture(scope="module")
def incast_on(tmp_path_factory):
    return _example("dcqcn-on.yaml", "dqon", tmp_path_factory)


@pytest.fixture(scope="module")
def incast_off(tmp_path_factory):
    return _example("dcqcn-off.yaml", "dqoff", tmp_path_factory)


def _rows(summary) -> list[dict]:
    return [r for w in summary["workloads"] for r in w["results"]]


def _at(series: list[tuple[int, float]], ts: int) -> float:
    """The last sample at or before `ts` (the first one if none)."""
    before = [v for t, v in series if t <= ts]
    return before[-1] if before else series[0][1]


def _class(plan, node: str, port: str, tc: int = LOSSLESS):
    iface = next(i for i in plan.node(node).interfaces if i.ifname == port)
    return next(c for c in iface.egress.classes if c.tc == tc)


def _throughput_bps(summary) -> float:
    rows = _rows(summary)
    return sum(r["bytes"] for r in rows) * 8 / (max(r["time_us"] for r in rows) * 1e-6)


def test_two_qps_through_one_bottleneck_converge_to_equal_shares(two_flows):
    _plan, run_dir, summary = two_flows
    rows = _rows(summary)
    assert len(rows) == 2
    assert all(r["verified"] is True and r["error"] is None for r in rows)
    store = Store(run_dir / "counters.sqlite")
    received = {k[1]: v for k, v in store.series("recv.bytes").items()}
    store.close()
    lo, hi = DURATION_NS // 3, DURATION_NS
    got = {name: _at(s, hi) - _at(s, lo) for name, s in received.items()}
    assert set(got) == {"two-h1-h3-srv", "two-h2-h3-srv"}
    shares = {name: b / sum(got.values()) for name, b in got.items()}
    print(f"\nshares over {lo / 1e3:.0f}..{hi / 1e3:.0f} us: "
          + ", ".join(f"{n} {s:.3f}" for n, s in shares.items())
          + f"; goodput {[r['gbps'] for r in rows]} Gb/s")
    # hpcc-ns3-paper cuts both QPs on the same 50 us ticks while the queue is above Kmin,
    # which keeps their ratio; only the additive steps (20 Mb/s per 55 us) and the
    # ticks one of them misses near Kmin even it out. Measured over 3.3..10 ms:
    # 0.425..0.575 in 14 runs; over 1..3 ms of a 3 ms run up to 0.606.
    for name, share in shares.items():
        assert share == pytest.approx(0.5, rel=0.2), name


def test_cnps_flow_for_both_qps_all_run_long(two_flows):
    _plan, run_dir, summary = two_flows
    for r in _rows(summary):
        assert r["cc"] == "dcqcn/hpcc-ns3-paper"     # the default DCQCN preset
        assert r["ce_received"] > 0 and r["cnps_sent"] > 0
        # CNPs travel on the strict TC6 and are not lost on the way
        assert r["cnps_received"] == pytest.approx(r["cnps_sent"], rel=0.02)
    store = Store(run_dir / "counters.sqlite")
    cnps = store.series("send.cnps")
    rates = store.series("send.rc_bps")
    store.close()
    assert len(cnps) == 2
    for key, series in cnps.items():
        # still marking in the last third: DCQCN is regulating, not just the start-up
        assert _at(series, DURATION_NS) > _at(series, 2 * DURATION_NS // 3), key
        # and the rate it regulates moved below line rate
        assert min(v for t, v in rates[key] if t >= 0) < 100e9, key


def test_bottleneck_queue_stays_in_the_ecn_band_below_xoff(two_flows):
    plan, run_dir, summary = two_flows
    cls = _class(plan, "sw1", "swp3")
    kmin, kmax, xoff = cls.ecn.kmin_bytes, cls.ecn.kmax_bytes, cls.pfc.xoff_bytes
    assert (kmin, kmax, xoff) == (100_000, 400_000, 1_000_000)
    store = Store(run_dir / "counters.sqlite")
    (queue,) = store.aligned("backlog_bytes", node="sw1", port="swp3", tclass=LOSSLESS).values()
    store.close()
    steady = [v for t, v in queue if DURATION_NS // 3 <= t <= DURATION_NS]
    assert len(steady) >= 50
    print(f"\nsteady queue: max {max(steady) / 1e3:.0f} KB, mean "
          f"{sum(steady) / len(steady) / 1e3:.0f} KB, above Kmin "
          f"{sum(v > kmin for v in steady) / len(steady):.0%} of samples")
    # The queue's peaks reach the marking band (that is where the CNPs come from)
    # and stay near it (measured 260-375 KB; a quarter over Kmax allowed), far below
    # XOFF: DCQCN, not PFC, holds it. It drains below Kmin between peaks (the cuts
    # are 50 %: alpha is ~1 in a run this short).
    assert kmin <= max(steady) <= 1.25 * kmax < xoff
    assert sum(steady) / len(steady) < kmax
    # No pause frame once DCQCN holds the queue (the first ms may pause).
    assert _pause_frames(run_dir, DURATION_NS // 3, DURATION_NS) == 0
    assert all(p["drops"] == 0 for p in summary["ports"] if p["tclass"] == LOSSLESS)


def _pause_frames(run_dir, lo_ns: int = 0, hi_ns: int | None = None) -> int:
    """XOFF frames every switch and host sent between lo_ns and hi_ns (fabric time after
    t0), from the PFC agents' own time-stamped events (sampled counters can lag when the
    collector falls behind; these cannot)."""
    store = Store(run_dir / "counters.sqlite")
    xoffs = store.events("pfc_xoff")
    store.close()
    return sum(1 for e in xoffs
               if lo_ns <= e["ts_fabric_ns"] and (hi_ns is None or e["ts_fabric_ns"] <= hi_ns))


def _incast_numbers(on, off) -> dict:
    duration = INCAST_DURATION_NS
    assert _pause_frames(on[1]) == on[2]["totals"]["pause_frames"]
    return {
        "pause_on": on[2]["totals"]["pause_frames"], "pause_off": off[2]["totals"]["pause_frames"],
        "late_on": _pause_frames(on[1], duration // 2, duration),
        "late_off": _pause_frames(off[1], duration // 2, duration),
        "bps_on": _throughput_bps(on[2]), "bps_off": _throughput_bps(off[2]),
    }


def test_incast_data_arrives_byte_exact_with_and_without_dcqcn(incast_on, incast_off):
    for plan, _run_dir, summary in (incast_on, incast_off):
        # the examples leave D to `auto`; the run used the plan's D
        assert plan.dilation.mode == "auto" and summary["dilation"] == plan.dilation.factor
        rows = _rows(summary)
        assert len(rows) == 7 and {r["dst"] for r in rows} == {"h8"}
        assert all(r["verified"] is True and r["error"] is None for r in rows), rows
        assert all(r["bytes"] > 0 for r in rows)


def test_dcqcn_sends_cnps_and_cuts_pause_frames_in_the_7_to_1_incast(incast_on, incast_off):
    on_rows, off_rows = _rows(incast_on[2]), _rows(incast_off[2])
    assert all(r["cnps_received"] > 0 for r in on_rows)
    assert all(r["cnps_sent"] == r["cnps_received"] == 0 for r in off_rows)
    # ECN marks happen either way; only DCQCN turns them into CNPs
    assert all(r["ce_received"] > 0 for r in off_rows)
    n = _incast_numbers(incast_on, incast_off)
    half = INCAST_DURATION_NS // 2 / 1e3
    print(f"\n7:1 incast, PFC on, {INCAST_DURATION_NS / 1e6:g} ms: pause frames "
          f"{n['pause_on']} with DCQCN vs {n['pause_off']} without "
          f"({n['pause_off'] / max(n['pause_on'], 1):.1f}x); after {half:.0f} us "
          f"{n['late_on']} vs {n['late_off']}; throughput {n['bps_on'] / 1e9:.1f} vs "
          f"{n['bps_off'] / 1e9:.1f} Gb/s ({n['bps_on'] / n['bps_off']:.0%})")
    assert n["late_off"] > 0
    # The start-up of seven line-rate QPs pauses whatever the CC (the first cut comes
    # ~50 us after the first CNP); once DCQCN holds the queue, PFC stays quiet.
    # (measured 0 vs ~6 200; 1 % allowed for a VM that stalls a sender)
    assert n["late_on"] * 100 <= n["late_off"]
    assert n["pause_on"] * 5 <= n["pause_off"]


def test_dcqcn_cuts_pause_frames_5x_at_90_percent_of_the_throughput(incast_on, incast_off):
    n = _incast_numbers(incast_on, incast_off)
    _skip_unless_kept_up(incast_on, incast_off)
    assert n["pause_on"] * 5 <= n["pause_off"]
    # DCQCN's sawtooth costs some throughput: alpha starts at 1 (50 % cuts) and falls
    # with a 12.8 ms time constant, so the first ms lose most (measured ~82 Gb/s in
    # the first 4 ms, 93-96 after 10 ms, vs 97.7 without CC)
    assert n["bps_on"] >= 0.9 * n["bps_off"]


def test_a_paused_nic_holds_a_packet_or_two_not_the_qps_data(incast_on, incast_off):
    """The senders' SO_SNDBUF is an RNIC's transmit FIFO: while PFC pauses a host, the
    QP's data waits unsent (under its rate limiter), not in the NIC's queue."""
    for _plan, run_dir, _summary in (incast_on, incast_off):
        store = Store(run_dir / "counters.sqlite")
        try:
            paused_ns = {}
            for host in [f"h{i}" for i in range(1, 8)]:
                (queue,) = store.series("backlog_bytes", node=host, port="eth0",
                                        tclass=LOSSLESS).values()
                assert max(v for _t, v in queue) <= 2 * LARGEST_FRAME_BYTES, (run_dir.name, host)
                (paused,) = store.series("paused_ns", node=host, port="eth0",
                                         tclass=LOSSLESS).values()
                paused_ns[host] = paused[-1][1]
        finally:
            store.close()
        if run_dir == incast_off[1]:
            # leaf2 pauses h5..h7 for most of the run: the bound above was tested.
            # (h1..h4 are not paused: the spines hold what leaf2 refuses.)
            assert all(paused_ns[h] > INCAST_DURATION_NS / 4 for h in ("h5", "h6", "h7")), \
                paused_ns


def test_the_collector_kept_sampling_the_agents_to_the_end(incast_on, incast_off):
    """Agent counters (per-QP rates, bytes received) reach the end of the run: the
    PFC agents (real-time priority) leave the collector and the senders CPU."""
    for _plan, run_dir, summary in (incast_on, incast_off):
        store = Store(run_dir / "counters.sqlite")
        try:
            received = store.aligned("recv.bytes")      # every sample the agent answered
        finally:
            store.close()
        assert len(received) == 7
        fell_behind = [n for n in summary["fidelity"] if "collector fell behind" in n]
        for key, series in received.items():
            times = [t for t, _v in series if 0 <= t <= INCAST_DURATION_NS]
            assert times and max(times) >= 0.95 * INCAST_DURATION_NS, (run_dir.name, key)
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            # A loaded machine may stretch the sampling (CI's 2 cores, shared): then the
            # run must say so. Sparse samples without that note are the bug.
            assert max(gaps) <= INCAST_DURATION_NS / 20 or fell_behind, (
                run_dir.name, key, max(gaps), summary["fidelity"])


def _skip_unless_kept_up(*runs) -> None:
    lagged = [note for _plan, _dir, summary in runs for note in summary["fidelity"]
              if "did not keep up" in note]
    if lagged:
        pytest.skip(f"throughput is not comparable: {lagged[0]}")
