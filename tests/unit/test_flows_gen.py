"""The flow generators (testbed/workloads/flows_gen.py): the built-in size distributions
sample what their CDFs say, generated hosts offer their target load, generation is
reproducible, and bad CDF files are refused with messages a user can act on."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.workloads.base import FlowSpec
from testbed.workloads.flows_gen import (
    BUILTIN_DISTRIBUTIONS,
    LOAD_TOLERANCE,
    Cdf,
    CdfError,
    incast_flows,
    ks_bound,
    ks_distance,
    load_cdf,
    parse_cdf,
    poisson_flows,
    realised_load,
)

ERRORS = Path(__file__).parent / "data" / "cdf_errors"
N_SAMPLES = 10_000
# The one-sample Kolmogorov-Smirnov critical value at the 1 % level, 1.63 / sqrt(n). For a
# discrete law (samples are whole bytes) the test is conservative: a correct sampler
# exceeds it less than 1 % of the time. The seed is fixed, so the test is deterministic.
KS_BOUND = 1.63 / math.sqrt(N_SAMPLES)
RATE_BPS = 100_000_000_000
HOSTS = ["h1", "h2", "h3", "h4"]


@pytest.mark.parametrize("name", sorted(BUILTIN_DISTRIBUTIONS))
def test_builtin_distribution_samples_follow_its_cdf(name: str) -> None:
    cdf = load_cdf(name)
    sample = cdf.sample(np.random.default_rng(20240613), N_SAMPLES)
    assert sample.min() >= 1 and sample.max() <= cdf.max_bytes
    distance = ks_distance(cdf, sample)
    assert distance < KS_BOUND, f"{name}: KS distance {distance:.4f} >= {KS_BOUND:.4f}"


def test_ks_distance_catches_a_sampler_off_by_one_segment() -> None:
    # the check has teeth: web search sizes scaled by 1.5 are far outside the bound
    cdf = load_cdf("web_search")
    sample = (cdf.sample(np.random.default_rng(1), N_SAMPLES) * 1.5).astype(np.int64)
    assert ks_distance(cdf, sample) > 5 * KS_BOUND


def _duration_for(cdf: Cdf, load: float, flows_per_host: int) -> int:
    return math.ceil(flows_per_host * cdf.mean_bytes * 8e9 / (load * RATE_BPS))


@pytest.mark.parametrize("load", [0.3, 0.5])
@pytest.mark.parametrize("name", sorted(BUILTIN_DISTRIBUTIONS))
def test_every_host_offers_its_target_load_within_5_percent(name: str, load: float) -> None:
    cdf = load_cdf(name)
    rates = dict.fromkeys(HOSTS, RATE_BPS)
    # 200 flows per host of the mean size at load 0.3 (about 333 at 0.5)
    duration_ns = _duration_for(cdf, 0.3, 200)
    seeds, count = range(1, 6), 0
    for seed in seeds:
        flows = poisson_flows(HOSTS, rates, cdf, load, duration_ns, 0, seed)
        realised = realised_load(flows, rates, duration_ns)
        assert set(realised) == set(HOSTS)
        for host, value in realised.items():
            assert abs(value / load - 1) <= LOAD_TOLERANCE + 1e-9 < 0.05, (name, seed, host)
        count += len(flows)
    # a short run: a host holds a few hundred flows (fewer when it drew large ones)
    assert count >= 200 * len(HOSTS) * len(seeds)


def test_flows_lie_in_the_window_sorted_to_other_hosts_of_the_set() -> None:
    rates = {"a": RATE_BPS, "b": RATE_BPS, "c": 25_000_000_000}
    flows = poisson_flows(list(rates), rates, load_cdf("hadoop"), 0.4, 2_000_000, 5_000, 3)
    assert flows == sorted(flows, key=lambda f: (f.start_ns, f.src))
    assert all(5_000 <= f.start_ns < 2_005_000 for f in flows)
    assert all(f.src != f.dst and f.dst in rates for f in flows)
    assert {(f.src, f.dst) for f in flows} == {(s, d) for s in rates for d in rates if s != d}
    # each host at its own line rate
    for value in realised_load(flows, rates, 2_000_000).values():
        assert value == pytest.approx(0.4, rel=0.05)


def test_same_seed_same_flows_other_seed_other_flows() -> None:
    rates = dict.fromkeys(HOSTS, RATE_BPS)
    cdf = load_cdf("web_search")
    first = poisson_flows(HOSTS, rates, cdf, 0.3, 20_000_000, 0, 7)
    assert first == poisson_flows(HOSTS, rates, cdf, 0.3, 20_000_000, 0, 7)
    assert first != poisson_flows(HOSTS, rates, cdf, 0.3, 20_000_000, 0, 8)


def test_adding_a_host_keeps_the_other_hosts_sizes_and_times() -> None:
    cdf = load_cdf("alibaba_storage")
    rates = dict.fromkeys([*HOSTS, "h5"], RATE_BPS)
    four = poisson_flows(HOSTS, rates, cdf, 0.3, 1_000_000, 0, 11)
    five = poisson_flows([*HOSTS, "h5"], rates, cdf, 0.3, 1_000_000, 0, 11)
    for host in HOSTS:
        assert ([(f.start_ns, f.size_bytes) for f in four if f.src == host]
                == [(f.start_ns, f.size_bytes) for f in five if f.src == host])


@pytest.mark.parametrize(("hosts", "load", "duration_ns", "message"), [
    (["h1"], 0.3, 1000, "at least 2 hosts"),
    (["h1", "h1"], 0.3, 1000, "repeat"),
    (["h1", "h2"], 0.0, 1000, "load must be above 0"),
    (["h1", "h2"], 1.5, 1000, "at most 1"),
    (["h1", "h2"], 0.3, 0, "duration must be above 0"),
    (["h1", "h9"], 0.3, 1000, "no line rate for host(s) h9"),
])
def test_poisson_flows_refuses_what_it_cannot_generate(
        hosts: list[str], load: float, duration_ns: int, message: str) -> None:
    rates = {"h1": RATE_BPS, "h2": RATE_BPS}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        poisson_flows(hosts, rates, load_cdf("hadoop"), load, duration_ns, 0, 1)


def test_incast_bursts_every_period_from_every_sender_at_once() -> None:
    flows = incast_flows(["h1", "h2", "h3"], "h8", 1_000_000, 1_000_000, 4, 500)
    assert len(flows) == 12
    assert flows[:3] == [FlowSpec("h1", "h8", 1_000_000, 500), FlowSpec("h2", "h8", 1_000_000, 500),
                         FlowSpec("h3", "h8", 1_000_000, 500)]
    assert sorted({f.start_ns for f in flows}) == [500, 1_000_500, 2_000_500, 3_000_500]
    with pytest.raises(ValueError, match="also a sender"):
        incast_flows(["h1", "h8"], "h8", 1, 1, 1, 0)


@pytest.mark.parametrize("case", sorted(p.stem for p in ERRORS.glob("*.cdf")))
def test_bad_cdf_file_is_refused_naming_file_line_and_fix(case: str) -> None:
    path = ERRORS / f"{case}.cdf"
    with pytest.raises(CdfError) as error:
        parse_cdf(path.read_text(), path.name)
    expected = (ERRORS / f"{case}.expected").read_text().splitlines()
    assert str(error.value).splitlines() == expected
    for line in expected:
        assert line.startswith(f"{path.name}:") and "; " in line


def test_percent_and_fraction_files_parse_alike() -> None:
    percent = parse_cdf("# percent\n0 0\n1000 25\n\n5000 100\n", "p.cdf")
    fraction = parse_cdf("0 0  # fractions\n1000 0.25\n5000 1\n", "f.cdf")
    assert percent.points == fraction.points == ((0, 0.0), (1000, 0.25), (5000, 1.0))


def test_atoms_at_the_first_size_and_at_a_repeated_size() -> None:
    cdf = parse_cdf("100 0.5\n200 0.6\n200 0.9\n1000 1\n", "atoms.cdf")
    assert cdf.cdf(99) == 0.0 and cdf.cdf(100) == 0.5 and cdf.cdf(200) == 0.9
    assert cdf.quantile(0.0) == cdf.quantile(0.5) == 100
    assert cdf.quantile(0.75) == 200 and cdf.quantile(1.0) == 1000
    assert cdf.mean_bytes == pytest.approx(0.5 * 100 + 0.1 * 150 + 0.3 * 200 + 0.1 * 600)
    sample = cdf.sample(np.random.default_rng(5), N_SAMPLES)
    assert ks_distance(cdf, sample) < KS_BOUND


def test_mean_is_the_trapezoid_sum_and_samples_match_it() -> None:
    cdf = parse_cdf("0 0\n1000 50\n3000 100\n", "u.cdf")
    assert cdf.mean_bytes == pytest.approx(0.5 * 500 + 0.5 * 2000)
    sample = cdf.sample(np.random.default_rng(2), 200_000)
    assert sample.mean() == pytest.approx(cdf.mean_bytes + 0.5, abs=5)   # rounded up to bytes


def test_unknown_name_suggests_a_builtin_or_a_file_path() -> None:
    with pytest.raises(CdfError, match="did you mean 'web_search'.*or a file path"):
        load_cdf("web_serach")
    with pytest.raises(CdfError, match="no such distribution file"):
        load_cdf("dists/mine.cdf", Path("/nonexistent"))


def test_a_file_path_is_read_relative_to_the_base_dir(tmp_path: Path) -> None:
    (tmp_path / "mine.cdf").write_text("0 0\n4096 1\n")
    cdf = load_cdf("mine.cdf", tmp_path)
    assert cdf.points == ((0, 0.0), (4096, 1.0)) and cdf.source.endswith("mine.cdf")


def test_builtin_files_name_their_source() -> None:
    for name, path in BUILTIN_DISTRIBUTIONS.items():
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        text = " ".join(header)
        assert "alibaba-edu/High-Precision-Congestion-Control" in text, name
        assert "traffic_gen/" in text, name


@given(st.lists(st.tuples(st.integers(0, 10**7), st.floats(0, 1)), min_size=1, max_size=20),
       st.floats(0, 1), st.floats(0, 1))
def test_quantile_never_decreases_and_inverts_cdf(
        rows: list[tuple[int, float]], u: float, v: float) -> None:
    sizes = sorted(s for s, _ in rows)
    probs = sorted(p for _, p in rows)
    probs[-1] = 1.0
    cdf = Cdf(tuple(zip(sizes, probs, strict=True)), "hypothesis")
    lo, hi = sorted((u, v))
    assert cdf.quantile(lo) <= cdf.quantile(hi)
    q = cdf.quantile(hi)
    assert cdf.cdf(q) >= hi - 1e-5   # the rounding up gives up 1e-6 byte


@pytest.mark.parametrize("name", sorted(BUILTIN_DISTRIBUTIONS))
def test_generated_flows_sizes_follow_the_cdf_over_10000_flows(name: str) -> None:
    """What poisson_flows gives, not only the sampler: 8 hosts x ~1,250 flows at 0.3,
    every host's load within 2 %, and the sizes within the KS bound of the CDF (holding
    the load adds small flows where a large one did not fit; over this many flows that
    stays inside the bound)."""
    cdf = load_cdf(name)
    hosts = [f"h{i}" for i in range(1, 9)]
    rates = dict.fromkeys(hosts, RATE_BPS)
    duration_ns = _duration_for(cdf, 0.3, 1250)
    flows = poisson_flows(hosts, rates, cdf, 0.3, duration_ns, 0, 11)
    assert len(flows) >= 9_000
    assert ks_distance(cdf, [f.size_bytes for f in flows]) < ks_bound(len(flows))
    realised = realised_load(flows, rates, duration_ns)
    assert all(abs(v / 0.3 - 1) <= LOAD_TOLERANCE + 1e-9 for v in realised.values())
