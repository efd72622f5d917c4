"""Create run directories (docs/run-format.md) and record the machine a run ran on."""

from __future__ import annotations

import os
import platform
import socket
import sys
from importlib import metadata as importlib_metadata
from pathlib import Path

import testbed
from testbed.results.files import RUN_FORMAT_VERSION, utc_stamp

PACKAGES = ("pyroute2", "pydantic", "numpy", "scapy", "matplotlib", "jinja2", "rich", "pyyaml")


def create_run_dir(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    base = root / f"{utc_stamp()}-{name}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def machine_metadata(probe: dict, dilation: int, budget_bps: int, argv: list[str]) -> dict:
    try:
        mem_kb = int(next(line.split()[1] for line in open("/proc/meminfo")
                          if line.startswith("MemTotal")))
    except (OSError, StopIteration, ValueError):
        mem_kb = 0
    return {
        "format_version": RUN_FORMAT_VERSION,
        "testbed_version": testbed.__version__,
        "created_utc": utc_stamp(),
        "kernel": platform.release(),
        "kernel_version": platform.version(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count(),
        "memory_bytes": mem_kb * 1024,
        "python": sys.version.split()[0],
        "packages": package_versions(),
        "probe": probe,
        "dilation": dilation,
        "fidelity_budget_bps": budget_bps,
        "argv": argv,
    }
