"""Unit strings: parsed once into base units, refused with a message that shows the fix."""

from __future__ import annotations

import re

import pytest

from testbed.units import (
    QUANTITY_PATTERN,
    UnitError,
    format_duration,
    format_rate,
    format_size,
    parse_duration_ns,
    parse_length_m,
    parse_rate_bps,
    parse_size_bytes,
)


@pytest.mark.parametrize(("text", "bps"), [
    ("100Gbps", 100 * 10**9),
    ("25Gb/s", 25 * 10**9),
    ("400Mbps", 400 * 10**6),
    ("400 Mbps", 400 * 10**6),
    ("1.6Tbps", 1_600 * 10**9),
    ("100G", 100 * 10**9),
    ("10kbps", 10_000),
    ("100gbps", 100 * 10**9),
    ("9600bps", 9600),
    ("1e3Mbps", 10**9),
    (" 200Mbps ", 200 * 10**6),
    (200_000_000, 200_000_000),      # a bare number is bits per second
    ("200000000", 200_000_000),
    (2.5e9, 2_500_000_000),
])
def test_parse_rate_bps(text, bps: int) -> None:
    assert parse_rate_bps(text) == bps


@pytest.mark.parametrize(("text", "needle"), [
    ("10GB/s", "bytes per second"),
    ("100GBps", "bytes per second"),
    ("100Bps", "bytes per second"),     # B is bytes, even without a prefix
    ("100 parsecs", "unknown unit 'parsecs'"),
    ("fast", "cannot read 'fast' as a rate"),
    ("-5Gbps", "cannot read"),
    ("Gbps", "cannot read"),
    ("", "cannot read"),
    (True, "expected a rate"),
    (float("inf"), "not a finite rate"),
    ("1e999Gbps", "not a finite rate"),
])
def test_parse_rate_bps_errors_show_examples(text, needle: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_rate_bps(text)
    assert needle in str(info.value)
    assert "100Gbps" in str(info.value)     # every message shows a correct spelling


@pytest.mark.parametrize(("text", "n_bytes"), [
    ("512KB", 512_000),
    ("512kB", 512_000),
    ("512KiB", 524_288),
    ("4MiB", 4 * 2**20),
    ("2MB", 2_000_000),
    ("2 MB", 2_000_000),
    ("1GB", 10**9),
    ("1GiB", 2**30),
    ("9000", 9000),
    ("9000B", 9000),
    ("1.5KB", 1500),
    (9000, 9000),
    (0, 0),
])
def test_parse_size_bytes(text, n_bytes: int) -> None:
    assert parse_size_bytes(text) == n_bytes


@pytest.mark.parametrize(("text", "needle"), [
    ("512Kb", "lower-case 'b' means bits"),
    ("4Mb", "lower-case 'b' means bits"),
    ("4Mib", "lower-case 'b' means bits"),
    ("512b", "lower-case 'b' means bits"),
    ("512 bytes", "unknown unit 'bytes'"),
    ("512KBps", "unknown unit"),
    ("lots", "cannot read 'lots' as a size"),
    (False, "expected a size"),
    (float("nan"), "not a finite size"),
])
def test_parse_size_bytes_errors_show_examples(text, needle: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_size_bytes(text)
    assert needle in str(info.value)
    assert "512KB" in str(info.value)


@pytest.mark.parametrize(("text", "ns"), [
    ("500ns", 500),
    ("2us", 2_000),
    ("2\u00b5s", 2_000),       # micro sign
    ("2\u03bcs", 2_000),       # Greek mu, which keyboards produce too
    ("1.5ms", 1_500_000),
    ("3s", 3 * 10**9),
    ("2 US", 2_000),
    ("750", 750),              # a bare number is nanoseconds
    (750, 750),
])
def test_parse_duration_ns(text, ns: int) -> None:
    assert parse_duration_ns(text) == ns


@pytest.mark.parametrize(("text", "needle"), [
    ("2 fortnights", "unknown unit 'fortnights'"),
    ("soon", "cannot read 'soon' as a duration"),
    ("2h", "unknown unit 'h'"),
    (True, "expected a duration"),
])
def test_parse_duration_ns_errors_show_examples(text, needle: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_duration_ns(text)
    assert needle in str(info.value)
    assert "2us" in str(info.value)


@pytest.mark.parametrize(("text", "metres"), [
    ("2m", 2.0),
    ("100m", 100.0),
    ("2km", 2000.0),
    ("50cm", 0.5),
    ("1500mm", 1.5),
    ("2.5 m", 2.5),
    ("3", 3.0),
    (3, 3.0),
    (0.5, 0.5),
])
def test_parse_length_m(text, metres: float) -> None:
    assert parse_length_m(text) == pytest.approx(metres)


@pytest.mark.parametrize(("text", "needle"), [
    ("3 parsecs", "unknown unit 'parsecs' in '3 parsecs' for a length"),
    ("2ft", "unknown unit 'ft'"),
    ("far", "cannot read 'far' as a length"),
    ("-2m", "cannot read"),
    (float("inf"), "not a finite length"),
])
def test_parse_length_m_errors_show_examples(text, needle: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_length_m(text)
    assert needle in str(info.value)
    assert "100m" in str(info.value)


def test_unit_error_is_a_value_error() -> None:
    # pydantic turns ValueError from a validator into a located problem, not a traceback.
    assert issubclass(UnitError, ValueError)


@pytest.mark.parametrize(("value", "fmt", "parse"), [
    (100 * 10**9, format_rate, parse_rate_bps),
    (512_000, format_size, parse_size_bytes),
    (2_000, format_duration, parse_duration_ns),
])
def test_formatted_values_parse_back(value: int, fmt, parse) -> None:
    assert parse(fmt(value)) == value


@pytest.mark.parametrize("text", ["100Gbps", "2 m", "512KiB", "2\u00b5s", "1.5e3ns", "9000"])
def test_schema_pattern_accepts_what_the_parsers_read(text: str) -> None:
    assert re.match(QUANTITY_PATTERN, text)


@pytest.mark.parametrize("text", ["fast", "-2m", "m2", "2 m m"])
def test_schema_pattern_refuses_what_no_parser_reads(text: str) -> None:
    assert not re.match(QUANTITY_PATTERN, text)


def test_a_fabric_clock_maps_wall_instants_both_ways() -> None:
    from agents.timebase import Dilation, FabricClock

    wall = [1_000_000]
    clock = FabricClock(Dilation(1000), wall_ns=lambda: wall[0])
    wall[0] += 5_000_000                     # 5 ms of wall time: 5 us of fabric time
    assert clock.now_ns() == 5_000.0
    # a common start 2 ms of wall time ahead is 2 us of fabric time ahead
    assert clock.at_wall_clock_ns(wall[0] + 2_000_000) == 7_000.0
    assert clock.to_wall_clock_ns(clock.at_wall_clock_ns(123_456_789)) == 123_456_789
