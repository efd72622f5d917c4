"""Run one side of a perftest test on an rxe device: `python -m agents.perftest server|client`.

The run starts this agent in the host's namespace. The rxe device may live elsewhere:
on kernels whose rxe is not namespace aware the testbed places it in the initial
namespace (testbed/net/rxe.py). `--netns auto` (the default) asks the kernel: rdma
netlink names a device's netdev only to a caller in that netdev's namespace, so the
agent looks for its device's netdev here and, failing that, in the initial namespace
(/proc/1/ns/net), enters it and runs perftest there.

- server: starts perftest without a peer address, creates --ready-file once perftest's
  TCP set-up port listens, and reports when perftest exits;
- client: waits for --start-at-mono-ns (the run's common start), runs perftest against
  the server's address, and reports.

perftest runs as a child that dies with the agent (PR_SET_PDEATHSIG) and is stopped after
--timeout-s, so neither a killed run nor a missing peer leaves it behind. The report (one
JSON line on stdout, and --out) holds the argv, the exit code, the namespace it ran in,
the parsed rows (agents/perftest/parse.py) or the error, and the tail of perftest's output.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from agents.perftest.parse import PerftestOutputError, parse_report
from agents.runtime.lifecycle import Lifecycle
from agents.runtime.output import mark_ready, report_counters
from agents.runtime.start import add_start_arguments, await_start

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
TESTS = ("ib_write_bw", "ib_send_bw", "ib_write_lat")


def perftest_argv(test: str, device: str, *, size_bytes: int, qps: int, tclass: int,
                  gid_index: int, port: int, duration_s: int | None, iterations: int | None,
                  server: str | None, qp_timeout_exp: int | None = None) -> list[str]:
    """perftest's command line (both sides take the same options; the client adds the
    server's address)."""
    if test not in TESTS:
        raise ValueError(f"unknown perftest test {test!r}; one of {', '.join(TESTS)}")
    argv = [test, "-d", device, "-x", str(gid_index), "-F", "-s", str(size_bytes),
            "-p", str(port), f"--tclass={tclass}"]
    if qp_timeout_exp is not None:
        argv += ["-u", str(qp_timeout_exp)]
    if not test.endswith("_lat"):
        argv += ["--report_gbits", "-q", str(qps)]
    argv += ["-D", str(duration_s)] if duration_s else ["-n", str(iterations or 1000)]
    return [*argv, server] if server else argv


def netdev_here(device: str) -> bool:
    """Whether rdma netlink, asked from this namespace, names the device's netdev."""
    proc = subprocess.run(["rdma", "-j", "link", "show", f"{device}/1"], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=30)
    if proc.returncode != 0:
        return False
    try:
        return any(link.get("netdev") for link in json.loads(proc.stdout or "[]"))
    except json.JSONDecodeError:
        return False


def enter_initial_namespace() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/proc/1/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the initial namespace")
    finally:
        os.close(fd)


def place(device: str, netns: str) -> str:
    """Move this process to where `device` lives; returns 'host' or 'initial'."""
    if netns == "host" or (netns == "auto" and netdev_here(device)):
        return "host"
    enter_initial_namespace()
    if netns == "auto" and not netdev_here(device):
        raise RuntimeError(f"rxe device {device} has no netdev in this host's namespace nor "
                           "in the initial one (was the lab built with it?)")
    return "initial"


def tcp_listening(port: int) -> bool:
    want = f":{port:04X}"
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as fh:
                for line in fh.readlines()[1:]:
                    f = line.split()
                    if len(f) > 3 and f[1].endswith(want) and f[3] == "0A":
                        return True
        except OSError:
            continue
    return False


def _pdeathsig() -> None:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_perftest(cmd: list[str], args: argparse.Namespace, life: Lifecycle,
                  deadline: int) -> tuple[subprocess.Popen, str]:
    """Run perftest once (the server marks itself ready once it listens); its output."""
    # perftest itself is the child (not a wrapper), so PR_SET_PDEATHSIG ends it with the agent
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig)
    ready = False
    while proc.poll() is None:
        if time.monotonic_ns() > deadline:
            life.stop("timeout")
        if args.role == "server" and not ready and tcp_listening(args.port):
            mark_ready(args.ready_file)
            ready = True
        if life.should_stop():
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
        time.sleep(0.02)
    return proc, proc.communicate()[0] or ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.perftest")
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--test", choices=TESTS, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--netns", choices=["auto", "host", "initial"], default="auto")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--qps", type=int, default=1)
    ap.add_argument("--tclass", type=int, default=0, help="the IP TOS byte (DSCP << 2 | ECN)")
    ap.add_argument("--gid-index", type=int, default=1)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--qp-timeout-exp", type=int, default=None,
                    help="perftest -u: the QP's ACK timeout is 4.096 us x 2^exp (wall)")
    ap.add_argument("--duration-s", type=int, default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--server", default=None, help="client: the server's address")
    ap.add_argument("--timeout-s", type=float, required=True,
                    help="the longest perftest may run (wall), then it is killed")
    ap.add_argument("--ready-file")
    ap.add_argument("--out")
    ap.add_argument("--control-sock")                     # given to every agent; not served
    add_start_arguments(ap)
    ap.add_argument("--start-at-mono-ns", type=int, default=0)
    args = ap.parse_args(argv)

    life = Lifecycle()
    life.install_signal_handlers()
    report: dict = {"role": args.role, "test": args.test, "device": args.device}
    try:
        report["netns"] = place(args.device, args.netns)
    except Exception as exc:
        report.update(rc=None, error=str(exc))
        report_counters(report, args.out)
        return 1
    cmd = perftest_argv(args.test, args.device, size_bytes=args.size, qps=args.qps,
                        tclass=args.tclass, gid_index=args.gid_index, port=args.port,
                        duration_s=args.duration_s, iterations=args.iterations,
                        server=args.server if args.role == "client" else None,
                        qp_timeout_exp=args.qp_timeout_exp)
    report["argv"] = cmd
    if args.role == "client":
        await_start(args, life)
    if life.should_stop():
        report.update(rc=None, error=f"stopped before perftest started ({life.stop_reason})")
        report_counters(report, args.out)
        return 1
    t_start = time.monotonic_ns()
    deadline = t_start + int(args.timeout_s * 1e9)
    attempts = 0
    while True:
        attempts += 1
        proc, out = _run_perftest(cmd, args, life, deadline)
        # A client that came before its server listened (a slow host: the run waits for
        # the server's ready file only so long) tries again while its time lasts.
        if (args.role == "client" and "Couldn't connect" in out and not life.should_stop()
                and time.monotonic_ns() + 2_000_000_000 < deadline):
            time.sleep(1.0)
            continue
        break
    report["attempts"] = attempts
    report.update(rc=proc.returncode, wall_ns=time.monotonic_ns() - t_start,
                  stop_reason=life.stop_reason, output_tail=out[-2000:])
    try:
        report["rows"] = [r.as_dict() for r in parse_report(out)]
    except PerftestOutputError as exc:
        report["error"] = str(exc)
    report_counters(report, args.out)
    return 0 if proc.returncode == 0 and "rows" in report else 1


if __name__ == "__main__":
    sys.exit(main())
