"""Congestion control state machines (agents.rdma.cc): DCQCN RP/NP, DCTCP, no-CC.

Every expected value is worked out by hand in the comments with exact fractions
(G = 1e9 bit/s, M = 1e6 bit/s, times in fabric ns, 1 us = 1000 ns) and compared
with pytest.approx(rel=1e-12). No sockets, no real time.
"""

from __future__ import annotations

import inspect
import random
import subprocess
import sys
from dataclasses import fields, replace
from fractions import Fraction as Fr

import pytest

from agents.rdma.cc import (
    CC_KINDS,
    DCQCN_PRESET_NAMES,
    DCQCN_TUNABLE,
    DCTCP_PRESET_NAMES,
    DCTCP_PRESETS,
    DCTCP_TUNABLE,
    DEFAULT_DCQCN_PRESET,
    DEFAULT_DCTCP_PRESET,
    PRESETS,
    DcqcnNp,
    DcqcnParams,
    DcqcnRp,
    DctcpParams,
    DctcpRp,
    NoCc,
    RateController,
    dctcp_preset,
    effective_params,
    make_cc,
    preset,
    with_overrides,
)
from tests.conftest import REPO

G = 10**9
M = 10**6
US = 1000
G256 = Fr(1, 256)  # g of all three DCQCN presets
KEEP = 1 - G256  # (1 - g) = 255/256


def approx(x):
    return pytest.approx(float(x), rel=1e-12)


def rp(name: str, line_bps: float = 40 * G, now: float = 0) -> DcqcnRp:
    return DcqcnRp(preset(name, line_bps), line_bps, now)


# --- presets -----------------------------------------------------------------------------


def test_presets_carry_their_sources_values():
    p = PRESETS["paper"]
    assert (p.alpha_timer_ns, p.increase_timer_ns, p.byte_counter_bytes) == (55 * US, 55 * US,
                                                                             10_000_000)
    assert (p.g, p.fast_recovery_steps, p.rai_bps) == (1 / 256, 5, 40 * M)
    assert (p.kmin_bytes, p.kmax_bytes, p.pmax, p.cnp_interval_ns) == (5_000, 200_000, 0.01,
                                                                       50 * US)
    n = PRESETS["ns3-rdma"]
    assert (n.alpha_timer_ns, n.increase_timer_ns, n.byte_counter_bytes) == (55 * US, 60 * US,
                                                                             300_000)
    assert (n.g, n.fast_recovery_steps, n.rai_bps, n.rhai_bps) == (1 / 256, 5, 40 * M, 200 * M)
    assert (n.kmin_bytes, n.kmax_bytes, n.pmax) == (40_000, 1_000_000, 1.0)
    # HPCC's run.py: --cc dcqcn_paper (50/50/55 us) and --cc dcqcn (1/4/300 us), the rest equal
    h = PRESETS["hpcc-ns3-paper"]
    assert (h.alpha_timer_ns, h.rate_decrease_interval_ns, h.increase_timer_ns,
            h.byte_counter_bytes) == (50 * US, 50 * US, 55 * US, None)
    assert (h.g, h.fast_recovery_steps, h.rai_bps, h.rhai_bps) == (1 / 256, 1, 5 * M, 50 * M)
    assert (h.kmin_bytes, h.kmax_bytes, h.pmax, h.min_rate_bps) == (100_000, 400_000, 0.2, G)
    d = PRESETS["hpcc-ns3"]
    assert (d.alpha_timer_ns, d.rate_decrease_interval_ns, d.increase_timer_ns) == (
        1 * US, 4 * US, 300 * US)
    assert replace(d, alpha_timer_ns=50 * US, rate_decrease_interval_ns=50 * US,
                   increase_timer_ns=55 * US, name=h.name, source=h.source) == h
    # mix/config.txt's DCQCN keys, absolute for its 100G topology
    c = PRESETS["hpcc-ns3-config"]
    assert (c.alpha_timer_ns, c.rate_decrease_interval_ns, c.increase_timer_ns) == (
        1 * US, 4 * US, 900 * US)
    assert (c.rai_bps, c.rhai_bps, c.min_rate_bps, c.scaling) == (50 * M, 100 * M, 100 * M,
                                                                  "absolute")
    assert (c.kmin_bytes, c.kmax_bytes, c.pmax) == (400_000, 1_600_000, 0.2)
    # no value of the paper preset is checked against the paper's text yet: all in checks
    assert {"alpha_timer_ns", "byte_counter_bytes", "rai_bps", "kmin_bytes"} <= set(p.checks)


def test_every_preset_names_its_source():
    for p in [*PRESETS.values(), *DCTCP_PRESETS.values()]:
        assert p.source, p.name
    assert "run.py --cc dcqcn " in PRESETS["hpcc-ns3"].source
    assert "run.py --cc dcqcn_paper" in PRESETS["hpcc-ns3-paper"].source
    assert "mix/config.txt" in PRESETS["hpcc-ns3-config"].source


def test_preset_names_are_the_tables_keys_and_import_without_numpy():
    assert DCQCN_PRESET_NAMES == tuple(PRESETS)
    assert DCTCP_PRESET_NAMES == tuple(DCTCP_PRESETS)
    assert DEFAULT_DCQCN_PRESET in PRESETS and DEFAULT_DCTCP_PRESET in DCTCP_PRESETS
    # the control plane's config loader imports them: no heavy dependency on the way
    code = ("import sys, agents.rdma.cc as cc; "
            "assert 'numpy' not in sys.modules, 'numpy'; print(len(cc.DCQCN_PRESET_NAMES))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(PRESETS))


def test_every_check_mark_names_a_real_field():
    names = {f.name for f in fields(DcqcnParams)}
    for p in PRESETS.values():
        assert set(p.checks) <= names, p.name
    dnames = {f.name for f in fields(DctcpParams)}
    for p in DCTCP_PRESETS.values():
        assert set(p.checks) <= dnames, p.name


def test_hpcc_rates_and_thresholds_scale_per_25g_and_the_paper_stays_absolute():
    h = preset("hpcc-ns3", 100 * G)
    # 100G = 4 x 25G: R_AI 5 -> 20 Mb/s, R_HAI 50 -> 200 Mb/s, Kmin 100 -> 400 KB, Kmax 1600 KB
    assert (h.rai_bps, h.rhai_bps) == (20 * M, 200 * M)
    assert (h.kmin_bytes, h.kmax_bytes) == (400_000, 1_600_000)
    assert h.min_rate_bps == 1 * G  # MIN_RATE is not scaled by HPCC's run.py
    # run.py's KMIN/KMAX are 100/400 KB per 25G: 200/800 KB at 50G
    assert preset("hpcc-ns3", 50 * G).kmin_bytes == 200_000
    assert preset("paper", 100 * G) is PRESETS["paper"]
    # explicit scaling of a 40G preset to 100G: 40 Mb/s x 100/40 = 100 Mb/s
    assert preset("paper", 100 * G, scale=True).rai_bps == 100 * M
    assert preset("hpcc-ns3", 100 * G, scale=False) is PRESETS["hpcc-ns3"]


def test_unknown_preset_and_bad_params_say_what_is_allowed():
    with pytest.raises(ValueError, match="unknown DCQCN preset 'dcqcn'; known: hpcc-ns3, "
                                         "hpcc-ns3-config, hpcc-ns3-paper, ns3-rdma, paper"):
        preset("dcqcn", 40 * G)
    with pytest.raises(ValueError, match="g must be in"):
        replace(PRESETS["paper"], g=0)
    with pytest.raises(ValueError, match="increase_rule must be one of"):
        replace(PRESETS["paper"], increase_rule="linux")
    with pytest.raises(ValueError, match="min_rate_bps 1e\\+09 is above the line rate"):
        DcqcnRp(PRESETS["hpcc-ns3"], 100 * M, 0)


# --- per-workload overrides --------------------------------------------------------------


def test_overrides_are_absolute_for_the_link_after_the_preset_is_scaled():
    # hpcc-ns3 at 100G: R_AI 5 -> 20 Mb/s, R_HAI 50 -> 200 Mb/s; an R_AI override is the
    # value this link gets, not a per-25G figure
    p = effective_params("dcqcn", "hpcc-ns3", 100 * G, {"rai_bps": 7 * M,
                                                         "byte_counter_bytes": 1_000_000})
    assert (p.rai_bps, p.rhai_bps, p.byte_counter_bytes) == (7 * M, 200 * M, 1_000_000)
    assert (p.name, p.source) == ("hpcc-ns3", PRESETS["hpcc-ns3"].source)
    assert p.kmin_bytes == 400_000                      # the scaling still applies elsewhere
    # an overridden [check] value is the caller's now
    q = with_overrides(PRESETS["paper"], {"g": 1 / 16, "alpha_timer_ns": 1 * US})
    assert "g" not in q.checks and "alpha_timer_ns" not in q.checks and "rai_bps" in q.checks
    d = effective_params("dctcp", "rfc8257", 100 * G, {"window_ns": 13 * US, "rai_bps": None})
    assert d.window_ns == 13 * US and d.additive_increase_bps == 1024 * 8 * 1e9 / (13 * US)
    assert effective_params("none", None, 100 * G) is None
    assert effective_params("dcqcn", "paper", 40 * G, {}) is PRESETS["paper"]


def test_overrides_drive_the_controller():
    r = make_cc("dcqcn", "paper", 40 * G, 0, {"initial_alpha": 0.5,
                                               "cut_with_updated_alpha": True})
    r.on_cnp(0)  # alpha = (255/256)(1/2) + 1/256 = 257/512 first, then the cut
    assert r.rate_bps == approx(40 * G * (1 - Fr(257, 1024)))


def test_tunables_are_every_behaviour_field_and_nothing_else():
    assert {"name", "source", "checks", "scaling", "reference_rate_bps", "kmin_bytes",
            "kmax_bytes", "pmax"}.isdisjoint(DCQCN_TUNABLE)
    assert len(DCQCN_TUNABLE) == len(fields(DcqcnParams)) - 8
    assert set(DCTCP_TUNABLE) == {"window_ns", "g", "rai_bps", "mss_bytes", "min_rate_bps",
                                  "initial_alpha", "cnp_marked_bytes"}


@pytest.mark.parametrize(("kind", "overrides", "words"), [
    ("dcqcn", {"alpha_timr_ns": 1}, ["unknown DCQCN parameter 'alpha_timr_ns'",
                                     "did you mean 'alpha_timer_ns'", "DCQCN parameters: "]),
    ("dcqcn", {"window_ns": 1}, ["window_ns is a DCTCP parameter"]),
    ("dctcp", {"kmin_bytes": 1}, ["kmin_bytes is the switch's ECN marking"]),
    ("dcqcn", {"g": 2}, ["g must be in (0, 1]"]),
    ("dcqcn", {"name": "x"}, ["unknown DCQCN parameter 'name'"]),
    ("none", {"g": 0.1}, ["no parameters"]),
])
def test_bad_overrides_say_which_and_what_is_allowed(kind, overrides, words):
    name = {"dcqcn": "paper", "dctcp": "rfc8257", "none": None}[kind]
    with pytest.raises(ValueError) as exc:
        effective_params(kind, name, 40 * G, overrides)
    for w in words:
        assert w in str(exc.value)


# --- DCQCN RP: hand-computed sequences, one per preset -----------------------------------


def test_paper_cnp_timer_cnp_sequence():
    r = rp("paper")  # 40G, alpha = 1 (initial), no timer armed
    assert r.next_event_ns() is None
    # t=0 CNP: Rt = Rc = 40G; Rc = 40G (1 - 1/2) = 20G; then alpha = (255/256) 1 + 1/256 = 1
    r.on_cnp(0)
    assert (r.rate_bps, r.target_rate_bps, r.alpha) == (20 * G, 40 * G, 1.0)
    assert r.next_event_ns() == 55 * US  # alpha timer and T both reset at t=0
    # t=55us: alpha timer: alpha = 255/256; T (stage 1 < F=5): Rc = (40G + 20G)/2 = 30G
    r.advance(55 * US)
    assert r.alpha == approx(KEEP)
    assert r.rate_bps == approx(30 * G)
    assert r.next_event_ns() == 110 * US
    # t=60us CNP: Rt = 30G; Rc = 30G (1 - (255/256)/2) = 30G x 257/512;
    # alpha = (255/256)(255/256) + 1/256 = 65281/65536 (the cut uses the OLD alpha)
    r.on_cnp(60 * US)
    rc = 30 * G * Fr(257, 512)
    alpha = KEEP * KEEP + G256
    assert alpha == Fr(65281, 65536)
    assert r.target_rate_bps == approx(30 * G)
    assert r.rate_bps == approx(rc)
    assert r.alpha == approx(alpha)
    assert r.next_event_ns() == 115 * US  # both timers restart from the CNP
    # t=115us: alpha = 65281/65536 x 255/256; T: Rc = (30G + Rc)/2
    r.advance(115 * US)
    assert r.alpha == approx(alpha * KEEP)
    assert r.rate_bps == approx((30 * G + rc) / 2)
    s = r.snapshot()
    assert s["counters"]["cnps"] == 2 and s["counters"]["rate_decreases"] == 2
    assert s["counters"]["increases"] == {"fast_recovery": 2, "additive": 0, "hyper": 0}
    assert s["stages"] == {"timer": 1, "byte_counter": 0}


def test_ns3_rdma_updates_alpha_before_the_cut_and_counts_bytes():
    r = rp("ns3-rdma")  # 40G, alpha = 0.5 (QbbNetDevice constructor)
    # t=0 CNP: alpha = (255/256)(1/2) + 1/256 = 257/512 FIRST, then Rt = 40G,
    # Rc = 40G (1 - 257/1024) = 40G x 767/1024 = 29.9609375G
    r.on_cnp(0)
    a1 = KEEP * Fr(1, 2) + G256
    assert a1 == Fr(257, 512)
    rc = 40 * G * Fr(767, 1024)
    assert r.alpha == approx(a1)
    assert r.rate_bps == approx(rc)
    assert r.next_event_ns() == 55 * US  # alpha 55 us, T 60 us
    r.advance(55 * US)  # alpha = 257/512 x 255/256
    assert r.alpha == approx(a1 * KEEP)
    assert r.rate_bps == approx(rc)
    assert r.next_event_ns() == 60 * US
    # t=60us: T stage 1: Rc = (40G + Rc)/2
    r.advance(60 * US)
    rc = (40 * G + rc) / 2
    assert r.rate_bps == approx(rc)
    # 299 999 bytes: not yet a BC event; one more byte: BC stage 1 -> Rc = (40G + Rc)/2
    r.on_bytes_sent(299_999, 61 * US)
    assert r.rate_bps == approx(rc)
    r.on_bytes_sent(1, 62 * US)
    rc = (40 * G + rc) / 2
    assert r.rate_bps == approx(rc)
    assert r.snapshot()["stages"] == {"timer": 1, "byte_counter": 1}
    assert r.next_event_ns() == 110 * US  # alpha 55+55; T 60+60=120


def test_hpcc_ns3_paper_periodic_alpha_deferred_cut_and_single_stage_increase():
    # These 50/50/55 us timers were the hpcc-ns3 preset's until it took run.py's
    # `--cc dcqcn` values (next test); they are run.py's `--cc dcqcn_paper`.
    r = rp("hpcc-ns3-paper", 100 * G)  # R_AI 20 Mb/s, R_HAI 200 Mb/s at 100G, F = 1
    # first CNP at t=0: alpha := 1, alpha timer and decrease tick armed at 50 us, no cut yet
    r.on_cnp(0)
    assert r.rate_bps == 100 * G
    assert r.next_event_ns() == 50 * US
    # t=50us: alpha timer first (no CNP since the first one): alpha = 255/256;
    # then the decrease tick: T stage 0 -> Rt NOT clamped (stays 100G);
    # Rc = 100G (1 - (255/256)/2) = 100G x 257/512
    r.advance(50 * US)
    rc = 100 * G * Fr(257, 512)
    assert r.alpha == approx(KEEP)
    assert r.rate_bps == approx(rc)
    assert r.target_rate_bps == 100 * G
    assert r.next_event_ns() == 100 * US  # alpha and tick at 100, T at 50+55 = 105
    # t=105us: T event, 0 events before it (< F=1): fast recovery Rc = (100G + Rc)/2
    r.advance(105 * US)
    rc = (100 * G + rc) / 2
    assert r.rate_bps == approx(rc)
    # CNPs at 120 and 130 us: latched; one cut at the 150 us tick.
    # t=100 (alpha, no CNP): alpha = (255/256)^2; t=150: CNP seen: alpha = (255/256)^3 + 1/256
    r.on_cnp(120 * US)
    r.on_cnp(130 * US)
    assert r.rate_bps == approx(rc)
    r.advance(150 * US)
    alpha = KEEP**3 + G256
    rt = rc  # T stage 1 != 0 -> Rt = Rc
    rc = rc * (1 - alpha / 2)
    assert r.alpha == approx(alpha)
    assert r.target_rate_bps == approx(rt)
    assert r.rate_bps == approx(rc)
    assert r.snapshot()["counters"]["rate_decreases"] == 2
    # T restarts at 150: 205 fast; 260 additive (Rt += 20M); 315, 370 hyper (Rt += 200M each,
    # HPCC does not multiply by i)
    r.advance(205 * US)
    rc = (rt + rc) / 2
    assert r.rate_bps == approx(rc)
    r.advance(260 * US)
    rt += 20 * M
    rc = (rt + rc) / 2
    assert (r.target_rate_bps, r.rate_bps) == (approx(rt), approx(rc))
    r.advance(370 * US)
    rt += 200 * M
    rc = (rt + rc) / 2
    rt += 200 * M
    rc = (rt + rc) / 2
    assert (r.target_rate_bps, r.rate_bps) == (approx(rt), approx(rc))
    assert r.phase == "hyper"
    # alpha kept decaying every 50 us with no CNP: 200, 250, 300, 350
    assert r.alpha == approx(alpha * KEEP**4)
    assert r.snapshot()["counters"]["increases"] == {"fast_recovery": 2, "additive": 1,
                                                     "hyper": 2}


def test_hpcc_ns3_run_py_dcqcn_timers_1us_alpha_4us_cut_300us_increase():
    r = rp("hpcc-ns3", 100 * G)  # run.py --cc dcqcn; R_AI 20 Mb/s, R_HAI 200 Mb/s at 100G
    # first CNP at t=0: alpha := 1; alpha timer every 1 us and decrease tick every 4 us from 0
    r.on_cnp(0)
    assert r.next_event_ns() == 1 * US
    # alpha at 1, 2, 3, 4 us (no CNP in those periods): 1 -> (255/256)^4; the 4 us tick
    # follows the alpha update and cuts with it; T stage 0: Rt stays at line rate
    r.advance(4 * US)
    a4 = KEEP**4
    rc1 = 100 * G * (1 - a4 / 2)
    assert r.alpha == approx(a4)
    assert (r.rate_bps, r.target_rate_bps) == (approx(rc1), 100 * G)
    # CNP at 10 us (after the 10 us decay): a(11) = (255/256)^11 + 1/256, a(12) = a(11) 255/256;
    # the 8 us tick had nothing to do, the 12 us one cuts; still no increase: Rt unclamped
    r.on_cnp(10 * US)
    r.advance(12 * US)
    a12 = (KEEP**11 + G256) * KEEP
    rc2 = rc1 * (1 - a12 / 2)
    assert r.alpha == approx(a12)
    assert (r.rate_bps, r.target_rate_bps) == (approx(rc2), 100 * G)
    # T restarted at the 12 us cut: 312 us, fast recovery (0 events before it < F = 1)
    r.advance(312 * US)
    rc3 = (100 * G + rc2) / 2
    assert r.rate_bps == approx(rc3)
    # CNP at 320 us (a tick time: the tick fires first, with nothing latched); alpha at 321
    # counts it, the 324 us tick cuts; an increase happened since the last cut: Rt = Rc
    r.on_cnp(320 * US)
    r.advance(324 * US)
    a324 = (a12 * KEEP**308 * KEEP + G256) * KEEP**3
    rc4 = rc3 * (1 - a324 / 2)
    rt = rc3
    assert r.alpha == approx(a324)
    assert (r.rate_bps, r.target_rate_bps) == (approx(rc4), approx(rt))
    # T from 324: 624 fast recovery, 924 additive (Rt += 20M), 1224 hyper (Rt += 200M)
    r.advance(624 * US)
    rc = (rt + rc4) / 2
    assert r.rate_bps == approx(rc)
    r.advance(924 * US)
    rt += 20 * M
    rc = (rt + rc) / 2
    assert (r.phase, r.target_rate_bps, r.rate_bps) == ("additive", approx(rt), approx(rc))
    r.advance(1224 * US)
    rt += 200 * M
    rc = (rt + rc) / 2
    assert (r.phase, r.target_rate_bps, r.rate_bps) == ("hyper", approx(rt), approx(rc))
    assert r.alpha == approx(a324 * KEEP**900)
    c = r.snapshot()["counters"]
    assert c["rate_decreases"] == 3 and c["alpha_updates"] == 1224
    assert c["increases"] == {"fast_recovery": 2, "additive": 1, "hyper": 1}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_alpha_decays_by_one_minus_g_per_period(name):
    r = rp(name)
    p = r.params
    r.on_cnp(0)
    a0 = Fr(r.alpha)  # just after the first CNP (exact binary fraction)
    # hpcc-ns3 latches the first CNP without counting it: its periods all decay too
    k = 12
    r.advance(k * p.alpha_timer_ns - 1)  # one ns short of the k-th expiry: k-1 decays
    assert r.alpha == approx(a0 * KEEP ** (k - 1))
    r.advance(k * p.alpha_timer_ns)
    assert r.alpha == approx(a0 * KEEP**k)
    assert r.snapshot()["counters"]["alpha_updates"] == k


def test_fast_recovery_halves_the_gap_each_step_then_additive_kicks_in():
    r = rp("paper")
    r.on_cnp(0)  # Rc = 20G, Rt = 40G, gap 20G
    r.on_cnp(1 * US)  # alpha still 1: Rt = 20G, Rc = 10G, gap 10G; T and alpha now at 56 us
    assert (r.target_rate_bps, r.rate_bps) == (20 * G, 10 * G)
    for k in range(1, 5):  # T stages 1..4 < F = 5: fast recovery
        r.advance(1 * US + k * 55 * US)
        assert r.target_rate_bps - r.rate_bps == approx(Fr(10 * G, 2**k))
        assert r.phase == "fast_recovery"
    # T stage 5 = F, BC stage 0: additive: Rt = 20G + 40M, Rc = (Rt + Rc)/2
    rc = 20 * G - Fr(10 * G, 16)
    r.advance(1 * US + 5 * 55 * US)
    rt = 20 * G + 40 * M
    assert r.phase == "additive"
    assert r.target_rate_bps == approx(rt)
    assert r.rate_bps == approx((rt + rc) / 2)


def test_additive_then_hyper_increase_at_the_right_stage():
    r = rp("paper")  # F = 5, BC = 10 MB, R_AI 40M, R_HAI 200M, T = 55 us
    r.on_cnp(0)
    r.on_cnp(1 * US)  # Rt = 20G, Rc = 10G (as above); T at 56 us
    bc = 10_000_000
    rt, rc = Fr(20 * G), Fr(10 * G)
    for t_us in (2, 3, 4, 5):  # BC stages 1..4: fast recovery
        r.on_bytes_sent(bc, t_us * US)
        rc = (rt + rc) / 2
    for t_us in (56, 111, 166, 221):  # T stages 1..4 (BC 4): fast recovery
        r.advance(t_us * US)
        rc = (rt + rc) / 2
    assert r.rate_bps == approx(rc)  # gap 10G / 2^8
    assert r.rate_bps == approx(20 * G - Fr(10 * G, 256))
    r.advance(276 * US)  # T 5, BC 4: one counter reached F -> additive: Rt += 40M
    rt += 40 * M
    rc = (rt + rc) / 2
    assert (r.phase, r.target_rate_bps, r.rate_bps) == ("additive", approx(rt), approx(rc))
    r.on_bytes_sent(bc, 280 * US)  # T 5, BC 5: both >= F -> hyper, i = min(5,5)-5+1 = 1
    rt += 200 * M
    rc = (rt + rc) / 2
    assert (r.phase, r.target_rate_bps, r.rate_bps) == ("hyper", approx(rt), approx(rc))
    r.on_bytes_sent(bc, 281 * US)  # T 5, BC 6: i = min(5,6)-5+1 = 1
    rt += 200 * M
    rc = (rt + rc) / 2
    assert r.target_rate_bps == approx(rt)
    r.advance(331 * US)  # T 6, BC 6: i = 2 -> Rt += 400M
    rt += 400 * M
    rc = (rt + rc) / 2
    assert (r.target_rate_bps, r.rate_bps) == (approx(rt), approx(rc))
    assert r.snapshot()["counters"]["increases"] == {"fast_recovery": 8, "additive": 1,
                                                     "hyper": 3}


def test_ns3_rdma_halves_timer_and_byte_counter_once_in_hyper():
    r = rp("ns3-rdma")  # T = 60 us, BC = 300 KB, F = 5
    r.on_cnp(0)
    for k in range(5):  # BC stages 1..5 at 1..5 us
        r.on_bytes_sent(300_000, (1 + k) * US)
    assert r.phase == "additive"  # BC 5 >= F, T 0 < F
    r.advance(240 * US)  # T stages 1..4: additive
    assert r.snapshot()["timers_ns"]["increase"] == 300 * US
    r.advance(300 * US)  # T 5: hyper; the phase BEFORE it was additive: next in a full T
    assert r.phase == "hyper"
    assert r.snapshot()["timers_ns"]["increase"] == 360 * US
    r.advance(360 * US)  # fired while in hyper: next one in T/2
    assert r.snapshot()["timers_ns"]["increase"] == 390 * US
    # the byte counter in hyper: the first event restarts it at BC/2 = 150 KB
    r.on_bytes_sent(300_000, 361 * US)
    assert r.snapshot()["stages"]["byte_counter"] == 6
    r.on_bytes_sent(149_999, 362 * US)
    assert r.snapshot()["stages"]["byte_counter"] == 6
    r.on_bytes_sent(1, 363 * US)
    assert r.snapshot()["stages"]["byte_counter"] == 7


def test_ns3_rdma_target_shrink_quirk_when_target_is_not_clamped():
    # ns3-rdma's AdjustRates: on the first increase after a cut, if Rt > 10 Rc then Rt /= 8.
    # Only reachable without CLAMP_TARGET_RATE, so turn that off.
    p = replace(preset("ns3-rdma", 40 * G), target_clamp="after_increase")
    r = DcqcnRp(p, 40 * G, 0)
    alpha, rc = Fr(1, 2), Fr(40 * G)
    n = 0
    while rc * 10 >= 40 * G:  # CNPs 1 us apart, no increase in between: Rt stays 40G
        n += 1
        r.on_cnp(n * US)
        alpha = KEEP * alpha + G256  # updated before the cut
        rc = rc * (1 - alpha / 2)
    assert r.rate_bps == approx(rc) and r.target_rate_bps == 40 * G
    r.advance(n * US + 60 * US)  # T stage 1 and Rt > 10 Rc: Rt = 40G / 8 = 5G, Rc = avg
    assert r.target_rate_bps == approx(5 * G)
    assert r.rate_bps == approx((5 * G + rc) / 2)


def test_rates_clamp_to_line_rate_and_min_rate():
    r = rp("paper")  # min 100 Mb/s
    for k in range(9):  # alpha stays 1: each CNP halves Rc: 40G / 2^9 = 78.125M < 100M
        r.on_cnp(k * US)
    assert r.rate_bps == 100 * M
    assert r.target_rate_bps == approx(40 * G / 2**8)
    r.on_cnp(9 * US)
    assert (r.rate_bps, r.target_rate_bps) == (100 * M, 100 * M)
    # a long quiet period: Rc climbs back and never exceeds line rate; Rt hits it exactly
    for k in range(200):
        r.on_bytes_sent(10_000_000, 10 * US + k * US)
    r.advance(50_000 * US)
    assert r.target_rate_bps == 40 * G
    assert r.rate_bps <= 40 * G
    assert r.rate_bps == approx(40 * G)


def test_next_event_is_the_earliest_armed_timer():
    r = rp("ns3-rdma")  # alpha 55 us, T 60 us, timers armed by the first CNP
    assert r.next_event_ns() is None
    r.advance(1_000 * US)
    assert r.next_event_ns() is None  # nothing armed: nothing to wake up for
    r.on_cnp(1_000 * US)
    seen = []
    t = 1_000 * US
    for _ in range(6):
        t = r.next_event_ns()
        seen.append(t - 1_000 * US)
        r.advance(t)
    # alpha every 55 us, T every 60 us, merged in time order
    assert seen == [55 * US, 60 * US, 110 * US, 120 * US, 165 * US, 180 * US]
    h = rp("hpcc-ns3", 100 * G)
    h.on_cnp(7)
    assert h.next_event_ns() == 7 + 1 * US  # run.py --cc dcqcn: alpha every 1 us
    h = rp("hpcc-ns3-paper", 100 * G)
    h.on_cnp(7)
    assert h.next_event_ns() == 7 + 50 * US
    assert NoCc(40 * G, 0).next_event_ns() is None


def _scripted_run(name: str, seed: int, chunk_ns: int | None) -> dict:
    rng = random.Random(seed)
    extra = random.Random(seed + 1)  # its own stream, so the scripted events stay the same
    r = rp(name, 100 * G)
    t = 0
    for _ in range(400):
        t += rng.randrange(1, 30 * US)
        if chunk_ns:  # many small advances (never past t) instead of one
            while r.next_event_ns() is not None and r.next_event_ns() < t:
                r.advance(min(t, r.next_event_ns() + extra.randrange(0, chunk_ns)))
        ev = rng.random()
        if ev < 0.2:
            r.on_cnp(t)
        elif ev < 0.9:
            r.on_bytes_sent(rng.randrange(1, 200_000), t)
        else:
            r.advance(t)
    return r.snapshot()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_same_inputs_same_outputs_however_often_advance_is_called(name):
    a = _scripted_run(name, seed=7, chunk_ns=None)
    assert a == _scripted_run(name, seed=7, chunk_ns=None)
    assert a == _scripted_run(name, seed=7, chunk_ns=3 * US)  # bit for bit
    assert a["counters"]["rate_decreases"] > 0


def test_time_never_runs_backwards():
    r = rp("paper")
    r.on_cnp(100 * US)
    r.on_bytes_sent(1, 50 * US)  # late report: treated as 100 us
    assert r.next_event_ns() == 155 * US
    r.on_cnp(10 * US)  # treated as 100 us: timers restart from 100 us, not 10
    assert r.next_event_ns() == 155 * US


def test_ecn_echo_with_marks_is_a_cnp_for_dcqcn():
    r = rp("paper")
    r.on_ecn_echo(0, 4096, 1 * US)
    assert r.rate_bps == 40 * G
    r.on_ecn_echo(1024, 4096, 2 * US)
    assert r.rate_bps == 20 * G
    assert r.snapshot()["counters"]["cnps"] == 1
    assert r.snapshot()["counters"]["ecn_echoes"] == 2


# --- DCQCN NP ----------------------------------------------------------------------------


def test_np_sends_at_most_one_cnp_per_interval():
    np_ = DcqcnNp(50 * US)
    assert np_.on_packet(False, 0) is False
    assert np_.on_packet(True, 1 * US) is True  # first CE: CNP now
    assert np_.on_packet(True, 20 * US) is False  # within 50 us of the last CNP
    assert np_.on_packet(True, 50 * US) is False  # 49 us after it
    assert np_.on_packet(False, 60 * US) is False
    assert np_.on_packet(True, 51 * US) is True  # exactly 50 us after: another CNP
    assert np_.on_packet(True, 100 * US) is False
    assert np_.on_packet(True, 101 * US) is True
    assert np_.snapshot()["counters"] == {"packets": 8, "ce_packets": 6, "cnps_sent": 3,
                                          "ce_coalesced": 3}


def test_np_timer_mode_runs_slots_from_the_first_mark():
    np_ = DcqcnNp(50 * US, mode="timer")
    assert np_.on_packet(False, 0) is False  # unmarked packets do not start the timer
    assert np_.on_packet(True, 10 * US) is True  # slot [10, 60)
    assert np_.on_packet(True, 59 * US) is False
    assert np_.on_packet(True, 70 * US) is True  # slot [60, 110)
    assert np_.on_packet(True, 115 * US) is True  # slot [110, 160): only 45 us later
    assert np_.on_packet(True, 150 * US) is False


def test_np_interval_zero_echoes_every_mark():
    np_ = DcqcnNp(0)
    assert [np_.on_packet(ce, 5) for ce in (True, True, False, True)] == [True, True, False,
                                                                           True]


def test_np_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode must be one of"):
        DcqcnNp(50 * US, mode="sampled")
    with pytest.raises(ValueError, match="cnp_interval_ns"):
        DcqcnNp(-1)


# --- DCTCP -------------------------------------------------------------------------------


def test_dctcp_alpha_per_window_and_one_cut_per_window():
    p = DctcpParams(name="t", window_ns=10 * US, g=1 / 16, rai_bps=100 * M,
                    min_rate_bps=100 * M)
    d = DctcpRp(p, 40 * G, 0)
    d.on_bytes_sent(8_000, 1 * US)
    d.on_ecn_echo(0, 4_000, 2 * US)
    assert d.rate_bps == 40 * G
    # first mark of the window: rate = 40G (1 - 1/2) = 20G with the current alpha = 1
    d.on_ecn_echo(1_000, 4_000, 3 * US)
    assert d.rate_bps == 20 * G
    d.on_ecn_echo(1_000, 2_000, 4 * US)  # second mark, same window: no second cut
    d.on_cnp(5 * US)  # nor for a CNP (counts mss 1024 marked bytes)
    assert d.rate_bps == 20 * G
    # window closes at 10 us: F = (1000+1000+1024) / (4000+4000+2000) = 3024/10000
    # alpha = (15/16) 1 + (1/16)(3024/10000); marks were seen -> no additive increase
    d.advance(10 * US)
    f1 = Fr(3024, 10000)
    a1 = Fr(15, 16) + Fr(1, 16) * f1
    assert d.alpha == approx(a1)
    assert d.rate_bps == 20 * G
    # next window: one CNP only, no ACK totals -> F uses bytes sent (2048): F = 1024/2048
    d.on_bytes_sent(2_048, 11 * US)
    d.on_cnp(12 * US)  # the next window may cut again: rate = 20G (1 - a1/2)
    rate = 20 * G * (1 - a1 / 2)
    assert d.rate_bps == approx(rate)
    d.advance(20 * US)
    a2 = Fr(15, 16) * a1 + Fr(1, 16) * Fr(1, 2)
    assert d.alpha == approx(a2)
    # a clean window with traffic: F = 0, alpha decays, rate += 100 Mb/s
    d.on_ecn_echo(0, 5_000, 25 * US)
    d.advance(30 * US)
    assert d.alpha == approx(Fr(15, 16) * a2)
    assert d.rate_bps == approx(rate + 100 * M)
    # idle windows change nothing (and are skipped, not looped over)
    d.advance(10**12)
    assert d.alpha == approx(Fr(15, 16) * a2)
    assert d.rate_bps == approx(rate + 100 * M)
    assert d.next_event_ns() == 10**12 + 10 * US
    c = d.snapshot()["counters"]
    assert (c["rate_decreases"], c["windows"], c["cnps"], c["ecn_echoes"]) == (2, 3, 2, 4)


def test_dctcp_additive_increase_defaults_to_one_mss_per_window_and_caps_at_line_rate():
    p = DctcpParams(name="t", window_ns=8 * US, mss_bytes=1000)
    assert p.additive_increase_bps == 1_000 * 8 * 1e9 / (8 * US)  # 1 Gb/s
    d = DctcpRp(p, 10 * G, 0)
    d.on_cnp(1)  # 10G -> 5G
    for k in range(1, 10):
        d.on_bytes_sent(1_000, k * 8 * US + 1)
    d.advance(80 * US)
    # window 1 had the mark; windows 2..10 are clean: 5G + 9 x 1G capped at 10G
    assert d.rate_bps == 10 * G


def test_dctcp_presets():
    h = dctcp_preset("hpcc-ns3", 100 * G)
    assert h.additive_increase_bps == 615 * M
    assert h.k_bytes == 300_000  # 30 KB per 10G
    assert dctcp_preset("rfc8257", 100 * G).g == 1 / 16


# --- no CC, the common interface, the factory --------------------------------------------


def test_nocc_is_always_line_rate():
    n = NoCc(100 * G, 0)
    n.on_cnp(1)
    n.on_ecn_echo(100, 100, 2)
    n.on_bytes_sent(1_000, 3)
    assert n.advance(10**9) == 100 * G
    assert n.rate_bps == 100 * G
    assert n.snapshot()["counters"] == {"cnps": 1, "ecn_echoes": 1, "rate_decreases": 0,
                                        "bytes_sent": 1_000, "increases": {}}


def _interface(cls) -> dict:
    out = {}
    for name in ("on_cnp", "on_ecn_echo", "on_bytes_sent", "advance", "next_event_ns",
                 "snapshot"):
        sig = inspect.signature(getattr(cls, name))
        out[name] = [(p.name, p.kind) for p in sig.parameters.values()]
    return out


def test_transport_facing_interface_is_identical_across_the_three():
    ccs = [make_cc("dcqcn", "hpcc-ns3", 100 * G, 0), make_cc("dctcp", "rfc8257", 100 * G, 0),
           make_cc("none", None, 100 * G, 0)]
    assert [type(c) for c in ccs] == [DcqcnRp, DctcpRp, NoCc]
    assert [c.kind for c in ccs] == list(CC_KINDS)
    ref = _interface(DcqcnRp)
    for c in ccs:
        assert isinstance(c, RateController)
        assert _interface(type(c)) == ref
        assert isinstance(type(c).rate_bps, property)
        assert c.on_cnp(5) == c.rate_bps
        assert c.on_ecn_echo(1, 2, 6) == c.rate_bps
        assert c.on_bytes_sent(100, 7) == c.rate_bps
        assert c.advance(8) == c.rate_bps
        snap = c.snapshot()
        assert {"kind", "preset", "line_rate_bps", "rate_bps", "next_event_ns",
                "counters"} <= set(snap)
        assert {"cnps", "ecn_echoes", "rate_decreases", "bytes_sent",
                "increases"} <= set(snap["counters"])


def test_make_cc_rejects_unknown_kinds_and_presets():
    with pytest.raises(ValueError, match="unknown congestion control kind 'timely'"):
        make_cc("timely", "paper", 100 * G, 0)
    with pytest.raises(ValueError, match="unknown DCTCP preset 'paper'; known: hpcc-ns3, "
                                         "rfc8257"):
        make_cc("dctcp", "paper", 100 * G, 0)


# --- a pure fluid-model sanity run -------------------------------------------------------


def _red(q: float, p: DcqcnParams) -> float:
    if q <= p.kmin_bytes:
        return 0.0
    if q <= p.kmax_bytes:
        return p.pmax * (q - p.kmin_bytes) / (p.kmax_bytes - p.kmin_bytes)
    return 1.0


def _two_senders(name: str, nic_bps=40 * G, bottleneck_bps=25 * G, step_ns=1 * US,
                 join_ns=3_300 * US, end_ns=60_000 * US, feedback_ns=4 * US, mtu=1000):
    """Two DCQCN senders (NIC line rate nic_bps) into one bottleneck port.

    Fluid queue q += (r1 + r2 - C) dt; the port marks with RED (the preset's Kmin/Kmax/Pmax
    for the bottleneck's speed); a deterministic mark credit per flow turns the marking
    probability into CE packets; each receiver's NP turns CE packets into CNPs (its
    cnp_interval), which reach the sender feedback_ns later. Sender B joins at join_ns.
    """
    rp_params = preset(name, nic_bps)
    cp = preset(name, bottleneck_bps)
    senders = [DcqcnRp(rp_params, nic_bps, 0), DcqcnRp(rp_params, nic_bps, 0)]
    nps = [DcqcnNp(rp_params.cnp_interval_ns, rp_params.np_mode) for _ in senders]
    start = (0, join_ns)
    q, credit, in_flight, trace = 0.0, [0.0, 0.0], [], []
    t = 0
    while t < end_ns:
        t += step_ns
        while in_flight and in_flight[0][0] <= t:
            senders[in_flight.pop(0)[1]].on_cnp(t)
        rates = []
        for i, s in enumerate(senders):
            rate = s.advance(t) if t > start[i] else 0.0
            if rate:
                s.on_bytes_sent(round(rate * step_ns / 8e9), t)
            rates.append(rate)
        q = max(0.0, q + (sum(rates) - bottleneck_bps) * step_ns / 8e9)
        mark_p = _red(q, cp)
        for i, rate in enumerate(rates):
            if not rate:
                continue
            credit[i] += mark_p * rate * step_ns / 8e9 / mtu
            ce = credit[i] >= 1
            credit[i] -= int(credit[i])
            if nps[i].on_packet(ce, t):
                in_flight.append((t + feedback_ns, i))
        trace.append((t, rates[0], rates[1], q))
    return trace, cp


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_two_dcqcn_senders_converge_to_a_fair_share(name):
    trace, cp = _two_senders(name)
    tail = [row for row in trace if row[0] > 45_000 * US]  # the last 15 ms
    mean_a = sum(r[1] for r in tail) / len(tail)
    mean_b = sum(r[2] for r in tail) / len(tail)
    mean_q = sum(r[3] for r in tail) / len(tail)
    print(f"\n{name}: bottleneck 25G, Kmin {cp.kmin_bytes / 1e3:g} KB, "
          f"Kmax {cp.kmax_bytes / 1e3:g} KB")
    for t, a, b, q in trace[999::3000]:
        print(f"  {t / 1e6:5.1f} ms  A {a / 1e9:6.2f}  B {b / 1e9:6.2f} Gb/s  q {q / 1e3:7.1f} KB")
    print(f"  last 15 ms: A {mean_a / 1e9:.2f}  B {mean_b / 1e9:.2f} Gb/s  "
          f"mean q {mean_q / 1e3:.1f} KB  max q {max(r[3] for r in tail) / 1e3:.1f} KB")
    assert abs(mean_a - mean_b) <= 0.2 * max(mean_a, mean_b)
    assert 0.5 * cp.kmin_bytes <= mean_q <= cp.kmax_bytes
    assert max(r[3] for r in tail) <= 1.5 * cp.kmax_bytes
