"""The workload kinds this testbed knows: one line per kind module.

The config validates each traffic entry with the model of the kind it names, the run
expands entries, starts agents and writes results through the kind, and the docs list
what each kind declares. A kind name no module declares is an error everywhere, never a
fallback to another kind.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager

from testbed.workloads import collective, flows, perftest, roce, training, udp, uet
from testbed.workloads.base import TrafficEntry, WorkloadKind


class UnknownKind(KeyError):
    """A kind name no registered module declares."""

    def __str__(self) -> str:
        return str(self.args[0])


def port_ranges(value: range | tuple[range, ...]) -> tuple[range, ...]:
    """A kind's ports of one protocol as ranges (it may declare one range or several)."""
    return (value,) if isinstance(value, range) else tuple(value)


class Registry:
    def __init__(self) -> None:
        self._by_name: dict[str, WorkloadKind] = {}

    def add(self, kind: WorkloadKind) -> WorkloadKind:
        """Register every kind name `kind` declares; a name already taken is refused."""
        taken = [n for n in kind.shapes if n in self._by_name]
        if taken:
            raise ValueError(f"workload kind {taken[0]!r} is already registered by "
                             f"{type(self._by_name[taken[0]]).__name__}")
        for other in self.kinds():
            if kind.port_owner is not None and kind.port_owner == other.port_owner:
                continue        # one numbering hands out both kinds' ports
            for proto, value in kind.ports.items():
                for ports in port_ranges(value):
                    for theirs in port_ranges(other.ports.get(proto, ())):
                        if max(ports.start, theirs.start) < min(ports.stop, theirs.stop):
                            raise ValueError(
                                f"{type(kind).__name__}'s {proto} ports {ports.start}.."
                                f"{ports.stop - 1} overlap {type(other).__name__}'s "
                                f"{theirs.start}..{theirs.stop - 1}")
        literal = getattr(kind.model.model_fields["kind"].annotation, "__args__", None)
        if literal is not None and set(literal) != set(kind.shapes):
            raise ValueError(f"{type(kind).__name__}: its model's kind values {literal} and "
                             f"its shapes {tuple(kind.shapes)} differ")
        for name in kind.shapes:
            self._by_name[name] = kind
        return kind

    def remove(self, kind: WorkloadKind) -> None:
        for name in [n for n, k in self._by_name.items() if k is kind]:
            del self._by_name[name]

    @contextmanager
    def registered(self, kind: WorkloadKind) -> Iterator[WorkloadKind]:
        """`kind` is known inside the block (tests add a toy kind this way)."""
        self.add(kind)
        try:
            yield kind
        finally:
            self.remove(kind)

    def names(self) -> list[str]:
        return list(self._by_name)

    def kinds(self) -> list[WorkloadKind]:
        """Each registered kind module once, in registration order."""
        return list(dict.fromkeys(self._by_name.values()))

    def models(self) -> dict[str, type[TrafficEntry]]:
        """Kind name -> the config model of its entries."""
        return {name: kind.model for name, kind in self._by_name.items()}

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def of(self, name: str) -> WorkloadKind:
        """The kind module that declares `name`; UnknownKind says which names exist."""
        try:
            return self._by_name[name]
        except KeyError:
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownKind(f"unknown workload kind {name!r}{hint} (known: "
                              f"{', '.join(self.names())})") from None


REGISTRY = Registry()
REGISTRY.add(udp.KIND)
REGISTRY.add(roce.KIND)
REGISTRY.add(collective.KIND)
REGISTRY.add(training.KIND)
REGISTRY.add(flows.KIND)
REGISTRY.add(uet.KIND)
REGISTRY.add(perftest.KIND)
