"""Run an exported Mininet topology (`testbed mininet`); a script for /usr/bin/python3.

    /usr/bin/python3 mininet_runner.py TOPO.py NAME [--batch] [--no-netem]

Not imported by the testbed (Mininet is not in the venv; nothing here imports
testbed). Builds the module's `topos[NAME]` with Mininet, no controller, then either
opens Mininet's CLI or (--batch) runs the module's `fabricping` and prints one JSON
line. Mininet.init() is skipped: it raises sysctls of the initial namespace
(fixLimits), which this testbed never touches. Every node shell started is recorded;
whatever happens net.stop() runs and any shell still alive is killed, which takes its
(unnamed) namespace and veth ends with it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


class _QuietQuantum:
    """TCIntf logs tc's harmless "quantum of class 50001 is big" as an error on every
    interface (Mininet sets no r2q); leave it out."""

    def filter(self, record: Any) -> bool:
        return "quantum of class" not in record.getMessage()


def load(path: str) -> dict[str, Any]:
    """The exported module's globals (as `mn --custom` reads it)."""
    namespace = {"__file__": path, "__name__": "mininet_topo"}
    with open(path) as fh:
        exec(compile(fh.read(), path, "exec"), namespace)   # noqa: S102 - the user's topology
    return namespace


def track(namespace: dict[str, Any], shells: list[Any]) -> None:
    """Record every shell the module's FabricNode starts (so none outlives us)."""
    base: Any = namespace["FabricNode"]

    class Tracked(base):
        def _popen(self, cmd: Any, **params: Any) -> Any:
            popen = super()._popen(cmd, **params)
            shells.append(popen)
            return popen

    namespace["FabricNode"] = Tracked


def kill_leftovers(shells: list[Any], timeout_s: float = 10.0) -> int:
    """Kill node shells still running; how many were still alive after the timeout."""
    for popen in shells:
        if popen.poll() is None:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for popen in shells:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - counted below
            pass
    return sum(1 for p in shells if p.poll() is None)


def main(argv: list[str]) -> int:
    from mininet.log import lg, setLogLevel
    from mininet.net import Mininet

    path, name = argv[0], argv[1]
    batch, netem = "--batch" in argv, "--no-netem" not in argv
    if os.geteuid() != 0:
        print("mininet_runner: needs root", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))
    Mininet.inited = True        # skip fixLimits(): initial-namespace sysctls
    setLogLevel("error" if batch else "info")
    lg.addFilter(_QuietQuantum())
    namespace = load(path)
    shells: list[Any] = []
    track(namespace, shells)
    net = None
    result: dict[str, Any] = {"name": name, "netem": netem}
    try:
        t0 = time.perf_counter()
        net = Mininet(topo=namespace["topos"][name](netem=int(netem)), controller=None,
                      autoSetMacs=False, autoStaticArp=False)
        net.start()
        result["up_s"] = time.perf_counter() - t0
        if batch:
            failed = namespace["fabricping"](net)
            hosts = namespace["FABRIC_HOSTS"]
            result.update(pairs=len(hosts) * (len(hosts) - 1), failed=failed)
        else:
            from mininet.cli import CLI
            CLI(net)
        t1 = time.perf_counter()
        net.stop()
        net = None
        result["down_s"] = time.perf_counter() - t1
    except KeyboardInterrupt:
        print("mininet_runner: interrupted; stopping the network", file=sys.stderr)
    finally:
        if net is not None:
            try:
                net.stop()
            except BaseException as exc:  # noqa: BLE001 - fall back to killing shells
                print(f"mininet_runner: net.stop() failed ({exc!r})", file=sys.stderr)
        result["leftover_shells"] = kill_leftovers(shells)
    print(json.dumps(result), flush=True)
    return 1 if result["leftover_shells"] or result.get("failed") or "down_s" not in result else 0


if __name__ == "__main__":
    # This file's directory holds testbed modules, none of which is Mininet's.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(
        os.path.abspath(__file__))]
    sys.exit(main(sys.argv[1:]))
