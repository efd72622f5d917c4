"""The guest's first stage: a small initramfs that mounts the host's root read-only.

Debian's kernel has virtio, 9p and overlayfs as modules, so the guest cannot
mount anything until they are loaded: this initramfs holds busybox (static),
those modules and a shell `init` that loads them, mounts the host's root
filesystem (9p tag `hostroot`, read-only) under a tmpfs overlay, mounts the
kernel's module tree (tag `modules`) and switches to the second stage
(testbed.vm.guest) in the host's own venv. Nothing here is built by a
compiler: the archive is written in Python (cpio "newc"), so it is rebuilt
from the same inputs byte for byte, and cached by a hash of those inputs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Loaded in this order (each after what modules.dep says it needs).
FIRST_STAGE_MODULES = ("virtio", "virtio_ring", "virtio_pci_legacy_dev",
                       "virtio_pci_modern_dev", "virtio_pci", "netfs", "fscache",
                       "9pnet", "9pnet_virtio", "9p", "overlay")

INIT_SCRIPT = r"""#!/bin/busybox sh
# Stage 1 of the testbed guest (testbed/vm/initramfs.py writes this file).
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /lower /rw /newroot
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
for m in $(cat /modules.list); do insmod /mods/$m.ko || echo "tb-init: insmod $m failed"; done
opt() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
PY=$(opt tb.python)
OVERLAY_SIZE=$(opt tb.overlay_size)
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower \
  || { echo "tb-init: cannot mount the host root (9p)"; poweroff -f; }
mount -t tmpfs -o size=${OVERLAY_SIZE:-50%} tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
  || { echo "tb-init: overlay mount failed"; poweroff -f; }
KVER=$(uname -r)
mkdir -p /newroot/lib/modules/$KVER
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose modules \
  /newroot/lib/modules/$KVER || echo "tb-init: no module tree"
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot "$PY" -m testbed.vm.guest
"""


@dataclass(frozen=True)
class Entry:
    name: str            # path inside the archive, no leading slash
    mode: int            # stat mode including the file type
    data: bytes = b""    # file contents, or the link target for a symlink
    rdev: tuple[int, int] = (0, 0)   # (major, minor) of a device node


def _newc(entry: Entry, ino: int) -> bytes:
    name = entry.name.encode() + b"\0"
    fields = (ino, entry.mode, 0, 0, 1, 0, len(entry.data), 0, 0, *entry.rdev, len(name), 0)
    head = b"070701" + b"".join(f"{v:08x}".encode() for v in fields)
    out = head + name
    out += b"\0" * (-len(out) % 4)
    out += entry.data
    out += b"\0" * (-len(out) % 4)
    return out


def cpio_newc(entries: Iterable[Entry]) -> bytes:
    """A cpio archive in the kernel's initramfs format ("newc"), mtime 0, owner root."""
    buf = io.BytesIO()
    ino = 1
    for entry in entries:
        buf.write(_newc(entry, ino))
        ino += 1
    buf.write(_newc(Entry("TRAILER!!!", 0), 0))
    return buf.getvalue()


def module_order(modules_dep: str, wanted: Iterable[str]) -> list[str]:
    """The module files (paths relative to the module tree) for `wanted`, each after its
    dependencies, from the text of modules.dep."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in modules_dep.splitlines():
        if ":" not in line:
            continue
        path, rest = line.split(":", 1)
        deps[path] = rest.split()
        by_name[Path(path).name.split(".ko")[0].replace("-", "_")] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        # modules.dep lists every dependency, nearest last; load the far ones first
        for dep in reversed(deps.get(path, [])):
            visit(dep)
        order.append(path)

    for name in wanted:
        key = name.replace("-", "_")
        if key not in by_name:
            raise ValueError(f"module {name} is not in this kernel's modules.dep")
        visit(by_name[key])
    return order


def build(busybox: Path, module_tree: Path, modules: Iterable[str] = FIRST_STAGE_MODULES
          ) -> bytes:
    """The gzip-compressed initramfs for the kernel whose module tree is `module_tree`
    (a depmod-ed /lib/modules/VERSION)."""
    files = module_order((module_tree / "modules.dep").read_text(), modules)
    d = stat.S_IFDIR | 0o755
    entries = [Entry("bin", d), Entry("mods", d), Entry("dev", d),
               Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
               Entry("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes()),
               Entry("bin/sh", stat.S_IFLNK | 0o777, b"busybox"),
               Entry("init", stat.S_IFREG | 0o755, INIT_SCRIPT.encode())]
    names = []
    for rel in files:
        name = Path(rel).name.split(".ko")[0]
        names.append(name)
        entries.append(Entry(f"mods/{name}.ko", stat.S_IFREG | 0o644,
                             (module_tree / rel).read_bytes()))
    entries.append(Entry("modules.list", stat.S_IFREG | 0o644, ("\n".join(names) + "\n").encode()))
    return gzip.compress(cpio_newc(entries), compresslevel=6, mtime=0)


def recipe_hash(busybox: Path, module_tree: Path) -> str:
    """What the cached initramfs depends on: the script, the module list, busybox and
    the kernel release."""
    h = hashlib.sha256(INIT_SCRIPT.encode())
    h.update("\n".join(FIRST_STAGE_MODULES).encode())
    h.update(hashlib.sha256(busybox.read_bytes()).digest())
    h.update(module_tree.name.encode())
    return h.hexdigest()[:16]
