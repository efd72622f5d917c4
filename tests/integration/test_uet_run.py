"""The uet kinds end to end on real namespaces, the default leaf-spine fabric (2 spines,
2 leaves, 4 hosts per leaf), through `testbed run`'s own machinery:

- exact data: a WRITE stream and a SEND stream from h1 to h5, sprayed, with 1 % loss on
  leaf1's uplink to spine1: every byte of every message verified, the losses found and
  resent selectively (retransmissions close to the packets the link dropped), and the
  sprayed packets arrive out of order without the run calling it the emulator's doing;
- spraying: one 64 MiB WRITE from h1 to h5 splits over leaf1's two uplinks within 10 %,
  where a RoCE transfer on one QP takes one spine only."""

from __future__ import annotations

import pytest

from testbed.config import load_config_text
from testbed.config.models import TrafficClass
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import compile_plan
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

TRIM = ", trim: true" if "trim" in TrafficClass.model_fields else ""
LEAF_SPINE = """\
name: {lab}
dilation: {dilation}
traffic_classes:
  - {{tc: 3, name: roce, dscp: [26], lossless: true, ecn: true}}
  - {{tc: 6, name: cnp, dscp: [48], strict: true}}
  - {{tc: 2, name: uet, dscp: [18], ecn: true{trim}}}
  - {{tc: 0, name: default, default: true}}
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
{extra}workload:
  traffic:
{traffic}
"""


def _run(tmp_path, name: str, traffic: str, extra: str = "", dilation: int = 1000):
    lab = unique_lab(name)
    text = LEAF_SPINE.format(lab=lab, dilation=dilation, trim=TRIM, extra=extra,
                             traffic=traffic)
    loaded = load_config_text(text, f"{name}.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path, say=lambda _m: None))
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
    return result


def _rows(result, kind_prefix: str = "") -> list[dict]:
    return [r for w in result.summary["workloads"] for r in w["results"]
            if w["kind"].startswith(kind_prefix)]


def _uplinks(result) -> dict[str, int]:
    """Bytes leaf1 sent to each spine (its egress port counters, every class)."""
    out = {}
    for link in result.summary["links"]:
        for near, far, key in ((link["a"], link["b"], "a_to_b_bytes"),
                               (link["b"], link["a"], "b_to_a_bytes")):
            if near.startswith("leaf1:") and far.startswith("spine"):
                out[far.split(":")[0]] = out.get(far.split(":")[0], 0) + int(link[key])
    return out


@pytest.mark.parametrize(("test", "cc"), [("write_bw", "nscc"), ("send_bw", "credit")])
def test_every_byte_arrives_under_1_percent_loss_and_only_the_lost_are_resent(
        tmp_path, test: str, cc: str) -> None:
    result = _run(tmp_path, f"uetl{test[0]}", f"""\
    - {{name: exact, kind: uet_pairs, pairs: [[h1, h5]], test: {test}, size: 1MiB,
       messages: 16, tclass: uet, cc: {cc}}}""",
                  extra="impairments: [{link: [leaf1, spine1], direction: forward, "
                        "loss: 0.01}]\n")
    (row,) = _rows(result)
    assert row["verified"] is True and row["error"] is None, row
    assert row["bytes"] == 16 << 20 and row["messages"] == 16
    assert row["sports"] == 16
    streams = [s for s in result.summary["invariants"]["streams"] if s["kind"] == "uet_pairs"]
    (acct,) = streams
    lost = acct["fabric_drops"]
    print(f"{test} {cc}: {row['gbps']} Gb/s, {row['tx_packets']} packets, {lost} lost on "
          f"leaf1->spine1, {row['retransmissions']} retransmissions, {row['timeouts']} "
          f"timeouts, {row['out_of_order']} out of order")
    assert lost > 0, acct
    # selective: every lost packet resent, and not much more than those
    assert lost <= row["retransmissions"] <= 2 * lost + 8, (row, acct)
    assert acct["reordered"] == 0          # sprayed: the fabric reorders, not the emulator
    assert result.summary["invariants"]["checks"]["conservation"]["held"] is not False


def test_one_transfer_sprays_over_both_spines_and_a_roce_qp_takes_one(tmp_path) -> None:
    result = _run(tmp_path, "uetspr", """\
    - {name: spray, kind: uet_pairs, pairs: [[h1, h5]], size: 64MiB, messages: 1,
       tclass: uet}""")
    (row,) = _rows(result)
    assert row["verified"] is True and row["bytes"] == 64 << 20, row
    up = _uplinks(result)
    share = up.get("spine1", 0) / max(1, sum(up.values()))
    print(f"uet: {row['gbps']} Gb/s, leaf1 uplinks {up}, spine1 share {share:.3f}, "
          f"out of order {row['out_of_order']}, sports {row['sports']}")
    assert sum(up.values()) >= 64 << 20
    assert 0.45 <= share <= 0.55, up          # within 10 % of each other
    assert row["out_of_order"] > 0             # two paths: packets arrive interleaved
    assert row["sports"] == 16

    roce = _run(tmp_path, "uetrce", """\
    - {name: one, kind: roce_pairs, pairs: [[h1, h5]], size: 64MiB, messages: 1, qps: 1,
       cc: none}""")
    (rrow,) = _rows(roce)
    assert rrow["verified"] is True, rrow
    up = _uplinks(roce)
    print(f"roce: {rrow['gbps']} Gb/s, leaf1 uplinks {up}")
    assert max(up.values()) >= 64 << 20
    assert min(up.values()) < 0.01 * max(up.values()), up
