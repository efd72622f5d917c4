"""The compiled fast path of the RoCE transport: which path runs, and why.

`agents.fast._fastpath` (C, agents/fast/_fastpath.c, built by `make setup` through
`agents.fast.build`) does the per-packet byte work of agents/rdma/transport.py in
batches: building a run of data packets and sending them with one sendmmsg, receiving
with one recvmmsg and parsing + ICRC-checking each datagram. The protocol logic stays in
Python (agents/rdma/qp.py, agents/rdma/cc.py), which is also the reference: with the fast
path off, the transport runs exactly as before. docs/fast-path.md has the whole story.

Which path runs:

- on by default when the extension imports and was built from the source beside it;
- off with the environment variable TESTBED_FASTPATH=0 (any of 0/off/false/no);
- off, with the reason, when the extension is missing, stale or fails to import.

`status()` is what agents put in their results (`fast_path: {"on": ..., "reason": ...}`)
so every run says which path carried its packets.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

__all__ = ["ENV", "extension", "status"]

#: The environment variable that turns the fast path off ("0", "off", "false", "no").
ENV = "TESTBED_FASTPATH"
_OFF = frozenset({"0", "off", "false", "no"})


def _load() -> tuple[ModuleType | None, str | None]:
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in _OFF:
        return None, f"turned off: {ENV}={os.environ[ENV]}"
    try:
        from agents.fast import build
        if build.SOURCE.exists():
            if not build.extension_path().exists():
                return None, ("the extension is not built: run `make setup` or "
                              "`python -m agents.fast`")
            if not build.is_current():
                return None, ("the built extension is stale (its source changed since): "
                              "run `make setup` or `python -m agents.fast`")
        _fastpath = importlib.import_module("agents.fast._fastpath")
    except ImportError as e:
        return None, f"extension not available ({e}): run `make setup`"
    except OSError as e:
        return None, f"extension not readable ({e})"
    return _fastpath, None


_MOD, _REASON = _load()


def extension() -> Any | None:
    """The loaded `agents.fast._fastpath` module, or None when the Python path runs."""
    return _MOD


def status() -> dict:
    """{"on": bool, "reason": str | None}: which path this process's transport runs."""
    return {"on": _MOD is not None, "reason": _REASON}
