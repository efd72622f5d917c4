"""The PHY model: catalogue figures, FEC maths, channel models, warnings, CLI."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from fractions import Fraction

import pytest

import testbed.cli
from testbed.phy import (
    KP4,
    KR4,
    PORT_TYPES,
    PhyResult,
    UnknownPortType,
    codeword_error_probability,
    evaluate,
    pre_fec_ber,
    symbol_error_probability,
)

COPPER = [name for name, p in PORT_TYPES.items() if p.medium == "copper"]
OPTICS = [name for name, p in PORT_TYPES.items() if p.medium != "copper"]


# ---- catalogue figures -------------------------------------------------------

def test_400gbase_dr4_has_the_published_figures():
    r = evaluate("400GBASE-DR4", 100.0)
    assert r.medium == "smf"
    assert r.lanes == 4
    assert r.modulation == "PAM4"
    assert r.bits_per_symbol == 2
    assert r.baud_gbd == 53.125
    assert r.lane_rate_gbps == 106.25
    assert r.raw_rate_gbps == 425.0
    assert r.mac_rate_gbps == 400.0
    assert r.mac_rate_bps == 400_000_000_000
    assert type(r.mac_rate_bps) is int
    assert r.fec == "RS(544,514) KP4"
    assert r.fec_t == 15
    assert r.max_reach_m == 500.0


@pytest.mark.parametrize(
    "name, lanes, modulation, baud, lane_rate, raw, mac, fec",
    [
        ("100GBASE-CR4", 4, "NRZ", 25.78125, 25.78125, 103.125, 100, "RS(528,514) KR4"),
        ("100GBASE-SR4", 4, "NRZ", 25.78125, 25.78125, 103.125, 100, "RS(528,514) KR4"),
        ("100GBASE-CR1", 1, "PAM4", 53.125, 106.25, 106.25, 100, "RS(544,514) KP4"),
        ("100GBASE-DR", 1, "PAM4", 53.125, 106.25, 106.25, 100, "RS(544,514) KP4"),
        ("200GBASE-DR4", 4, "PAM4", 26.5625, 53.125, 212.5, 200, "RS(544,514) KP4"),
        ("400GBASE-CR8", 8, "PAM4", 26.5625, 53.125, 425.0, 400, "RS(544,514) KP4"),
        ("400GBASE-SR8", 8, "PAM4", 26.5625, 53.125, 425.0, 400, "RS(544,514) KP4"),
        ("400GBASE-FR4", 4, "PAM4", 53.125, 106.25, 425.0, 400, "RS(544,514) KP4"),
        ("800GBASE-CR8", 8, "PAM4", 53.125, 106.25, 850.0, 800, "RS(544,514) KP4"),
        ("800GBASE-DR8", 8, "PAM4", 53.125, 106.25, 850.0, 800, "RS(544,514) KP4"),
        ("1.6TBASE-CR8", 8, "PAM4", 106.25, 212.5, 1700.0, 1600, "RS(544,514) KP4"),
        ("1.6TBASE-DR8", 8, "PAM4", 106.25, 212.5, 1700.0, 1600, "RS(544,514) KP4"),
    ],
)
def test_port_type_figures_are_exact(name, lanes, modulation, baud, lane_rate, raw, mac, fec):
    r = evaluate(name, 1.0)
    assert (r.lanes, r.modulation, r.baud_gbd, r.lane_rate_gbps, r.raw_rate_gbps) == (
        lanes, modulation, baud, lane_rate, raw)
    assert r.mac_rate_bps == mac * 10**9
    assert r.fec == fec


def test_catalogue_covers_the_required_port_types():
    required = {
        "100GBASE-CR4", "100GBASE-SR4", "100GBASE-CR1", "100GBASE-DR",
        "200GBASE-CR4", "200GBASE-SR4", "200GBASE-DR4",
        "400GBASE-CR8", "400GBASE-SR8", "400GBASE-DR4", "400GBASE-FR4",
        "800GBASE-CR8", "800GBASE-DR8", "1.6TBASE-CR8", "1.6TBASE-DR8",
    }
    assert required <= set(PORT_TYPES)
    assert all(name == p.name for name, p in PORT_TYPES.items())


@pytest.mark.parametrize("name", list(PORT_TYPES))
def test_lane_rates_follow_transcoding_and_fec_overhead(name):
    p = PORT_TYPES[name]
    # Exact rational arithmetic: the stored literals are exact binary fractions.
    line = Fraction(p.lanes) * Fraction(p.lane_rate_gbps)
    assert line == p.mac_rate_gbps * Fraction(257, 256) * Fraction(p.fec.n, p.fec.k)
    assert Fraction(p.baud_gbd) * p.bits_per_symbol == Fraction(p.lane_rate_gbps)


def test_pam4_costs_9_54_db_of_snr_and_nrz_nothing():
    pam4 = evaluate("400GBASE-DR4", 1.0).snr_penalty_db
    assert pam4 == 20 * math.log10(3)
    assert round(pam4, 2) == 9.54
    assert evaluate("100GBASE-CR4", 1.0).snr_penalty_db == 0.0


def test_fec_codes_have_the_standard_parameters():
    assert (KP4.n, KP4.k, KP4.symbol_bits, KP4.t, KP4.codeword_bits) == (544, 514, 10, 15, 5440)
    assert (KR4.n, KR4.k, KR4.symbol_bits, KR4.t, KR4.codeword_bits) == (528, 514, 10, 7, 5280)
    assert KP4.ber_threshold == 2.4e-4


# ---- FEC maths ---------------------------------------------------------------

def test_kp4_at_its_threshold_leaves_about_1e_12_uncorrectable_codewords():
    p_sym = symbol_error_probability(2.4e-4, 10)
    assert p_sym == pytest.approx(2.3974e-3, rel=1e-4)   # ~ 10 x BER
    p_cw = codeword_error_probability(544, 15, p_sym)
    assert 1e-14 < p_cw < 1e-10
    assert p_cw == pytest.approx(8.15e-13, rel=1e-2)


def test_codeword_tail_matches_exact_binomial_sums():
    for n, t, p in [(20, 3, 0.1), (30, 0, 0.01), (50, 10, 0.3), (544, 15, 0.02)]:
        exact = sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(t + 1, n + 1))
        assert codeword_error_probability(n, t, p) == pytest.approx(exact, rel=1e-9)


def test_codeword_tail_edges_and_deep_tail():
    assert codeword_error_probability(544, 15, 0.0) == 0.0
    assert codeword_error_probability(544, 15, 1.0) == 1.0
    # Deep in the tail the first term dominates: C(n, t+1) p^(t+1).
    p = 1e-6
    leading = math.comb(544, 16) * p**16 * (1 - p) ** 528
    assert codeword_error_probability(544, 15, p) == pytest.approx(leading, rel=1e-3)
    assert 0 < codeword_error_probability(544, 15, p) < 1e-50


def test_frame_loss_counts_codewords_a_jumbo_frame_touches():
    r = evaluate("100GBASE-CR1", 2.2)
    # (9000 + 18) B x 8 x 257/256 = 72426 bits over 5140-bit messages: 15, +1 for straddling.
    assert r.codewords_per_frame == 16
    assert r.frame_loss_ratio == pytest.approx(1 - (1 - r.post_fec_codeword_error) ** 16)
    small = evaluate("100GBASE-CR1", 2.2, mtu_bytes=1500)
    assert small.codewords_per_frame == 4
    assert small.frame_loss_ratio < r.frame_loss_ratio


# ---- channel models ----------------------------------------------------------

@pytest.mark.parametrize("name", COPPER)
def test_copper_ber_rises_monotonically_with_length(name):
    reach = PORT_TYPES[name].max_reach_m
    lengths = [reach * i / 20 for i in range(0, 41)]
    bers = [pre_fec_ber(PORT_TYPES[name], length) for length in lengths]
    assert all(a < b for a, b in zip(bers, bers[1:], strict=False))


@pytest.mark.parametrize("name", COPPER)
def test_copper_crosses_the_fec_threshold_at_the_published_reach(name):
    p = PORT_TYPES[name]
    threshold = p.fec.ber_threshold
    at_reach = evaluate(name, p.max_reach_m)
    assert threshold / 2 <= at_reach.pre_fec_ber <= threshold * 2
    assert evaluate(name, 0.9 * p.max_reach_m).pre_fec_ber < threshold
    assert evaluate(name, 1.1 * p.max_reach_m).pre_fec_ber > threshold
    assert at_reach.within_reach
    assert not evaluate(name, p.max_reach_m + 0.01).within_reach


@pytest.mark.parametrize("name", OPTICS)
def test_optics_hold_their_nominal_ber_within_reach_then_degrade(name):
    p = PORT_TYPES[name]
    reach = p.max_reach_m
    inside = [evaluate(name, reach * f).pre_fec_ber for f in (0.0, 0.5, 1.0)]
    assert inside == [p.nominal_ber] * 3
    assert 1e-9 <= p.nominal_ber <= 1e-6
    beyond = [evaluate(name, reach * f).pre_fec_ber for f in (1.05, 1.2, 1.5, 2.0)]
    assert all(a < b for a, b in zip([p.nominal_ber, *beyond], beyond, strict=False))
    assert beyond[-2] > p.fec.ber_threshold          # 1.5x reach is past the FEC
    assert evaluate(name, reach).within_reach
    assert not evaluate(name, reach * 1.001).within_reach


def test_delay_is_propagation_plus_fec_once():
    fiber = evaluate("400GBASE-DR4", 100.0)
    assert fiber.propagation_delay_ns == pytest.approx(490.0)
    assert fiber.fec_delay_ns == 110.0
    assert fiber.delay_ns == pytest.approx(600.0)
    dac = evaluate("400GBASE-CR4", 2.0)
    assert dac.propagation_delay_ns == pytest.approx(9.52)
    assert evaluate("100GBASE-CR4", 1.0).fec_delay_ns < dac.fec_delay_ns   # KR4, NRZ


def test_module_power_per_end_and_per_link():
    assert evaluate("800GBASE-CR8", 1.0).power_w <= 0.1
    assert 8 <= evaluate("400GBASE-DR4", 1.0).power_w <= 9
    r = evaluate("800GBASE-DR8", 1.0)
    assert 15 <= r.power_w <= 17
    assert r.link_power_w == 2 * r.power_w


# ---- warnings and errors -----------------------------------------------------

def test_copper_beyond_reach_says_by_how_much_and_what_the_ber_is():
    r = evaluate("100GBASE-CR1", 2.5)
    assert not r.within_reach
    first = r.warnings[0]
    assert first.startswith("2.5 m exceeds the 2 m reach of 100GBASE-CR1 passive copper; "
                            "pre-FEC BER ")
    assert first.endswith(" is above the KP4 threshold 2.4e-4")
    assert any(w.startswith("post-FEC frame loss ") for w in r.warnings)


def test_link_within_reach_has_no_warnings():
    assert evaluate("400GBASE-DR4", 100.0).warnings == []
    assert evaluate("400GBASE-CR4", 2.0).warnings == []


def test_optic_slightly_beyond_reach_warns_only_about_reach():
    r = evaluate("400GBASE-DR4", 550.0)
    assert r.warnings == ["550 m exceeds the 500 m reach of 400GBASE-DR4 single-mode fiber"]


def test_unknown_port_type_suggests_the_closest_name():
    with pytest.raises(UnknownPortType) as info:
        evaluate("400G-DR4", 1.0)
    assert str(info.value) == "unknown port type '400G-DR4'; did you mean '400GBASE-DR4'?"
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownPortType, match="did you mean '800GBASE-CR8'"):
        evaluate("800gbase-cr8", 1.0)


@pytest.mark.parametrize("length, mtu", [(-1.0, 9000), (float("nan"), 9000), (1.0, 0)])
def test_bad_length_or_mtu_is_a_value_error(length, mtu):
    with pytest.raises(ValueError):
        evaluate("400GBASE-DR4", length, mtu)


def test_result_dict_has_exactly_the_field_names_and_is_json_ready():
    r = evaluate("100GBASE-CR1", 2.5)
    d = r.to_dict()
    assert list(d) == [f.name for f in fields(PhyResult)]
    assert json.loads(json.dumps(d)) == d


# ---- CLI ---------------------------------------------------------------------

@pytest.fixture
def cli(monkeypatch):
    """testbed.cli.main with only the phy verb wired, so other verbs cannot break these tests."""
    monkeypatch.setattr(testbed.cli, "VERBS", ["phy"])
    return testbed.cli.main


def test_cli_json_output(cli, capsys):
    rc = cli(["phy", "400GBASE-DR4", "--length", "100m", "--format", "json"])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert data == evaluate("400GBASE-DR4", 100.0).to_dict()
    assert out.strip() == json.dumps(data, sort_keys=True, indent=2)
    assert data["mac_rate_bps"] == 400_000_000_000


def test_cli_table_shows_figures_and_warnings(cli, capsys):
    assert cli(["phy", "100GBASE-CR1", "--length", "2.5m", "--mtu", "1500"]) == 0
    out = capsys.readouterr().out
    assert "106.25 Gb/s" in out
    assert "warning: 2.5 m exceeds the 2 m reach" in out


def test_cli_list_names_every_port_type(cli, capsys):
    assert cli(["phy", "--list"]) == 0
    out = capsys.readouterr().out
    for name in PORT_TYPES:
        assert name in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["phy", "400G-DR4", "--length", "1m"], "did you mean '400GBASE-DR4'?"),
        (["phy", "400GBASE-DR4", "--length", "1 furlong"], "unknown unit 'furlong'"),
        (["phy", "400GBASE-DR4"], "--length is required"),
        (["phy", "400GBASE-DR4", "--length=-3m"], "cannot read '-3m' as a length"),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(cli, capsys, argv, message):
    assert cli(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""
