"""Run a testbed command inside a qemu VM that boots Debian's stock kernel.

`testbed run --vm FILE` (and up, smoke, calibrate) call `run_in_vm` with the same
command minus `--vm`. The guest sees the host's files at the same paths (read-only,
with a tmpfs overlay for writes), so the command is the same one; the run directories
it writes come back into the host's runs directory when it ends, as if the run had
been local. Every qemu started here is recorded (pid and start time) under
/run/testbed/vm, dies with the process that started it (PR_SET_PDEATHSIG) unless it
was started for `up --vm`, and is ended by pid by `testbed down` / `down --all`.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from testbed.net.state import process_start_time
from testbed.vm import kernel as guest_kernel
from testbed.vm.job import RC_FILE, RC_GUEST_FAILED, STOP_FILE, UP_RC_FILE, Job, Share
from testbed.vm.qemu import VmSpec, choose_accel, qemu_argv, run_probe

# The guest's calibration (its own wall-rate budget: TCG is far slower than the host)
VM_CALIBRATION_DIR = Path("/var/lib/testbed/vm")
# Modules the stock-kernel paths need, loaded in the guest before the command
GUEST_MODULES = ("ipvlan", "rdma_rxe", "sch_netem", "sch_red", "ifb", "sch_htb", "sch_tbf",
                 "cls_u32", "cls_bpf", "sch_ingress", "act_mirred", "vxlan", "bridge")
STOP_GRACE_S = 180.0          # a run's own clean-up inside TCG takes a while
START_MARK = "vm: guest up"
ENV_PASS = ("PYTHONPATH", "TESTBED_STATE_DIR", "TESTBED_RUNS_DIR", "COLUMNS", "NO_COLOR",
            "FORCE_COLOR")
_NOISE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1bc")


def state_dir() -> Path:
    return Path(os.environ.get("TESTBED_VM_STATE_DIR", "/run/testbed/vm"))


@dataclass(frozen=True)
class VmRecord:
    id: str
    pid: int
    start_time: str          # /proc/PID/stat field 22: proves the pid is still ours
    job_dir: str
    lab: str                 # the lab it holds up (`up --vm`), or ""
    argv: list[str]

    def save(self) -> Path:
        state_dir().mkdir(parents=True, exist_ok=True)
        path = state_dir() / f"{self.id}.json"
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


_start_time = process_start_time     # /proc/PID/stat field 22, as the labs' records


def records() -> list[VmRecord]:
    out = []
    for path in sorted(state_dir().glob("*.json")) if state_dir().is_dir() else []:
        try:
            out.append(VmRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return out


def _alive(rec: VmRecord) -> bool:
    return _start_time(rec.pid) == rec.start_time


def _forget(rec: VmRecord) -> None:
    (state_dir() / f"{rec.id}.json").unlink(missing_ok=True)
    shutil.rmtree(rec.job_dir, ignore_errors=True)


def stop(rec: VmRecord, grace_s: float = 60.0) -> bool:
    """Ask the guest to stop (it runs its stop command, then powers off); kill the qemu
    by pid if it has not gone within `grace_s`. True if a live VM was stopped."""
    if not _alive(rec):
        _forget(rec)
        return False
    try:
        (Path(rec.job_dir) / STOP_FILE).write_text("stop\n")
    except OSError:
        pass
    deadline = time.monotonic() + grace_s
    while _alive(rec) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(rec):
        _kill(rec.pid)
    _forget(rec)
    return True


def _kill(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def stop_all() -> list[str]:
    """End every recorded VM (`down --all`); the ids of those that were running."""
    # A run VM asked to stop interrupts its run, which still cleans up and copies its
    # directory back: under TCG that takes a minute or two, so it gets that long.
    return [rec.id for rec in records() if stop(rec, grace_s=STOP_GRACE_S)]


def stop_lab(lab: str, grace_s: float = 60.0) -> bool:
    """End the VM holding `lab` (`up --vm`); True if one was running."""
    found = False
    for rec in records():
        if rec.lab == lab:
            found = stop(rec, grace_s) or found
    return found


def _pdeathsig() -> None:
    # The VM dies with the `testbed` process that started it, even after a SIGKILL.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    os.setsid()


def guest_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {"PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
           "TERM": os.environ.get("TERM", "dumb") if sys.stdout.isatty() else "dumb",
           "TESTBED_VM": "1",
           "TESTBED_CALIBRATION": str(VM_CALIBRATION_DIR / "calibration.json"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    if "COLUMNS" not in os.environ:
        env["COLUMNS"] = str(shutil.get_terminal_size((120, 40)).columns)
    for key in ENV_PASS:
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(extra or {})
    return env


# Python in a TCG guest runs about 20 times slower than on its host (agents/timebase.py);
# wall timeouts that wait for work scale by it. Under KVM the guest is near native.
SLOWDOWN = {"tcg": "20", "kvm": "1.5"}


def _spec(kernel: guest_kernel.GuestKernel, job_dir: Path, shares: list[Share],
          accel: str) -> VmSpec:
    return VmSpec(vmlinuz=str(kernel.vmlinuz), initrd=str(kernel.initrd),
                  modules=str(kernel.modules), python=sys.executable, job_dir=str(job_dir),
                  shares=[(s.tag, s.path) for s in shares], accel=accel,
                  cpus=max(1, min(os.cpu_count() or 1, 4)))


def _probe_kvm(kernel: guest_kernel.GuestKernel) -> tuple[bool, str]:
    job_dir = Path(f"/run/testbed/vm-probe-{os.getpid()}")
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        Job(argv=["true"], cwd="/", env=guest_env()).dump(job_dir)
        worked, detail = run_probe(qemu_argv(_spec(kernel, job_dir, [], "kvm")))
        if worked and (job_dir / RC_FILE).read_text().strip() != "0":
            worked, detail = False, "the test guest did not finish its job"
        return worked, detail
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def prepare(say: Callable[[str], None]) -> tuple[guest_kernel.GuestKernel, str, str]:
    kernel = guest_kernel.ensure_guest(say)
    accel, why = choose_accel(guest_kernel.cache_dir(), lambda: _probe_kvm(kernel))
    return kernel, accel, why


def _relay(stream: IO[bytes], out: IO[str], log: IO[str] | None) -> list[str]:
    """Copy the guest console to `out` from the guest's first line on (the firmware's
    screen clearing before it is dropped); returns what came before, for errors."""
    started = False
    early: list[str] = []
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").replace("\r", "")
        if log is not None:
            log.write(line)
            log.flush()
        if not started:
            if START_MARK in line:
                started = True
            else:
                early.append(_NOISE.sub("", line))
                continue
        out.write(line)
        out.flush()
    return early


def run_in_vm(argv: list[str], *, copy_back: Sequence[Path] = (), rw: Sequence[Path] = (),
              modules: tuple[str, ...] = GUEST_MODULES, env: dict[str, str] | None = None,
              label: str = "run", out: IO[str] | None = None,
              say: Callable[[str], None] | None = None,
              timeout_s: float | None = None) -> int:
    """Run `argv` in a fresh VM and return its exit code; the guest console goes to
    `out` (stdout). Ctrl-C interrupts the command in the guest (it cleans up and its run
    directory still comes back); a second Ctrl-C ends the VM at once."""
    out = out or sys.stdout
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    kernel, accel, why = prepare(say)
    vm_id = f"{label}-{os.getpid()}-{int(time.time())}"
    job_dir = state_dir() / vm_id
    job_dir.mkdir(parents=True, exist_ok=True)
    for p in (*copy_back, *rw):
        p.mkdir(parents=True, exist_ok=True)
    backs = [Share(f"out{i}", str(p.resolve())) for i, p in enumerate(copy_back)]
    rws = [Share(f"rw{i}", str(p.resolve())) for i, p in enumerate(rw)]
    Job(argv=list(argv), cwd=os.getcwd(),
        env=guest_env({"TESTBED_MACHINE_SLOWDOWN": SLOWDOWN[accel], **(env or {})}),
        copy_back=backs, rw=rws, modules=list(modules)).dump(job_dir)
    spec = _spec(kernel, job_dir, backs + rws, accel)
    say(f"vm: booting {kernel.package} ({kernel.release}) with qemu, {accel} "
        f"({why}), {spec.cpus} vCPUs")
    proc = subprocess.Popen(qemu_argv(spec), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=_pdeathsig)
    rec = VmRecord(vm_id, proc.pid, _start_time(proc.pid) or "", str(job_dir), "", list(argv))
    rec.save()
    early: list[str] = []
    watchdog = None
    if timeout_s is not None:
        watchdog = threading.Timer(timeout_s, _kill, (proc.pid,))
        watchdog.daemon = True
        watchdog.start()
    try:
        assert proc.stdout is not None
        with open(job_dir / "console.log", "w") as log:
            try:
                early = _relay(proc.stdout, out, log)
            except KeyboardInterrupt:
                say("vm: interrupted: asking the guest's command to stop (Ctrl-C again "
                    "ends the VM at once)")
                (job_dir / STOP_FILE).write_text("stop\n")
                try:
                    early = _relay(proc.stdout, out, log)
                except KeyboardInterrupt:
                    _kill(proc.pid)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill(proc.pid)
            proc.wait()
        try:
            rc = int((job_dir / RC_FILE).read_text().strip())
        except (OSError, ValueError):
            rc = RC_GUEST_FAILED
            tail = "".join(early[-20:]).strip()
            say(f"vm: the guest ended without an exit code (qemu exit {proc.returncode})"
                + (f":\n{tail}" if tail else ""))
        return rc
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if proc.poll() is None:
            _kill(proc.pid)
        _forget(rec)


def start_detached(argv: list[str], stop_argv: list[str], *, lab: str,
                   rw: Sequence[Path] = (), modules: tuple[str, ...] = GUEST_MODULES,
                   out: IO[str] | None = None,
                   say: Callable[[str], None] | None = None) -> int:
    """`up --vm`: start a VM that runs `argv` (testbed up) and then stays up holding the
    lab until `testbed down LAB` (or `down --all`) asks it to run `stop_argv` and power
    off. Returns the exit code of `argv`; on failure the VM is already gone."""
    out = out or sys.stdout
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    if any(rec.lab == lab and _alive(rec) for rec in records()):
        say(f"vm: lab {lab!r} is already up in a VM; `testbed down {lab}` first")
        return 1
    kernel, accel, why = prepare(say)
    vm_id = f"up-{lab}-{os.getpid()}-{int(time.time())}"
    job_dir = state_dir() / vm_id
    job_dir.mkdir(parents=True, exist_ok=True)
    rws = [Share(f"rw{i}", str(p.resolve())) for i, p in enumerate(rw)]
    for p in rw:
        p.mkdir(parents=True, exist_ok=True)
    Job(argv=list(argv), cwd=os.getcwd(),
        env=guest_env({"TESTBED_MACHINE_SLOWDOWN": SLOWDOWN[accel]}), rw=rws,
        modules=list(modules), stay_up=True, stop_argv=list(stop_argv)).dump(job_dir)
    spec = _spec(kernel, job_dir, rws, accel)
    say(f"vm: booting {kernel.package} with qemu, {accel} ({why}); it holds lab {lab!r} "
        f"until `testbed down {lab}`")
    with open(job_dir / "console.log", "wb") as log:
        proc = subprocess.Popen(qemu_argv(spec), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    rec = VmRecord(vm_id, proc.pid, _start_time(proc.pid) or "", str(job_dir), lab, list(argv))
    rec.save()
    shown = 0
    started = False
    try:
        while True:
            text = (job_dir / "console.log").read_text(errors="replace")
            lines = text.replace("\r", "").splitlines(keepends=True)
            for line in lines[shown:]:
                if not started and START_MARK in line:
                    started = True
                if started and line.endswith("\n"):
                    out.write(line)
            out.flush()
            shown = len(lines) - (0 if text.endswith("\n") else 1)
            up_rc = job_dir / UP_RC_FILE
            if up_rc.exists():
                rc = int(up_rc.read_text().strip() or RC_GUEST_FAILED)
                if rc != 0:
                    proc.wait(timeout=STOP_GRACE_S)
                    _forget(rec)
                return rc
            if proc.poll() is not None:
                say(f"vm: the guest ended before `up` finished (qemu exit {proc.returncode})")
                _forget(rec)
                return RC_GUEST_FAILED
            time.sleep(0.5)
    except KeyboardInterrupt:
        say("vm: interrupted: taking the VM down")
        stop(rec, grace_s=STOP_GRACE_S)
        return 130
