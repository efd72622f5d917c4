"""The run directory's file conventions: its format version, atomic private writes, and
a checked JSON read. Written by `testbed.run`, read by `testbed.report`; both import it
from here so that neither needs the other (docs/run-format.md)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

RUN_FORMAT_VERSION = 1


class RunDirError(RuntimeError):
    """Not a run directory, or one written by a newer testbed."""


def utc_stamp(unix_s: float | None = None) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(unix_s))


def write_atomic(path: Path, text: str | Iterable[str], mode: int = 0o600) -> None:
    """Write `path.tmp` with `mode`, flush it to disk, rename it over `path`. `text` is
    the whole text, or its lines one by one (a million flows' rows are never one string).

    Readers (and a textfile collector) never see half a file; a crash leaves
    the old file or none. The `.tmp` name does not end in `.prom`, so
    Prometheus' textfile collector ignores it.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), mode)
            if isinstance(text, str):
                fh.write(text)
            else:
                fh.writelines(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_private(path: Path, text: str | Iterable[str]) -> None:
    """Write a file readable by its owner only, atomically."""
    write_atomic(path, text, 0o600)


def write_json(path: Path, data: object) -> None:
    write_private(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
