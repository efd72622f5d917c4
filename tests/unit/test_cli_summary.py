"""`testbed run`'s closing summary prints each kind's own columns (streams for UDP and
RoCE, nccl-tests' size/time/busbw for collectives), whatever kinds a run mixes."""

from __future__ import annotations

from rich.console import Console

from testbed.cli.run import _print_summary


def test_each_kind_gets_its_own_columns() -> None:
    summary = {
        "name": "mix", "dilation": 1000, "duration_fabric_ns": 2_000_000,
        "duration_wall_s": 3.5, "interrupted": False, "fidelity": ["a note"],
        "ports": [], "totals": {"drops": 0, "ecn_marks": 2, "pause_frames": 1},
        "workloads": [
            {"name": "bg", "kind": "udp_pairs", "results": [
                {"src": "h1", "dst": "h2", "tx_packets": 1200, "rx_packets": 1190, "lost": 10,
                 "rx_fabric_bps": 25_000_000_000}]},
            {"name": "ar", "kind": "allreduce", "results": [
                {"algorithm": "ring", "ranks": 8, "bytes": 1 << 20, "dtype": "float32",
                 "time_us": 250.5, "algbw_gbps": 4.186, "busbw_gbps": 7.326, "wrong": 0}]},
        ]}
    console = Console(record=True, width=160)
    _print_summary(console, summary)
    text = console.export_text()
    assert "1,200" in text and "1,190" in text and "25Gbps" in text.replace(" ", "")
    assert "busbw (GB/s)" in text and "1,048,576" in text and "7.33" in text
    assert "fidelity: a note" in text


def test_console_cells_give_large_floats_without_an_exponent() -> None:
    from testbed.cli.run import _cell
    assert _cell("step_avg_us", 6339.46) == "6,339"
    assert _cell("time_us", 116.23) == "116"
    assert _cell("algbw_gbps", 6.7008) == "6.7"
    assert _cell("bytes", 67108864) == "67,108,864"
    assert _cell("rate_bps", 100e9) != "1e+11"
