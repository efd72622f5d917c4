"""The qemu command line of a testbed VM, and the choice of accelerator.

Pure where it can be: `qemu_argv` turns a VmSpec into argv (unit-tested). The VM has
no network device at all: the fabric lives entirely inside it, so no fabric packet can
reach the host. Disks are 9p shares: the host's root read-only (`hostroot`), the guest
kernel's module tree (`modules`), the job directory and the read-write shares of the
job. The console (ttyS0) is a pipe to the host process, which relays it.

KVM is used only when a short, timed boot proves it works: on nested machines it can
hang at "Booting from ROM" or abort setting an MSR; TCG (multi-threaded, one vCPU per
host core) is the fallback and what most runs here use. The verdict is cached per host
kernel release.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

KVM_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class VmSpec:
    vmlinuz: str
    initrd: str
    modules: str                 # host path of the guest kernel's module tree
    python: str                  # the venv interpreter the guest's second stage runs in
    job_dir: str
    shares: list[tuple[str, str]] = field(default_factory=list)   # (tag, host path) rw
    accel: str = "tcg"           # "tcg" | "kvm"
    cpus: int = 2
    memory_mib: int = 6144
    overlay_size: str = "3g"     # the tmpfs that takes every write in the guest


def qemu_argv(spec: VmSpec) -> list[str]:
    if spec.accel == "kvm":
        accel = ["-accel", "kvm", "-cpu", "host"]
    else:
        accel = ["-accel", "tcg,thread=multi", "-cpu", "max"]
    cmdline = " ".join(["console=ttyS0", "quiet", "loglevel=3", "panic=-1",
                        f"tb.python={spec.python}", f"tb.overlay_size={spec.overlay_size}"])
    argv = ["qemu-system-x86_64", *accel, "-smp", str(spec.cpus), "-m", str(spec.memory_mib),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-nic", "none", "-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con",
            "-kernel", spec.vmlinuz, "-initrd", spec.initrd, "-append", cmdline]
    disks = [("hostroot", "/", True), ("modules", spec.modules, True),
             ("job", spec.job_dir, False)] + [(t, p, False) for t, p in spec.shares]
    for i, (tag, path, ro) in enumerate(disks):
        opts = f"local,id=fs{i},path={path},security_model=none"
        if ro:
            opts += ",readonly=on"
        if tag == "hostroot":
            opts += ",multidevs=remap"
        argv += ["-fsdev", opts, "-device", f"virtio-9p-pci,fsdev=fs{i},mount_tag={tag}"]
    return argv


def _verdict_path(cache: Path) -> Path:
    return cache / f"accel-{os.uname().release}.json"


def choose_accel(cache: Path, probe_boot) -> tuple[str, str]:
    """("kvm" | "tcg", why). `probe_boot()` boots a trivial guest with KVM within
    KVM_PROBE_TIMEOUT_S and returns (worked, detail); it runs once per host kernel."""
    forced = os.environ.get("TESTBED_VM_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced, f"TESTBED_VM_ACCEL={forced}"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "no usable /dev/kvm: TCG (software emulation)"
    path = _verdict_path(cache)
    try:
        data = json.loads(path.read_text())
        return data["accel"], data["why"]
    except (OSError, ValueError, KeyError):
        pass
    worked, detail = probe_boot()
    accel, why = ("kvm", "KVM booted a test guest") if worked else \
        ("tcg", f"KVM did not boot a test guest ({detail}): TCG (software emulation)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"accel": accel, "why": why}) + "\n")
    return accel, why


def run_probe(argv: list[str], timeout_s: float = KVM_PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Run a probe guest; (powered off cleanly in time, detail)."""
    try:
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"no power-off within {timeout_s:.0f} s"
    text = (res.stdout + res.stderr).decode(errors="replace")
    if res.returncode != 0:
        return False, text.strip().splitlines()[-1][:200] if text.strip() else \
            f"exit {res.returncode}"
    return True, "ok"
