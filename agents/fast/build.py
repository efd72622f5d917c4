"""Build the fast-path extension `agents.fast._fastpath` with clang (`make setup` runs this).

The shared object goes next to its source (agents/fast/_fastpath<EXT_SUFFIX>), with a stamp
file holding a digest of the source it was built from (CRC-32 and length: this module is
imported by every agent that checks the stamp, and hashlib would load OpenSSL, 3.6 MB of
RSS, into each of them): `agents.fast` refuses an
extension whose stamp does not match the source beside it (a stale build would be a
different transport than the code says), and this script rebuilds exactly then.

    python -m agents.fast            # build if missing or stale; prints the path
    python -m agents.fast --force    # rebuild anyway

Needs clang, Python.h (python3-dev) and zlib.h (zlib1g-dev), all from apt.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_fastpath.c"
STAMP = HERE / "_fastpath.stamp"
# -ffp-contract=off: no fused multiply-add, so the pacer's doubles round as Python's do
CFLAGS = ("-O2", "-fPIC", "-shared", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Wno-missing-field-initializers", "-ffp-contract=off", "-fno-strict-aliasing")


class BuildError(RuntimeError):
    """The extension could not be built; the message says what is missing."""


def extension_path() -> Path:
    """Where the built extension lives (importable as agents.fast._fastpath)."""
    return HERE / f"_fastpath{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def source_hash() -> str:
    """The source's digest: CRC-32 and length (a stale build is what it must catch, not an
    adversary)."""
    src = SOURCE.read_bytes()
    return f"crc32:{zlib.crc32(src):08x}:{len(src)}"


def is_current() -> bool:
    """The extension exists and was built from the source beside it."""
    try:
        return extension_path().exists() and STAMP.read_text().strip() == source_hash()
    except OSError:
        return False


def build(force: bool = False) -> Path:
    """Compile the extension unless it is current; returns its path. BuildError on failure."""
    import shutil  # here, not at the top: agents import this module for is_current
    import subprocess
    import sysconfig
    import tempfile

    out = extension_path()
    if not force and is_current():
        return out
    cc = os.environ.get("CC") or shutil.which("clang")
    if cc is None:
        raise BuildError("clang not found: install it (apt-get install clang) or set CC")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise BuildError(f"Python.h not found in {include}: install python3-dev")
    digest = source_hash()
    with tempfile.TemporaryDirectory(prefix="tb-fastpath-") as tmp:
        tmp_out = Path(tmp) / out.name
        argv = [cc, *CFLAGS, f"-I{include}", str(SOURCE), "-o", str(tmp_out), "-lz"]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{' '.join(argv)} failed:\n{proc.stderr.strip()}\n"
                             "(Python.h: python3-dev, zlib.h: zlib1g-dev, from apt)")
        # replace atomically: a running agent keeps the file it mapped
        staged = out.with_suffix(".tmp")
        shutil.copyfile(tmp_out, staged)
        os.replace(staged, out)
    STAMP.write_text(digest + "\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if current")
    args = parser.parse_args()
    try:
        fresh = args.force or not is_current()
        print(f"{'built' if fresh else 'current'}: {build(force=args.force)}")
    except BuildError as e:
        print(f"agents.fast.build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
