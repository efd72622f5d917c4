"""Create and read run directories (docs/run-format.md), with their format version."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from importlib import metadata as importlib_metadata
from pathlib import Path

import testbed

RUN_FORMAT_VERSION = 1
PACKAGES = ("pyroute2", "pydantic", "numpy", "scapy", "matplotlib", "jinja2", "rich", "pyyaml")


class RunDirError(RuntimeError):
    """Not a run directory, or one written by a newer testbed."""


def utc_stamp(unix_s: float | None = None) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(unix_s))


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


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write `path.tmp` with `mode`, flush it to disk, rename it over `path`.

    Readers (and a textfile collector) never see half a file; a crash leaves
    the old file or none. The `.tmp` name does not end in `.prom`, so
    Prometheus' textfile collector ignores it.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_private(path: Path, text: str) -> None:
    """Write a file readable by its owner only, atomically."""
    write_atomic(path, text, 0o600)


def write_json(path: Path, data: object) -> None:
    write_private(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


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


def read_json_checked(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{path.parent}: not a run directory (no {path.name})") from None
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path}: unreadable ({exc})") from None
    version = data.get("format_version", 0)
    if version > RUN_FORMAT_VERSION:
        raise RunDirError(f"{path}: written by a newer testbed (format {version}; this one "
                          f"reads up to {RUN_FORMAT_VERSION}); upgrade to read it")
    return data
