"""Kernel features a planned run cannot do without, checked before anything is built.

A run whose config asks for something the running kernel lacks (an rxe endpoint, the
RED marker) must stop before it creates a namespace, name the missing feature and
suggest `--vm`, never run silently without it. Each part that needs a feature adds one
function to NEEDS: it maps a plan to {probe feature name: why this plan needs it}.
Features that only improve fidelity (netem) are not here: their absence is a fidelity
note, not a refusal.
"""

from __future__ import annotations

from collections.abc import Callable

from testbed.plan.model import Plan

Need = Callable[[Plan], dict[str, str]]

NEEDS: list[Need] = []


def needed_features(plan: Plan) -> dict[str, str]:
    """{feature: why} over every registered need, in registration order."""
    out: dict[str, str] = {}
    for need in NEEDS:
        for feature, why in need(plan).items():
            out.setdefault(feature, why)
    return out


def missing_features(plan: Plan, present: dict[str, bool]) -> dict[str, str]:
    """The needed features that `present` (probe name -> present) does not have."""
    return {f: why for f, why in needed_features(plan).items() if not present.get(f, False)}


def rxe_needs(plan: Plan) -> dict[str, str]:
    """Hosts with `endpoint: rxe` need rdma_rxe, and perftest (the only traffic they run:
    kind: perftest). Where rxe is not namespace aware the builder also needs ipvlan and VM
    mode; it refuses that before building anything (testbed/net/rxe.py: placement_mode)."""
    hosts = [n.name for n in plan.hosts() if n.endpoint == "rxe"]
    if not hosts:
        return {}
    who = f"hosts {', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''} have endpoint: rxe"
    return {"rdma_rxe": who, "perftest": f"{who} (their traffic is kind: perftest)"}


NEEDS.append(rxe_needs)


def red_marker_needs(plan: Plan) -> dict[str, str]:
    """ecn marker red: the classes marked by sch_red need it (owner: the RED marker)."""
    where = sorted({f"{node.name}:{iface.ifname}" for node in plan.nodes
                    for iface in node.interfaces for c in iface.egress.classes
                    if c.red is not None})
    if not where:
        return {}
    more = f" and {len(where) - 3} more ports" if len(where) > 3 else ""
    return {"red": f"qos ecn marker red: sch_red marks the classes at {', '.join(where[:3])}"
                   f"{more}"}


NEEDS.append(red_marker_needs)
