"""Fixtures that build real labs and always tear them down."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from testbed.config import load_config_text
from testbed.net import apply_plan, destroy_lab
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import Plan, compile_plan
from tests.conftest import REPO, unique_lab


@contextmanager
def built_lab(template: str, stem: str, **fields: object) -> Iterator[Plan]:
    """A lab from a config `template` (its `{name}` a unique lab name, the rest from
    `fields`), up for the block and torn down after it, port programs included; fails
    if a namespace of it is left behind."""
    lab = unique_lab(stem)
    plan = compile_plan(load_config_text(template.format(name=lab, **fields), "<test>"))
    try:
        apply_plan(plan)
        yield plan
    finally:
        destroy_lab(plan.lab)
        try:
            from testbed.net import portprog
            portprog.detach_lab(plan.lab)
        except Exception:   # noqa: BLE001 - nothing pinned, or no bpffs
            pass
    left = [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}")]
    assert not left, f"namespaces left behind: {left}"


# Two "VMs" on this machine (a fabric split over VMs, issue 16): their underlay networks.
UNDERLAY_MTU = 9100
UNDERLAY_ADDRESSES = {"vm1": ("ul1", "192.0.2.11"), "vm2": ("ul2", "192.0.2.12")}


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


@contextmanager
def underlay_pair(lab: str) -> Iterator[dict[str, str]]:
    """Two underlay namespaces joined by a veth of MTU UNDERLAY_MTU, 192.0.2.11 and .12:
    two VMs' networks. Removed afterwards whatever happened."""
    underlay = {"vm1": f"tb-{lab}-ul-1", "vm2": f"tb-{lab}-ul-2"}
    made: list[str] = []
    try:
        for ns in underlay.values():
            ip("netns", "add", ns)
            made.append(ns)
        ip("link", "add", "ul1", "netns", underlay["vm1"], "mtu", str(UNDERLAY_MTU), "type",
            "veth", "peer", "name", "ul2", "netns", underlay["vm2"], "mtu", str(UNDERLAY_MTU))
        for vm, (dev, address) in UNDERLAY_ADDRESSES.items():
            ip("-n", underlay[vm], "addr", "add", f"{address}/24", "dev", dev)
            ip("-n", underlay[vm], "link", "set", dev, "up")
        yield underlay
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def plan_from_file(path: str, stem: str) -> Plan:
    text = (REPO / path).read_text()
    lab = unique_lab(stem)
    lines = [f"name: {lab}" if line.startswith("name:") else line for line in text.splitlines()]
    return compile_plan(load_config_text("\n".join(lines) + "\n", path))


def initial_namespace_snapshot() -> dict:
    """What must never change: links, addresses and routes of the initial namespace."""
    out = {}
    for what in ("link", "addr", "route"):
        res = subprocess.run(["ip", "-j", what], capture_output=True, text=True, check=True)
        data = json.loads(res.stdout)
        # Counters and timers move on their own; compare configuration only.
        for item in data:
            for volatile in ("stats64", "stats", "linkinfo"):
                item.pop(volatile, None)
            for info in item.get("addr_info", []):
                info.pop("valid_life_time", None)
                info.pop("preferred_life_time", None)
        out[what] = data
    return out


@pytest.fixture
def build():
    """Call build(plan) to bring a lab up; every lab made is torn down afterwards."""
    made: list[str] = []

    def _build(plan: Plan):
        made.append(plan.lab)
        apply_plan(plan)
        return plan

    yield _build
    for lab in made:
        destroy_lab(lab)


@pytest.fixture(scope="module")
def default_fabric() -> Iterator[Plan]:
    plan = plan_from_file("configs/default.yaml", "dflt")
    try:
        apply_plan(plan)
        yield plan
    finally:
        destroy_lab(plan.lab)
