"""Named network namespaces: create, remove, list, and run code inside one.

Only namespaces whose names start with the testbed prefix are ever created
or removed here. Code that must run inside a namespace (sysctl writes) uses
`inside(name)`, which switches only the calling thread and always switches
back, so the initial namespace is never modified.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from pyroute2 import netns as _netns

NETNS_RUN_DIR = "/var/run/netns"
PREFIX = "tb-"


def _check(name: str) -> None:
    if not name.startswith(PREFIX):
        raise ValueError(f"refusing to touch namespace {name!r}: not a testbed namespace")


def list_testbed_namespaces() -> list[str]:
    try:
        names = os.listdir(NETNS_RUN_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(PREFIX))


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_RUN_DIR, name))


def create(name: str) -> None:
    _check(name)
    _netns.create(name)


def remove(name: str) -> None:
    _check(name)
    if exists(name):
        _netns.remove(name)


def inode(name: str) -> int | None:
    try:
        return os.stat(os.path.join(NETNS_RUN_DIR, name)).st_ino
    except FileNotFoundError:
        return None


def pid_netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


@contextlib.contextmanager
def inside(name: str) -> Iterator[None]:
    """Run the block with this thread in namespace `name` (for /proc/sys/net writes)."""
    _check(name)
    _netns.pushns(name)
    try:
        yield
    finally:
        _netns.popns()


def write_sysctls(name: str, sysctls: dict[str, str]) -> None:
    with inside(name):
        for key, value in sysctls.items():
            path = "/proc/sys/" + key.replace(".", "/")
            with open(path, "w") as fh:
                fh.write(value)
