"""Sized flows' results (testbed/results/flows.py and the database's flows table): the
ideal FCT, flows.csv, HPCC's fct.txt, HPCC's slowdown buckets (no root)."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from testbed.results.flows import (
    FLOWS_CSV_HEADER,
    edge_buckets,
    fct_cdf,
    flow_summary,
    hpcc_upper_bytes,
    ideal_fct_ns,
    read_flows_csv,
    slowdown_buckets,
    unfinished,
    write_flow_files,
)
from testbed.results.store import Store
from testbed.workloads.base import FlowRecord


def flow(flow_id: int, size: int, fct: int | None, ideal: int = 1000, *, start: int = 0,
         workload: str = "bg", offset: int = 0, **extra) -> FlowRecord:
    return FlowRecord(workload=workload, flow_id=flow_id, src="h1", dst="h8",
                      src_ip="198.18.0.1", dst_ip="10.0.1.2", sport=10000 + flow_id,
                      dport=4791, size_bytes=size, start_ns=start, fct_ns=fct,
                      ideal_fct_ns=ideal, tc=3, time_offset_ns=offset, extra=extra)


def test_ideal_fct_is_the_base_rtt_plus_every_packets_wire_bytes_at_line_rate() -> None:
    # 1 MB in 4096 B packets: 245 packets, each 82 B of headers and framing, one RETH:
    # 1_020_106 B = 8_160_848 bits, 81_608.48 ns at 100 Gb/s, rounded up
    assert ideal_fct_ns(1_000_000, 4096, 100_000_000_000, 3733) == 3733 + 81_609
    # one byte is still one packet
    assert ideal_fct_ns(1, 4096, 100_000_000_000, 0) == -(-(1 + 82 + 16) * 80 // 1000)
    with pytest.raises(ValueError):
        ideal_fct_ns(0, 4096, 100_000_000_000, 0)


def test_fct_txt_is_hpccs_qp_finish_line_per_finished_flow_in_finish_order(
        tmp_path: Path) -> None:
    records = [flow(0, 5000, 9000, 3000, start=100, offset=2_000_000_000),
               flow(1, 300, None, 1200, start=50),
               flow(2, 70, 400, 350, start=200)]
    csv_path, txt_path = write_flow_files(tmp_path, records)
    assert txt_path == tmp_path / "results" / "fct.txt"
    # HPCC: "%08x %08x %u %u %lu %lu %lu %lu\n" sip dip sport dport size start fct ideal;
    # flow 2 finished (at 600) before flow 0 (at 9100); flow 1 never did
    assert txt_path.read_text() == ("c6120001 0a000102 10002 4791 70 200 400 350\n"
                                    "c6120001 0a000102 10000 4791 5000 2000000100 9000 3000\n")
    for path in (csv_path, txt_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list((tmp_path / "results").glob("*.tmp"))


def test_flows_csv_has_every_flow_in_id_order_and_blanks_for_unfinished(tmp_path: Path) -> None:
    records = [flow(1, 300, None, 1200, start=50), flow(0, 5000, 9000, 3000)]
    csv_path, _ = write_flow_files(tmp_path, records)
    lines = csv_path.read_text().splitlines()
    assert lines[0] == ",".join(FLOWS_CSV_HEADER) == (
        "src,dst,sport,dport,size_bytes,start_ns,fct_ns,ideal_fct_ns,slowdown")
    assert lines[1:] == ["h1,h8,10000,4791,5000,0,9000,3000,3.000000",
                         "h1,h8,10001,4791,300,50,,1200,"]
    back = read_flows_csv(csv_path)
    assert [(r.size_bytes, r.fct_ns, r.ideal_fct_ns, r.slowdown) for r in back] == [
        (5000, 9000, 3000, 3.0), (300, None, 1200, None)]


def test_read_flows_csv_refuses_another_file(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a flows.csv"):
        read_flows_csv(path)


def test_slowdown_is_floored_at_one_and_unfinished_flows_are_listed_by_start() -> None:
    records = [flow(0, 100, 500, 1000), flow(1, 100, None, start=9), flow(2, 100, None, start=3)]
    assert records[0].slowdown == 1.0
    assert [r.flow_id for r in unfinished(records)] == [2, 1]
    s = flow_summary(records)
    assert (s.flows, s.finished, s.unfinished, s.p50, s.p99) == (3, 1, 2, 1.0, 1.0)


def test_hpcc_buckets_are_twenty_5_percent_slices_of_the_flows_by_size() -> None:
    # 200 flows of sizes 1..200 B, flow k slowed down k-fold: each bucket holds 10 flows
    records = [flow(k, k, 1000 * k) for k in range(1, 201)]
    buckets = slowdown_buckets(records)
    assert len(buckets) == 20 and all(b.count == 10 for b in buckets)
    first, last = buckets[0], buckets[-1]
    assert (first.size_min_bytes, first.size_max_bytes) == (1, 10)
    assert (last.size_min_bytes, last.size_max_bytes) == (191, 200)
    # get_pctl: a[int(10 x p)] of slowdowns 1..10: a[5], a[9], a[9]
    assert (first.p50, first.p95, first.p99) == (6.0, 10.0, 10.0)
    assert (last.p50, last.p95, last.p99) == (196.0, 200.0, 200.0)


def test_hpcc_buckets_leave_out_empty_slices_of_few_flows() -> None:
    # 10 flows: slices [i x 10 // 100, (i + 5) x 10 // 100) hold one flow every other step
    buckets = slowdown_buckets([flow(k, 100 * k, 2000) for k in range(1, 11)])
    assert [b.size_max_bytes for b in buckets] == [100 * k for k in range(1, 11)]
    assert slowdown_buckets([]) == []


def test_size_buckets_use_fixed_si_edges_and_get_pctl() -> None:
    records = [flow(k, 5_000, 1000 * k) for k in range(1, 101)]        # all < 10KB
    records += [flow(1000, 10_000, 1000), flow(1001, 20_000_000, 4000)]
    buckets = slowdown_buckets(records, scheme="sizes")
    assert [(b.label, b.count) for b in buckets] == [("<10KB", 100), ("10KB-100KB", 1),
                                                      (">=10MB", 1)]
    assert (buckets[0].p50, buckets[0].p95, buckets[0].p99) == (51.0, 96.0, 100.0)
    assert buckets[2].p50 == 4.0
    with pytest.raises(ValueError):
        slowdown_buckets(records, scheme="log")


def test_fct_cdf_rises_to_one_over_the_finished_flows() -> None:
    cdf = fct_cdf([flow(0, 1, 300), flow(1, 1, None), flow(2, 1, 100)])
    assert cdf == [(100.0, 0.5), (300.0, 1.0)]


def test_store_keeps_flows_streamed_in_one_transaction_and_reads_them_back(
        tmp_path: Path) -> None:
    records = [flow(0, 5000, 9000, 3000, offset=7, retransmissions=2),
               flow(1, 300, None, 1200, workload="incast"), flow(2, 70, 400, 350)]
    with Store(tmp_path / "counters.sqlite", create=True) as store:
        assert store.flows() == []
        assert store.add_flows(r for r in records) == 3
    with Store(tmp_path / "counters.sqlite") as store:
        back = store.flows()
        assert back == records
        assert back[0].extra == {"retransmissions": 2} and back[0].time_offset_ns == 7
        assert [r.flow_id for r in store.flows("incast")] == [1]
    with sqlite3.connect(tmp_path / "counters.sqlite") as db:
        assert db.execute("SELECT fct_ns, slowdown FROM flows WHERE flow_id = 1").fetchone() \
            == (None, None)
        assert db.execute("SELECT slowdown FROM flows WHERE flow_id = 0").fetchone() == (3.0,)


def test_a_database_from_before_the_flows_table_reads_as_no_flows(tmp_path: Path) -> None:
    path = tmp_path / "counters.sqlite"
    Store(path, create=True).close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE flows")
    with Store(path) as store:
        assert store.flows() == []
        store.add_flows([flow(0, 1, 10)])          # reopened: the table is made first
        assert len(store.flows()) == 1


def test_hpcc_edges_slice_every_flow_so_runs_of_the_same_flows_share_buckets() -> None:
    records = [flow(k, 100 * k, 1000 * k if k <= 30 else None) for k in range(1, 41)]
    edges = hpcc_upper_bytes(records)
    assert edges == [200 * k for k in range(1, 21)]            # 2 flows a slice, finished or not
    buckets = edge_buckets(records, edges)
    assert len(buckets) == 15                                  # flows 31..40 never finished
    assert (buckets[0].size_min_bytes, buckets[0].size_max_bytes, buckets[0].p50) == (1, 200, 2.0)
