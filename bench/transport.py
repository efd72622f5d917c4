"""How fast one user-space RoCE QP pair moves packets, next to iperf3 UDP on the same link.

Two namespaces `tb-bt<pid>-a` and `tb-bt<pid>-b` joined by one veth pair (MTU
9000, no qdisc, no dilation), made with pyroute2 and always removed. On that
link, one after the other, each for `--seconds` of wall time:

- RoCE: `python -m agents.roce server write_bw` in b, `client write_bw` in a,
  one QP, `--cc none` with a line rate far above what Python reaches (so the
  pacer never waits), 4096-byte path MTU, 1 MiB messages, `--dilation 1`,
  `--spin-ns 0`. Reliable: every packet is ACKed, lost ones are resent. Twice:
  with the compiled fast path (agents.fast, the default) and with the pure-Python
  reference path (TESTBED_FASTPATH=0); each row says which path the agents ran
  (`--path fast|python|both`, default both).
- UET (`--transport uet` or `both`): one `agents.uet.nic.UetNic` per namespace,
  1 MiB WRITEs, 4 outstanding, `cc none`, spray over 16 source ports, 4096-byte
  payloads, a line rate far above what Python reaches, dilation 1 (each side is this
  script started with `--uet-side`). Reliable like RoCE (SACK + NACK + RTO).
- iperf3 UDP: `iperf3 -s` in b, `iperf3 -u -b 0 -l 4096` in a (4096-byte
  datagrams: the RoCE packets' payload is 4096 + 28 bytes of headers).

For each: packets/s and Gb/s of payload sent and received (iperf3 loses
what its receiver cannot keep up with; RoCE resends it), CPU time of the
sender and the receiver process (from wait4's rusage, user + system), and
Gb/s per core = received Gb/s over the cores the pair used. Then the ratio
RoCE / iperf3 of received packets per second. `--profile` reruns RoCE with
the client and the server under cProfile and prints where their time goes.

    sudo .venv/bin/python bench/transport.py [--seconds 5] [--repeat 1] [--profile]
                                             [--transport roce|uet|both]
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ADDR_A, ADDR_B = "198.18.254.0", "198.18.254.1"
MTU = 9000
ROCE_MTU = 4096
MESSAGE = 1 << 20
IPERF_LEN = 4096


class Link:
    """Two namespaces and one veth pair between them; removed on exit, whatever happens."""

    def __init__(self) -> None:
        self.ns = (f"tb-bt{os.getpid()}-a", f"tb-bt{os.getpid()}-b")
        self.made: list[str] = []

    def __enter__(self) -> Link:
        from pyroute2 import NetNS, netns

        try:
            for name in self.ns:
                netns.create(name)
                self.made.append(name)
            with NetNS(self.ns[0]) as a:
                a.link("add", ifname="bt0", kind="veth",
                       peer={"ifname": "bt1", "net_ns_fd": self.ns[1]})
            for name, ifname, addr in ((self.ns[0], "bt0", ADDR_A), (self.ns[1], "bt1", ADDR_B)):
                with NetNS(name) as ns:
                    idx = ns.link_lookup(ifname=ifname)[0]
                    ns.addr("add", index=idx, address=addr, prefixlen=31)
                    ns.link("set", index=idx, mtu=MTU, state="up")
                    ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from pyroute2 import netns

        for name in reversed(self.made):
            try:
                netns.remove(name)
            except OSError as e:
                print(f"could not remove namespace {name}: {e}", file=sys.stderr)
        self.made.clear()

    def argv(self, side: int, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *cmd]


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str, float]:
    """Wait (bounded) and reap with wait4; returns (stdout, stderr, CPU seconds user + system).

    The outputs are small (one JSON document each), so the pipes cannot fill first.
    """
    deadline = time.monotonic() + timeout_s
    cpu_s = 0.0
    signalled = False
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu_s = ru.ru_utime + ru.ru_stime
            break
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGKILL if signalled else signal.SIGTERM)
            deadline = time.monotonic() + 5
            signalled = True
        time.sleep(0.02)
    out, err = proc.communicate()
    return out, err, cpu_s


def _popen(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, env=env)


def _path_env(path: str) -> dict[str, str]:
    """The agents' environment for RoCE path `path` ("fast" or "python")."""
    env = dict(os.environ)
    env["TESTBED_FASTPATH"] = "1" if path == "fast" else "0"
    return env


def _kill(proc: subprocess.Popen) -> None:
    if proc.returncode is None:
        proc.kill()
        proc.communicate()


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"not ready: {proc.args[-1]} {proc.communicate()}")
        time.sleep(0.02)


def roce(link: Link, seconds: float, tmp: Path, profile: Path | None = None,
         server_profile: Path | None = None, path: str = "fast") -> dict:
    ready = tmp / "roce.ready"
    ready.unlink(missing_ok=True)
    common = ["--mtu", str(ROCE_MTU), "--cc", "none", "--line-rate-bps", "1e13",
              "--dilation", "1", "--spin-ns", "0", "--timeout-ns", "50e6", "--verify"]
    py = [sys.executable]
    sprof = ["-m", "cProfile", "-o", str(server_profile)] if server_profile else []
    env = _path_env(path)
    server = _popen(link.argv(1, *py, *sprof, "-m", "agents.roce", "server", "write_bw", "--bind",
                              ADDR_B, "--ready-file", str(ready), *common), env)
    try:
        _wait_file(ready, server)
        prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
        client = _popen(link.argv(0, *py, *prof, "-m", "agents.roce", "client", "write_bw",
                                  "--server", ADDR_B, "--bind", ADDR_A, "--size", str(MESSAGE),
                                  "--duration-ns", str(int(seconds * 1e9)), "--tx-depth", "4",
                                  "--buffer-bytes", str(8 * MESSAGE), *common), env)
        c_out, c_err, c_cpu = _finish(client, seconds + 60)
        s_out, s_err, s_cpu = _finish(server, 30)
    finally:
        _kill(server)
    c = json.loads(c_out.strip().splitlines()[-1])
    s = json.loads(s_out.strip().splitlines()[-1])
    if c.get("error") or s.get("error"):
        raise RuntimeError(f"RoCE run failed: {c.get('error') or s.get('error')}\n{c_err}{s_err}")
    wall = c["elapsed_wall_ns"] / 1e9
    (qp,) = c["qps"].values()
    rx_packets = s["data_packets_received"]
    ran = {side: (r.get("fast_path") or {}).get("on") for side, r in (("client", c), ("server", s))}
    if set(ran.values()) != {path == "fast"}:
        raise RuntimeError(f"asked for the {path} path, the agents ran: {ran} "
                           f"({c.get('fast_path')}, {s.get('fast_path')})")
    return {"tool": f"RoCE write_bw, 1 QP, {path}", "wall_s": wall,
            "tx_pps": c["data_packets_sent"] / wall, "rx_pps": rx_packets / wall,
            "rx_gbps": c["bytes"] * 8 / wall / 1e9,
            "tx_cpu": c_cpu / wall, "rx_cpu": s_cpu / wall,
            "retx": qp["requester"]["retransmissions"], "verified": c.get("verified")}


def iperf(link: Link, seconds: float) -> dict:
    server = _popen(link.argv(1, "iperf3", "-s", "-1", "-B", ADDR_B, "-J"))
    try:
        time.sleep(0.3)
        client = _popen(link.argv(0, "iperf3", "-c", ADDR_B, "-B", ADDR_A, "-u", "-b", "0",
                                  "-l", str(IPERF_LEN), "-t", str(seconds), "-J"))
        c_out, c_err, c_cpu = _finish(client, seconds + 30)
        s_out, _s_err, s_cpu = _finish(server, 10)
    finally:
        _kill(server)
    try:
        c = json.loads(c_out)
    except ValueError:
        raise RuntimeError(f"iperf3 gave no JSON: {c_err or c_out}") from None
    end = c["end"]["sum"]
    wall = end["seconds"]
    sent = end["packets"]
    lost = end.get("lost_packets", 0)
    return {"tool": f"iperf3 -u -b 0 -l {IPERF_LEN}", "wall_s": wall,
            "tx_pps": sent / wall, "rx_pps": (sent - lost) / wall,
            "rx_gbps": (sent - lost) * IPERF_LEN * 8 / wall / 1e9,
            "tx_cpu": c_cpu / wall, "rx_cpu": s_cpu / wall, "retx": None, "verified": None}


UET_MESSAGE = 1 << 20
UET_DEPTH = 4
UET_DONE_TAG = 0xD0E


def uet(link: Link, seconds: float, tmp: Path) -> dict:
    """One UET NIC per namespace, WRITEs from a to b for `seconds` (see the docstring)."""
    ready = tmp / "uet.ready"
    ready.unlink(missing_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    server = _popen(link.argv(1, *me, "--uet-side", "rx", "--ready-file", str(ready)))
    try:
        _wait_file(ready, server)
        client = _popen(link.argv(0, *me, "--uet-side", "tx", "--seconds", str(seconds)))
        c_out, c_err, c_cpu = _finish(client, seconds + 60)
        s_out, s_err, s_cpu = _finish(server, 30)
    finally:
        _kill(server)
    try:
        c = json.loads(c_out.strip().splitlines()[-1])
        s = json.loads(s_out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"UET run failed:\n{c_err}{s_err}") from None
    wall = c["wall_s"]
    return {"tool": "UET write, 1 PDC, spray 16", "wall_s": wall,
            "tx_pps": c["tx_packets"] / wall, "rx_pps": s["rx_packets"] / wall,
            "rx_gbps": c["bytes"] * 8 / wall / 1e9,
            "tx_cpu": c_cpu / wall, "rx_cpu": s_cpu / wall,
            "retx": c["retransmissions"], "verified": s["verified"],
            "why": f"{s['out_of_order']} out of order, {s['duplicates']} duplicates, "
                   f"{s['overflow_drops']} receive-buffer drops at the target"}


def uet_side(side: str, seconds: float, ready_file: str | None) -> int:
    """One end of the UET run, inside its namespace: prints one JSON line."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from agents.timebase import Dilation, FabricClock
    from agents.uet.nic import UetNic, UetOptions

    d = Dilation(1)
    clock = FabricClock(d)
    opts = UetOptions(dscp=26, cc="none", entropy="spray", entropies=16, line_rate_bps=1e13,
                      rto_ns=50e6, spin_ns=0)
    pattern = np.random.default_rng(7).integers(0, 256, UET_MESSAGE * UET_DEPTH,
                                                 dtype=np.uint8)
    if side == "rx":
        nic = UetNic(ADDR_B, clock, d, opts)
        region = np.zeros_like(pattern)
        nic.register(1, region)
        finished: list[int] = []
        bad: list[int] = []

        def on_write(peer: str, key: int, off: int, n: int) -> None:
            if not np.array_equal(region[off:off + n], pattern[off:off + n]):
                bad.append(off)
            region[off:off + n] = 0

        nic.on_write = on_write
        nic.on_message = lambda peer, tag, mid, data: finished.append(mid)
        if ready_file:
            Path(ready_file).touch()
        deadline = time.monotonic() + 600
        nic.run(lambda: bool(finished) or time.monotonic() > deadline)
        linger = time.monotonic() + 0.3             # answer what the sender resends
        nic.run(lambda: time.monotonic() > linger)
        t = nic.counters()["totals"]
        print(json.dumps({"rx_packets": t["rx_packets"], "duplicates": t["duplicates"],
                          "out_of_order": t["out_of_order"],
                          "overflow_drops": nic.counters()["sockets"]["overflow_drops"],
                          "verified": bool(finished) and not bad}))
        return 0
    nic = UetNic(ADDR_A, clock, d, opts)
    outstanding = [0]
    sent = [0]
    slot_of: dict[int, int] = {}

    def post(off: int) -> None:
        # a slot is written again only once its previous message is acknowledged
        outstanding[0] += 1
        slot_of[nic.write(ADDR_B, 1, off, pattern[off:off + UET_MESSAGE], on_done=done)] = off

    def done(mid: int) -> None:
        outstanding[0] -= 1
        sent[0] += UET_MESSAGE
        off = slot_of.pop(mid)
        if time.perf_counter() < end:
            post(off)

    start = time.perf_counter()
    end = start + seconds
    for k in range(UET_DEPTH):
        post(k * UET_MESSAGE)
    nic.run(lambda: outstanding[0] == 0)
    wall = time.perf_counter() - start
    fin = [False]
    nic.send(ADDR_B, UET_DONE_TAG, b"done", on_done=lambda _m: fin.__setitem__(0, True))
    nic.run(lambda: fin[0])
    t = nic.counters()["totals"]
    print(json.dumps({"wall_s": wall, "bytes": sent[0], "tx_packets": t["tx_packets"],
                      "retransmissions": t["retransmissions"]}))
    return 0


def per_core(row: dict) -> float:
    cores = row["tx_cpu"] + row["rx_cpu"]
    return row["rx_gbps"] / cores if cores else 0.0


def table(rows: list[dict]) -> str:
    head = (f"{'tool':<28} {'sent pps':>10} {'recv pps':>10} {'recv Gb/s':>10} "
            f"{'tx cores':>9} {'rx cores':>9} {'Gb/s/core':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['tool']:<28} {r['tx_pps']:>10,.0f} {r['rx_pps']:>10,.0f} "
                     f"{r['rx_gbps']:>10.2f} {r['tx_cpu']:>9.2f} {r['rx_cpu']:>9.2f} "
                     f"{per_core(r):>10.2f}")
    return "\n".join(lines)


def median_row(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for k in ("tx_pps", "rx_pps", "rx_gbps", "tx_cpu", "rx_cpu"):
        out[k] = statistics.median(r[k] for r in rows)
    return out


def print_profile(path: Path, who: str, top: int = 18) -> None:
    stats = pstats.Stats(str(path))
    for key, title in (("tottime", "internal time"), ("cumulative", "cumulative time")):
        print(f"\nRoCE {who} under cProfile, top {top} by {title}:")
        stats.sort_stats(key).print_stats(top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per tool and run (wall)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool; medians shown")
    parser.add_argument("--transport", choices=("roce", "uet", "both"), default="roce",
                        help="which user-space transport(s) to run beside iperf3 "
                             "(default %(default)s)")
    parser.add_argument("--uet-side", choices=("rx", "tx"), help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=("fast", "python", "both"), default="both",
                        help="RoCE with the compiled fast path, the pure-Python path, or both "
                             "(default %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="rerun RoCE with client and server under cProfile and print their "
                             "top functions")
    args = parser.parse_args()
    if args.uet_side:
        return uet_side(args.uet_side, args.seconds, args.ready_file)
    if os.geteuid() != 0:
        print("bench/transport.py needs root (it makes network namespaces)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tb-bt-") as tmpdir, Link() as link:
        tmp = Path(tmpdir)
        paths = ("fast", "python") if args.path == "both" else (args.path,)
        runs_roce: dict[str, list[dict]] = {p: [] for p in paths}
        runs_uet, runs_iperf = [], []
        for _ in range(args.repeat):
            if args.transport in ("roce", "both"):
                for p in paths:     # interleaved, so both see the same machine
                    runs_roce[p].append(roce(link, args.seconds, tmp, path=p))
            if args.transport in ("uet", "both"):
                runs_uet.append(uet(link, args.seconds, tmp))
            runs_iperf.append(iperf(link, args.seconds))
        i = median_row(runs_iperf)
        rows = [median_row(x) for x in (*runs_roce.values(), runs_uet) if x]
        print(f"one veth pair {link.ns[0]} <-> {link.ns[1]}, MTU {MTU}, {args.seconds:g} s "
              f"per run, median of {args.repeat}; RoCE: path MTU {ROCE_MTU}, {MESSAGE} B "
              f"writes; UET: {UET_MESSAGE} B writes, 4096 B payloads")
        for name, runs in (*((f"RoCE {p}", r) for p, r in runs_roce.items()),
                           ("UET", runs_uet)):
            if runs:
                print(f"{name}: retransmissions {[x['retx'] for x in runs]}, verified "
                      f"{[x['verified'] for x in runs]}")
                for x in runs:
                    if x.get("why"):
                        print(f"  {name} run: {x['why']}")
        print(table([*rows, i]))
        for r in rows:
            name = r["tool"].split(",")[0] + (f" ({r['tool'].rsplit(', ', 1)[1]} path)"
                                             if r["tool"].startswith("RoCE") else "")
            print(f"{name} / iperf3: {r['rx_pps'] / i['rx_pps']:.0%} of the received packet "
                  f"rate, {r['tx_pps'] / i['tx_pps']:.0%} of the sent packet rate, "
                  f"{per_core(r) / per_core(i):.0%} of the Gb/s per core (goal: >= 70 % of "
                  "the packet rate)")
        if "fast" in runs_roce and "python" in runs_roce:
            f, py = median_row(runs_roce["fast"]), median_row(runs_roce["python"])
            print(f"RoCE fast / python path: {f['rx_pps'] / py['rx_pps']:.2f}x the received "
                  f"packet rate, {per_core(f) / per_core(py):.2f}x the Gb/s per core")
        if args.profile and any(runs_roce.values()):
            prof, sprof = tmp / "client.prof", tmp / "server.prof"
            roce(link, min(args.seconds, 3.0), tmp, profile=prof, server_profile=sprof,
                 path=paths[0])
            print_profile(prof, "client")
            print_profile(sprof, "server")
    return 0


if __name__ == "__main__":
    sys.exit(main())
