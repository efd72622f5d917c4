"""The guest's second stage: PID 1 in the VM, in the host's own venv.

Stage 1 (testbed/vm/initramfs.py) mounted the host's root read-only under a tmpfs
overlay and switched to it. This stage makes that a machine a testbed run can use:
the kernel filesystems (/run and /dev/shm as tmpfs, bpffs, devpts, cgroup2), the
modules the stock-kernel paths need (rdma_rxe wants crc32_generic first, or it fails
with "failed to init crc32 algorithm"), the job share and the read-write shares. It
then runs the job's command with its output on the console (the host relays it),
copies the run directories back, writes the exit code and powers the VM off. Its
initial network namespace is the run's own: nothing else runs in this machine.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from testbed.vm.job import (
    GUEST_JOB_DIR,
    RC_FILE,
    RC_GUEST_FAILED,
    READY_FILE,
    STOP_FILE,
    UP_RC_FILE,
    Job,
)

NINEP = "trans=virtio,version=9p2000.L,msize=512000"
BASE_MODULES = ("crc32_generic", "veth")
RB_POWER_OFF = 0x4321FEDC


def say(msg: str) -> None:
    print(f"vm: {msg}", flush=True)


def mount(src: str, target: str, fstype: str, opts: str = "") -> bool:
    os.makedirs(target, exist_ok=True)
    argv = ["mount", "-t", fstype, *(["-o", opts] if opts else []), src, target]
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        say(f"mount {fstype} {target} failed: {res.stderr.strip()}")
    return res.returncode == 0


def prepare_machine() -> None:
    mount("tmpfs", "/run", "tmpfs", "mode=755")
    # /tmp stays the overlay's (writable, gone at power-off): a project or a test's
    # directory may live under the host's /tmp, and the guest must see it there.
    mount("tmpfs", "/dev/shm", "tmpfs", "mode=1777")
    mount("devpts", "/dev/pts", "devpts")
    mount("bpf", "/sys/fs/bpf", "bpf")
    mount("cgroup2", "/sys/fs/cgroup", "cgroup2")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    subprocess.run(["hostname", "testbed-vm"], check=False)


def snapshot(path: Path) -> dict[str, float]:
    """Entry name -> newest mtime below it, for the entries of `path`."""
    out: dict[str, float] = {}
    if not path.is_dir():
        return out
    for entry in path.iterdir():
        newest = entry.lstat().st_mtime
        if entry.is_dir() and not entry.is_symlink():
            for sub in entry.rglob("*"):
                newest = max(newest, sub.lstat().st_mtime)
        out[entry.name] = newest
    return out


OUT_BASE = Path("/run/testbed-vm/out")


def copy_back(job: Job, before: dict[str, dict[str, float]], out_base: Path = OUT_BASE
              ) -> list[str]:
    """Copy the entries of each copy-back directory that are new or changed since
    `before` into its share; returns the paths copied."""
    copied: list[str] = []
    for share in job.copy_back:
        src = Path(share.path)
        dst = out_base / share.tag
        after = snapshot(src)
        changed = [n for n, t in after.items() if before[share.tag].get(n) != t]
        for name in sorted(changed):
            s, d = src / name, dst / name
            if s.is_dir() and not s.is_symlink():
                shutil.copytree(s, d, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(s, d, follow_symlinks=False)
            copied.append(str(s))
        if changed:
            say(f"copied back {len(changed)} entr{'y' if len(changed) == 1 else 'ies'} "
                f"of {src}")
    return copied


def run_command(job: Job, jobdir: Path) -> int:
    env = dict(job.env)
    proc = subprocess.Popen(job.argv, cwd=job.cwd, env=env, stdin=subprocess.DEVNULL)
    (jobdir / READY_FILE).write_text(str(proc.pid))
    stopped = False
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if not stopped and (jobdir / STOP_FILE).exists():
            # As Ctrl-C would: the command cleans up and writes its run directory.
            stopped = True
            proc.send_signal(signal.SIGINT)


def stay_up(job: Job, jobdir: Path) -> None:
    while not (jobdir / STOP_FILE).exists():
        time.sleep(0.5)
    if job.stop_argv:
        subprocess.call(job.stop_argv, cwd=job.cwd, env=dict(job.env),
                        stdin=subprocess.DEVNULL)


def main() -> None:
    rc = RC_GUEST_FAILED
    jobdir = Path(GUEST_JOB_DIR)
    try:
        prepare_machine()
        say(f"guest up (kernel {os.uname().release}, "
            f"{time.clock_gettime(time.CLOCK_BOOTTIME):.1f} s since boot)")
        if not mount("job", str(jobdir), "9p", NINEP):
            raise RuntimeError("no job share")
        job = Job.load(jobdir)
        for share in job.rw:
            mount(share.tag, share.path, "9p", NINEP)
        for share in job.copy_back:
            mount(share.tag, str(OUT_BASE / share.tag), "9p", NINEP)
            Path(share.path).mkdir(parents=True, exist_ok=True)
        modules = [*BASE_MODULES, *job.modules]
        res = subprocess.run(["modprobe", "-a", *modules], capture_output=True, text=True)
        if res.returncode != 0:
            say(f"modprobe: {res.stderr.strip()}")
        before = {s.tag: snapshot(Path(s.path)) for s in job.copy_back}
        rc = run_command(job, jobdir)
        if job.stay_up:
            (jobdir / UP_RC_FILE).write_text(f"{rc}\n")
            if rc == 0:
                stay_up(job, jobdir)
        copy_back(job, before)
    except Exception as exc:   # PID 1 must not die with a traceback: say it, power off
        say(f"guest failed: {exc!r}")
    finally:
        try:
            (jobdir / RC_FILE).write_text(f"{rc}\n")
        except OSError:
            pass
        sys.stdout.flush()
        os.sync()
        ctypes.CDLL(None, use_errno=True).reboot(RB_POWER_OFF)


if __name__ == "__main__":
    main()
