"""Mininet side of bench/bringup.py: build an exported fabric with Mininet, time up and down.

    /usr/bin/python3 bench/mininet_build.py TOPO.py NAME ROUTES NETEM

Runs under Debian's /usr/bin/python3 (Mininet is not in the venv). TOPO.py is the
module `testbed export mininet` writes for bringup.py's plan (testbed/export/
mininet_topo.py), so Mininet builds the very fabric our builder does: every node a
Mininet Host running the module's FabricNode (plan sysctls, ip_forward=1 on routers;
the plan's routes, ECMP as nexthop lists, when ROUTES is 1), every link a TCLink with
the plan's interface names, MACs, /31s and MTU and `bw=` the wall rate in Mb/s (HTB
root + one class); with NETEM 1 also netem delay/loss/queue (bringup passes 0 on a
kernel without sch_netem). Prints one JSON result line on stdout.

`up` is Mininet(...) + the Topo's build + addHost/addLink per node and link (what
Mininet.buildFromTopo does, spelled out here to time the phases) + build() + start().
`down` is net.stop().

Mininet.init() is skipped on purpose (root is checked here instead): it would raise
sysctls of the initial namespace (fixLimits), which this testbed never touches. The
only limit that matters at this size (open files) is raised for this process alone.

Cleanup: every shell started is recorded; whatever happens (exception, SIGINT,
SIGTERM) net.stop() runs, and any shell still alive after it is killed, which takes
its namespace and veth ends with it. The result says whether all shells were gone.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import resource
import signal
import sys
import time
from pathlib import Path

from mininet.log import lg, setLogLevel
from mininet.net import Mininet

_SHELLS = []      # every Popen a node started, so nothing outlives this script
_COMMANDS = [0]   # shell commands Mininet sent to nodes (node.cmd calls)
_QUIET = [0]      # tc warnings not shown (see _QuietQuantum)


class _QuietQuantum(logging.Filter):
    """TCIntf logs tc's "quantum of class 50001 is big" as an error on every interface
    (Mininet sets no r2q/quantum). It is harmless; count it instead of printing it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "quantum of class" in record.getMessage():
            _QUIET[0] += 1
            return False
        return True


def _tracked(base):
    """The exported module's FabricNode, recording each shell and counting commands."""

    class Tracked(base):
        def _popen(self, cmd, **params):
            popen = super()._popen(cmd, **params)
            _SHELLS.append(popen)
            return popen

        def cmd(self, *args, **kwargs):
            _COMMANDS[0] += 1
            return super().cmd(*args, **kwargs)

    return Tracked


def _runner():
    """testbed/export/mininet_runner.py, loaded by path: it imports nothing from testbed,
    so this system-Python script shares its loading and clean-up instead of copying them."""
    path = Path(__file__).resolve().parent.parent / "testbed" / "export" / "mininet_runner.py"
    spec = importlib.util.spec_from_file_location("mininet_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNNER = _runner()


def load_topo(path: str) -> dict:
    """The exported module's globals, read as `mn --custom` reads it."""
    namespace = RUNNER.load(path)
    namespace["FabricNode"] = _tracked(namespace["FabricNode"])
    return namespace


def _kill_leftover_shells(timeout_s: float = 10.0) -> int:
    """Kill shells still running (after net.stop() or a failed build); returns how many
    were still alive after the timeout."""
    return RUNNER.kill_leftovers(_SHELLS, timeout_s)


_MAIN_PID = os.getpid()


def _on_sigterm(signum, _frame):
    if os.getpid() != _MAIN_PID:     # a forked copy: die as by default
        os._exit(128 + signum)
    raise KeyboardInterrupt(f"signal {signum}")


def run(path: str, name: str, routes: bool, netem: bool) -> dict:
    phases: dict[str, float] = {}
    module = load_topo(path)
    net = None
    up_s = down_s = None
    up_commands = 0
    t0 = time.perf_counter()
    try:
        topo = module["topos"][name](netem=int(netem), routes=int(routes))
        net = Mininet(topo=None, controller=None, build=False, autoSetMacs=False,
                      autoStaticArp=False)
        for node in topo.hosts():
            net.addHost(node, **topo.nodeInfo(node))
        t1 = time.perf_counter()
        phases["nodes (shells)"] = t1 - t0
        for _a, _b, info in topo.links(sort=True, withInfo=True):
            net.addLink(**info)
        t2 = time.perf_counter()
        phases["links (veth+ip+tc)"] = t2 - t1
        net.build()
        t3 = time.perf_counter()
        phases["build (config nodes)"] = t3 - t2
        net.start()
        t4 = time.perf_counter()
        phases["start"] = t4 - t3
        up_s = t4 - t0
        up_commands = _COMMANDS[0]
        net.stop()
        down_s = time.perf_counter() - t4
        net = None
    finally:
        if net is not None:
            try:
                net.stop()
            except BaseException as exc:  # noqa: BLE001 - fall back to killing shells
                print(f"mininet_build: net.stop() did not finish ({exc!r}); "
                      "killing the node shells instead", file=sys.stderr)
        leftover = _kill_leftover_shells()
        if leftover:
            print(f"mininet_build: {leftover} node shells would not die", file=sys.stderr)
    return {"up_s": up_s, "down_s": down_s, "phases": phases, "nodes": len(topo.hosts()),
            "links": len(topo.links()), "up_commands": up_commands,
            "down_commands": _COMMANDS[0] - up_commands, "leftover_shells": leftover,
            "htb_quantum_warnings": _QUIET[0],
            "routes": routes, "netem": netem}


def main() -> int:
    if os.geteuid() != 0:
        print("mininet_build: needs root", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    Mininet.inited = True    # skip fixLimits(): it raises sysctls of the initial namespace
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(16384, hard) if hard != resource.RLIM_INFINITY else 16384
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    setLogLevel("error")
    lg.addFilter(_QuietQuantum())
    path, name, routes, netem = sys.argv[1:5]
    try:
        result = run(path, name, routes == "1", netem == "1")
    except KeyboardInterrupt:
        print("mininet_build: interrupted; network stopped", file=sys.stderr)
        return 130
    print(json.dumps(result), flush=True)
    return 1 if result["leftover_shells"] else 0


if __name__ == "__main__":
    sys.exit(main())
