"""Flow steering choices and cpumask text (no root, no kernel)."""

from __future__ import annotations

import pytest

from testbed.net import steering
from testbed.net.steering import Steering


@pytest.mark.parametrize(("cpus", "text"), [
    ({0}, "1"), ({0, 1}, "3"), ({1, 3}, "a"), (range(32), "ffffffff"),
    ({0, 35}, "8,00000001"), ({64}, "1,00000000,00000000"), ((), "0"),
])
def test_cpu_mask_is_the_kernels_cpumask_text(cpus, text):
    assert steering.cpu_mask(cpus) == text


def test_cpu_list_folds_runs():
    assert steering.cpu_list({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"
    assert steering.cpu_list({3}) == "3"


def test_per_namespace_default_mask_is_a_sysctl_of_every_namespace(monkeypatch):
    monkeypatch.setattr(steering, "default_mask_per_namespace", lambda: True)
    steer = steering.choose(cpus={0, 1})
    assert steer.method == steering.DEFAULT_MASK
    assert steer.namespace_sysctls() == {"net.core.rps_default_mask": "3"}
    assert steer.describe() == "rps cpus 0-1 (per-namespace rps_default_mask)"


def test_older_kernels_write_every_ports_rps_cpus(monkeypatch):
    monkeypatch.setattr(steering, "default_mask_per_namespace", lambda: False)
    monkeypatch.setattr(steering, "rps_built_in", lambda: True)
    steer = steering.choose(cpus={0, 1, 2, 3})
    assert (steer.method, steer.mask, steer.namespace_sysctls()) == (steering.RPS_CPUS, "f", {})


def test_no_rps_or_one_cpu_or_turned_off_say_why(monkeypatch):
    monkeypatch.setattr(steering, "default_mask_per_namespace", lambda: False)
    monkeypatch.setattr(steering, "rps_built_in", lambda: False)
    assert steering.choose(cpus={0, 1}).describe().startswith("none: this kernel has no RPS")
    assert steering.choose(cpus={2}).describe().startswith("none: one CPU")
    off = steering.choose(enabled=False)
    assert off.describe().startswith("none: turned off")
    assert off.namespace_sysctls() == {}


def test_a_none_steering_has_no_sysctls():
    assert Steering(steering.NONE, (0, 1), "x").namespace_sysctls() == {}
