"""On a kernel without what a config needs, `testbed run` / `up` stop before building
anything, name the missing feature and suggest --vm (never run silently without it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.root

EXAMPLE = "configs/examples/rxe-perftest.yaml"


def _has(feature: str) -> bool:
    from testbed.net.probe import probe

    return any(f.name == feature and f.present for f in probe())


@pytest.mark.parametrize("verb", ["run", "up"])
def test_an_rxe_config_stops_before_building_and_suggests_vm(verb, tmp_path):
    if _has("rdma_rxe"):
        pytest.skip("this kernel has rdma_rxe: the example runs natively here")
    before = sorted(p.name for p in (tmp_path.iterdir()))
    res = subprocess.run([sys.executable, "-m", "testbed", verb, EXAMPLE,
                          *(["--runs-dir", str(tmp_path)] if verb == "run" else [])],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "rdma_rxe (hosts h1, h5 have endpoint: rxe)" in res.stderr
    assert f"testbed {verb} --vm {EXAMPLE}" in res.stderr
    # nothing was built or written: no run directory, no lab, no namespace
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    from testbed.net import list_states
    from testbed.net.namespaces import list_testbed_namespaces

    assert "rxeperf" not in [s.lab for s in list_states()]
    assert not [ns for ns in list_testbed_namespaces() if "rxeperf" in ns]
