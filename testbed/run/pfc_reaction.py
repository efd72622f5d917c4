"""How fast the emulated PFC loop answered, read from a run's events. Pure.

A switch's PFC agent logs each frame it sends (`pfc_xoff` / `pfc_xon`: the port, the
peer it goes to, and `crossed_ns_ago`, how long before the frame the packet that crossed
the threshold passed the port program, which posts the crossing to the agent's ring
buffer at that very packet). The upstream agent logs its gate closing or opening
(`pfc_paused` / `pfc_resumed`, with the `quanta` of the frame that did it). Pairing each
gate change with the latest frame sent to that port before it:

    reaction = (gate changed - frame sent) + crossed_ns_ago

is the whole loop, fabric time: crossing -> ring buffer -> agent -> 802.1Qbb frame ->
peer's agent -> its pause gate. Real hardware answers in about a microsecond; the
emulated loop takes wall time (two agents woken, a frame, a netlink change), which is
fabric time / D. The plan sizes lossless headroom for the loop's wall time
(docs/dilation.md, "The PFC floor"); the run compares what it measured with that
(`loop_note`), and `testbed calibrate` measures it for this machine.

Refresh XOFFs (re-sent while a pause lasts) and gate changes no frame caused (a pause
that ran out, a storm) are not reactions and are skipped.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agents.timebase import Dilation

#: A gate change later than this (fabric ns) after the latest frame to its port is not
#: that frame's doing.
MATCH_WINDOW_NS = 50_000


@dataclass(frozen=True)
class Reaction:
    """One frame's effect: `what` is "pause" or "resume"; `hop` names the frame's sender
    (its node name without the number) and the receiver's role ("leaf -> host"); times
    in fabric ns."""

    what: str
    hop: str
    total_ns: int
    detect_ns: int          # the crossing to the frame sent
    apply_ns: int           # the frame sent to the peer's gate changed


def reactions(frames: Iterable[Mapping], changes: Iterable[Mapping], roles: Mapping[str, str],
              what: str) -> list[Reaction]:
    """Each gate change (`changes`: pfc_paused or pfc_resumed events) paired with the
    latest frame (`frames`: pfc_xoff or pfc_xon events) sent to its port before it."""
    by_port: dict[tuple[str, str], list[tuple[int, Mapping]]] = {}
    for x in frames:
        if x.get("crossed_ns_ago") is None or x.get("reason") == "refresh":
            continue
        by_port.setdefault((x.get("peer_node", ""), x.get("peer_port", "")), []).append(
            (int(x["ts_fabric_ns"]), x))
    keys = {}
    for port, sent in by_port.items():
        sent.sort(key=lambda t: t[0])
        keys[port] = [t for t, _x in sent]
    out = []
    for p in changes:
        if p.get("quanta") is None:
            continue          # a pause that ran out, a storm: no frame caused it
        port = (p.get("node", ""), p.get("port", ""))
        if port not in by_port:
            continue
        at = int(p["ts_fabric_ns"])
        i = bisect.bisect_right(keys[port], at) - 1
        if i < 0 or at - keys[port][i] > MATCH_WINDOW_NS:
            continue
        sent_ns, x = by_port[port][i]
        detect = int(x["crossed_ns_ago"])
        apply = at - sent_ns
        hop = (f"{str(x.get('node', '')).rstrip('0123456789')} -> "
               f"{roles.get(x.get('peer_node', ''), '?')}")
        out.append(Reaction(what, hop, detect + apply, detect, apply))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank (q in [0, 1]); values need not be sorted."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def summarize(pauses: Sequence[Reaction], timebase: Dilation) -> dict | None:
    """The pause reactions' count, median and p99, fabric and wall (None: no pause)."""
    if not pauses:
        return None
    total = [r.total_ns for r in pauses]
    med, p99 = percentile(total, 0.5), percentile(total, 0.99)
    return {"pauses": len(pauses), "median_fabric_ns": int(med), "p99_fabric_ns": int(p99),
            "max_fabric_ns": int(max(total)),
            "median_wall_ns": timebase.to_wall_ns(int(med)),
            "p99_wall_ns": timebase.to_wall_ns(int(p99)),
            "detect_median_fabric_ns": int(percentile([r.detect_ns for r in pauses], 0.5)),
            "apply_median_fabric_ns": int(percentile([r.apply_ns for r in pauses], 0.5))}


def loop_note(summary: Mapping | None, assumed_wall_ns: int) -> str | None:
    """Why a lossless queue overran its headroom or dropped, when the loop is the likely
    cause: its p99 took longer than the plan sized headroom for. Only asked when the
    lossless invariants failed: a slow loop that did no harm is in the summary, not a
    note."""
    if not summary or summary["p99_wall_ns"] <= assumed_wall_ns:
        return None
    return (f"the emulated PFC loop answered XOFFs in {summary['median_fabric_ns'] / 1e3:.2f}"
            f" us fabric (median) and {summary['p99_fabric_ns'] / 1e3:.2f} us at p99 over "
            f"{summary['pauses']} pauses: {summary['p99_wall_ns'] / 1e6:.2f} ms of wall time "
            f"at p99, longer than the {assumed_wall_ns / 1e6:.2f} ms the plan sized lossless "
            "headroom for, which is why a lossless invariant above can fail; the emulator, "
            "not the fabric, was slow: a higher dilation gives the loop's wall time fewer "
            "fabric microseconds")
