"""The emulated PFC loop's reaction, paired from a run's events (testbed/run/pfc_reaction)."""

from __future__ import annotations

from agents.timebase import Dilation
from testbed.run.pfc_reaction import MATCH_WINDOW_NS, loop_note, reactions, summarize

ROLES = {"leaf1": "switch", "h1": "host", "h2": "host", "spine1": "switch"}


def xoff(ts: int, peer: str, port: str = "eth0", crossed: int | None = 300,
         reason: str = "ingress") -> dict:
    return {"ts_fabric_ns": ts, "node": "leaf1", "port": "swp1", "peer_node": peer,
            "peer_port": port, "crossed_ns_ago": crossed, "reason": reason}


def paused(ts: int, node: str, port: str = "eth0", quanta: int | None = 65535) -> dict:
    return {"ts_fabric_ns": ts, "node": node, "port": port, "quanta": quanta}


def test_each_gate_change_pairs_with_the_latest_frame_to_its_port() -> None:
    frames = [xoff(1000, "h1"), xoff(5000, "h1", crossed=100), xoff(1200, "h2", crossed=50)]
    changes = [paused(5400, "h1"), paused(1700, "h2")]
    got = reactions(frames, changes, ROLES, "pause")
    assert [(r.hop, r.detect_ns, r.apply_ns, r.total_ns) for r in got] == [
        ("leaf -> host", 100, 400, 500),      # the 5000 frame, not the 1000 one
        ("leaf -> host", 50, 500, 550)]       # h2's own frame, not h1's


def test_refreshes_unmatched_and_frameless_changes_are_not_reactions() -> None:
    frames = [xoff(1000, "h1", reason="refresh"), xoff(2000, "h2", crossed=None),
              xoff(3000, "h1", port="eth1")]
    changes = [paused(1500, "h1"),                      # only a refresh before it
               paused(2500, "h2"),                      # its frame has no crossing time
               paused(3000 + MATCH_WINDOW_NS + 1, "h1", port="eth1"),   # too late to be it
               paused(3100, "h1", port="eth1", quanta=None),            # a pause that ran out
               paused(2999, "h1", port="eth1")]         # before the frame
    assert reactions(frames, changes, ROLES, "pause") == []


def test_the_summary_gives_fabric_and_wall_times_and_the_note_only_past_the_plan() -> None:
    frames = [xoff(i * 10_000, "h1", crossed=200) for i in range(100)]
    changes = [paused(i * 10_000 + (300 if i < 98 else 9_800), "h1") for i in range(100)]
    s = summarize(reactions(frames, changes, ROLES, "pause"), Dilation(1000))
    assert s is not None
    assert s["pauses"] == 100
    assert s["median_fabric_ns"] == 500 and s["median_wall_ns"] == 500_000
    assert s["max_fabric_ns"] == 10_000
    assert s["p99_fabric_ns"] == 10_000 and s["p99_wall_ns"] == 10_000_000
    assert s["detect_median_fabric_ns"] == 200
    assert summarize([], Dilation(1000)) is None
    assert loop_note(s, assumed_wall_ns=20_000_000) is None
    note = loop_note(s, assumed_wall_ns=2_000_000)
    assert note is not None
    assert "10.00 ms of wall time at p99, longer than the 2.00 ms" in note
    assert loop_note(None, 1) is None
