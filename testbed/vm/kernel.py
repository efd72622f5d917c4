"""The guest's kernel and tools: installed on first use of VM mode, then cached.

VM mode boots Debian's stock kernel (the `linux-image-amd64` package's kernel) with
the host's own root filesystem, so nothing is built but a small initramfs. On first
use this installs qemu (qemu-system-x86), busybox-static (the initramfs's shell) and
kmod (depmod/modprobe in the guest) with apt, downloads the kernel package with
`apt-get download` and unpacks it under the cache directory with `dpkg-deb -x`: the
host's /boot and /lib/modules are not touched. Later uses find everything cached.
`guest.json` in the cache records what was installed, how long it took and how big it
is (`testbed calibrate --vm` and the VM lane print it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from testbed.vm import initramfs

APT_PACKAGES = ("qemu-system-x86", "busybox-static", "kmod")
KERNEL_META_PACKAGE = "linux-image-amd64"
BUSYBOX = Path("/bin/busybox")


class VmSetupError(RuntimeError):
    """VM mode cannot be set up here (the message says what is missing and why)."""


def cache_dir() -> Path:
    return Path(os.environ.get("TESTBED_VM_CACHE", "/var/cache/testbed/vm"))


@dataclass(frozen=True)
class GuestKernel:
    release: str          # e.g. 6.1.0-57-amd64
    package: str          # e.g. linux-image-6.1.0-57-amd64
    version: str          # the package version
    vmlinuz: Path
    modules: Path         # the depmod-ed /lib/modules/RELEASE tree
    initrd: Path

    def to_json(self) -> dict:
        return {k: str(v) for k, v in asdict(self).items()}


def _run(argv: list[str], what: str) -> str:
    res = subprocess.run(argv, capture_output=True, text=True,
                         env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if res.returncode != 0:
        raise VmSetupError(f"{what} failed ({' '.join(argv)}): "
                           f"{(res.stderr or res.stdout).strip()[-800:]}")
    return res.stdout


def missing_packages() -> list[str]:
    return [p for p in APT_PACKAGES
            if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def kernel_package() -> str:
    """The versioned kernel package the meta package points at (apt-cache depends)."""
    override = os.environ.get("TESTBED_VM_KERNEL_PACKAGE")
    if override:
        return override
    out = _run(["apt-cache", "depends", KERNEL_META_PACKAGE], "apt-cache depends")
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split(":", 1)[1].strip()
    raise VmSetupError(f"apt knows no kernel for {KERNEL_META_PACKAGE} (is this Debian/"
                       "Ubuntu with its package lists? try `apt-get update`)")


def _cached() -> GuestKernel | None:
    manifest = cache_dir() / "guest.json"
    try:
        data = json.loads(manifest.read_text())["kernel"]
        kernel = GuestKernel(release=str(data["release"]), package=str(data["package"]),
                             version=str(data["version"]), vmlinuz=Path(data["vmlinuz"]),
                             modules=Path(data["modules"]), initrd=Path(data["initrd"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (kernel.vmlinuz.is_file() and (kernel.modules / "modules.dep").is_file()):
        return None
    return kernel


def _initrd(modules: Path) -> Path:
    """The first stage for this kernel, rebuilt only when its recipe changes."""
    path = cache_dir() / f"initrd-{modules.name}-{initramfs.recipe_hash(BUSYBOX, modules)}.gz"
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(initramfs.build(BUSYBOX, modules))
        os.replace(tmp, path)
    return path


def ensure_guest(say: Callable[[str], None] = print) -> GuestKernel:
    """The cached guest kernel, installing qemu and the kernel package first if needed."""
    if os.geteuid() != 0:
        raise VmSetupError("VM mode needs root (apt on first use, then qemu and 9p shares)")
    record: dict = {}
    missing = missing_packages()
    if missing:
        t0 = time.monotonic()
        say(f"vm: first use: installing {' '.join(missing)} with apt")
        _run(["apt-get", "update", "-qq"], "apt-get update")
        _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
             "apt-get install")
        record["apt"] = {"packages": missing, "seconds": round(time.monotonic() - t0, 1)}
        say(f"vm: installed in {record['apt']['seconds']} s")
    for tool in ("qemu-system-x86_64", "depmod"):
        if shutil.which(tool) is None:
            raise VmSetupError(f"{tool} is not on PATH after installing {APT_PACKAGES}")
    kernel = _cached()
    fresh = kernel is None
    if kernel is None:
        kernel = _fetch_kernel(say, record)
    initrd = _initrd(kernel.modules)
    if fresh or record or initrd != kernel.initrd:
        kernel = replace(kernel, initrd=initrd)
        _write_manifest(kernel, record)
    return kernel


def _fetch_kernel(say: Callable[[str], None], record: dict) -> GuestKernel:
    package = kernel_package()
    t0 = time.monotonic()
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    work = root / "download"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    say(f"vm: first use: downloading {package} (apt-get download) into {root}")
    subprocess.run(["apt-get", "download", package], cwd=work, check=False,
                   capture_output=True)
    debs = sorted(work.glob(f"{package}_*.deb"))
    if not debs:
        _run(["apt-get", "update", "-qq"], "apt-get update")
        res = subprocess.run(["apt-get", "download", package], cwd=work, capture_output=True,
                             text=True)
        debs = sorted(work.glob(f"{package}_*.deb"))
        if not debs:
            raise VmSetupError(f"apt-get download {package} failed: {res.stderr.strip()}")
    deb = debs[-1]
    version = _run(["dpkg-deb", "-f", str(deb), "Version"], "dpkg-deb -f").strip()
    tree = root / package
    shutil.rmtree(tree, ignore_errors=True)
    _run(["dpkg-deb", "-x", str(deb), str(tree)], "dpkg-deb -x")
    vmlinuz = next((tree / "boot").glob("vmlinuz-*"), None)
    if vmlinuz is None:
        raise VmSetupError(f"{deb.name} has no boot/vmlinuz-*")
    release = vmlinuz.name.removeprefix("vmlinuz-")
    _run(["depmod", "-b", str(tree), release], "depmod")
    deb_bytes = deb.stat().st_size
    deb.unlink()
    shutil.rmtree(work, ignore_errors=True)
    record["kernel"] = {"package": package, "version": version,
                        "download_bytes": deb_bytes, "unpacked_bytes": _dir_size(tree),
                        "seconds": round(time.monotonic() - t0, 1)}
    say(f"vm: {package} {version}: {deb_bytes / 1e6:.0f} MB downloaded, "
        f"{record['kernel']['unpacked_bytes'] / 1e6:.0f} MB unpacked, "
        f"{record['kernel']['seconds']} s")
    modules = tree / "lib" / "modules" / release
    return GuestKernel(release, package, version, vmlinuz, modules, _initrd(modules))


def _write_manifest(kernel: GuestKernel, record: dict) -> None:
    path = cache_dir() / "guest.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    setup = {**old.get("setup", {}), **record}
    data = {"kernel": kernel.to_json(), "setup": setup}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def setup_record() -> dict:
    """What the first use installed, how long it took and how big it is (guest.json)."""
    try:
        return json.loads((cache_dir() / "guest.json").read_text()).get("setup", {})
    except (OSError, ValueError):
        return {}
