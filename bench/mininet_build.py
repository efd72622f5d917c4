"""Mininet side of bench/bringup.py: build a fabric spec with Mininet, time up and down.

Runs under Debian's /usr/bin/python3 (Mininet is not in the venv). Reads one JSON
spec on stdin (written by bringup.py from our plan: nodes, links, addresses, MACs,
per-link bandwidth, sysctls, routes) and prints one JSON result line on stdout.

What Mininet is asked to do, per the spec:
- every node is a Mininet `Host` (hosts) or a plain `Node` (routers), each a bash
  shell in its own network namespace (no controller, no switches);
- on every node, one `sysctl -w` with the plan's sysctls (ip_forward=1 on routers);
- every link is a `TCLink` with the plan's interface names and MACs, the plan's /31
  on each end, and `bw=` the plan's wall rate in Mb/s (HTB root + one class);
- with "routes": true (--mininet-parity), every plan route as one `ip route add` (ECMP
  as nexthop lists), and with a link's "mtu" set, `ifconfig IF mtu N` on both ends.

`up` is Mininet(...) + addHost + addLink + build() + start(): Mininet does its node
and link work in addHost/addLink, so build()/start() alone would time almost nothing.
`down` is net.stop().

Mininet.init() is skipped on purpose (root is checked here instead): it would raise
sysctls of the initial namespace (fixLimits), which this testbed never touches. The
only limit that matters at this size (open files) is raised for this process alone.

Cleanup: every shell started is recorded; whatever happens (exception, SIGINT,
SIGTERM) net.stop() runs, and any shell still alive after it is killed, which takes
its namespace and veth ends with it. The result says whether all shells were gone.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys
import time

from mininet.link import TCLink
from mininet.log import lg, setLogLevel
from mininet.net import Mininet
from mininet.node import Host, Node

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


class _Tracked:
    """Mixin: record each node's shell and count the commands sent to it."""

    def _popen(self, cmd, **params):
        popen = super()._popen(cmd, **params)
        _SHELLS.append(popen)
        return popen

    def cmd(self, *args, **kwargs):
        _COMMANDS[0] += 1
        return super().cmd(*args, **kwargs)

    def config(self, sysctls=None, routes=None, **params):
        result = super().config(**params)
        if sysctls:
            self.cmd("sysctl -q -w " + " ".join(f"{k}={v}" for k, v in sysctls.items()))
        for dst, hops in routes or []:
            if len(hops) == 1:
                gateway, ifname = hops[0]
                self.cmd(f"ip route add {dst} via {gateway} dev {ifname}")
            else:
                self.cmd(f"ip route add {dst} " + " ".join(
                    f"nexthop via {gateway} dev {ifname}" for gateway, ifname in hops))
        return result


class BenchHost(_Tracked, Host):
    pass


class BenchRouter(_Tracked, Node):
    """A router as Mininet's examples build one: a plain Node; ip_forward comes with
    the plan's sysctls."""


def _kill_leftover_shells(timeout_s: float = 10.0) -> int:
    """Kill shells still running (after net.stop() or a failed build); returns how many
    were still alive after the timeout."""
    for popen in _SHELLS:
        if popen.poll() is None:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    alive = 0
    for popen in _SHELLS:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - TimeoutExpired; count it below
            pass
        if popen.poll() is None:
            alive += 1
    return alive


_MAIN_PID = os.getpid()


def _on_sigterm(signum, _frame):
    if os.getpid() != _MAIN_PID:     # a forked copy: die as by default
        os._exit(128 + signum)
    raise KeyboardInterrupt(f"signal {signum}")


def run(spec: dict) -> dict:
    phases: dict[str, float] = {}
    with_routes = bool(spec.get("routes"))
    net = None
    up_s = down_s = None
    t0 = time.perf_counter()
    try:
        net = Mininet(topo=None, controller=None, build=False, link=TCLink,
                      autoSetMacs=False, autoStaticArp=False)
        for node in spec["nodes"]:
            cls = BenchRouter if node["role"] == "switch" else BenchHost
            net.addHost(node["name"], cls=cls, ip=None, sysctls=node["sysctls"],
                        routes=node["routes"] if with_routes else None)
        t1 = time.perf_counter()
        phases["nodes (shells)"] = t1 - t0
        for link in spec["links"]:
            params1, params2 = {"ip": link["a_ip"]}, {"ip": link["b_ip"]}
            if link.get("mtu"):
                params1["ifconfig"] = params2["ifconfig"] = f"mtu {link['mtu']}"
            net.addLink(link["a"], link["b"], intfName1=link["a_if"], intfName2=link["b_if"],
                        addr1=link["a_mac"], addr2=link["b_mac"], params1=params1,
                        params2=params2, bw=link["bw_mbit"])
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
    return {"up_s": up_s, "down_s": down_s, "phases": phases, "nodes": len(spec["nodes"]),
            "links": len(spec["links"]), "up_commands": up_commands,
            "down_commands": _COMMANDS[0] - up_commands, "leftover_shells": leftover,
            "htb_quantum_warnings": _QUIET[0],
            "routes": with_routes}


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
    spec = json.load(sys.stdin)
    try:
        result = run(spec)
    except KeyboardInterrupt:
        print("mininet_build: interrupted; network stopped", file=sys.stderr)
        return 130
    print(json.dumps(result), flush=True)
    return 1 if result["leftover_shells"] else 0


if __name__ == "__main__":
    sys.exit(main())
