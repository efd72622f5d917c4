"""Source ports that pin senders' flows to a path, resolved on the built fabric.

A kind says which of its senders must cross which switches (`WorkloadKind.path_pins`,
a RoCE entry's `via:`); once the fabric is up this asks the kernel for the lowest
source ports whose ECMP path crosses them (testbed/net/paths.py) and hands them back
to the kind (`WorkloadKind.pinned`). Ports already given on a host are not given again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from testbed.net.paths import RouteLookup, describe_path, pick_sports
from testbed.plan.model import Plan
from testbed.run.workload import by_kind
from testbed.workloads.base import AgentSpec


@dataclass(frozen=True)
class Pinned:
    """What one sender was given: its ports, and each port's path."""

    sender: str
    traffic: str
    src: str
    dst: str
    dport: int
    via: tuple[str, ...]
    sports: tuple[int, ...]
    paths: tuple[str, ...]      # describe_path of each port's path, "h1:eth0 -> leaf1:swp3 ..."


def pinned_senders(specs: Sequence[AgentSpec]) -> list[str]:
    """The senders among `specs` whose kind pins them to a path (a RoCE entry's via:)."""
    return [pin.sender for kind, group in by_kind(specs).items()
            for pin in kind.path_pins(group)]


def pin_paths(plan: Plan, specs: Sequence[AgentSpec]) -> tuple[list[AgentSpec], list[Pinned]]:
    """`specs` with every pinned sender given its source ports, and what each got.
    testbed.net.paths.PathError (naming the entry) when a range holds too few."""
    out = list(specs)
    done: list[Pinned] = []
    taken: dict[str, set[int]] = {}
    position = {s.name: i for i, s in enumerate(out)}
    pins = [(kind, pin) for kind, group in by_kind(specs).items()
            for pin in kind.path_pins(group)]
    if not pins:
        return out, done
    with RouteLookup(plan) as lookup:
        for kind, pin in pins:
            used = taken.setdefault(pin.src, set())
            picked = pick_sports(plan, pin.src, pin.dst, pin.via, dport=pin.dport,
                                 count=pin.count, exclude=used,
                                 entry=f"workload traffic {pin.traffic!r}", lookup=lookup)
            sports = tuple(p for p, _ in picked)
            used.update(sports)
            i = position[pin.sender]
            out[i] = kind.pinned(out[i], sports)
            done.append(Pinned(pin.sender, pin.traffic, pin.src, pin.dst, pin.dport, pin.via,
                               sports, tuple(describe_path(path) for _, path in picked)))
    return out, done
