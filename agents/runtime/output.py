"""What an agent leaves for the control plane: its ready file and its final counters.

- `mark_ready` creates --ready-file once the agent can take traffic; the
  control plane waits for the file and reads its mtime as the moment. With
  `content`, the file holds one JSON line (the RoCE server names the ports it
  bound), written atomically so a reader never sees half of it.
- `report_counters` prints the final counters as ONE line of JSON on stdout
  and writes them to --out, atomically, when given.

The live counters, while the agent runs, are `agents.runtime.control`'s.
"""

from __future__ import annotations

import json
import os
import sys


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json_atomically(path: str, data: object) -> None:
    """`data` as one JSON line at `path`, atomically (a reader sees all or nothing)."""
    _write_atomically(path, json.dumps(data, sort_keys=True) + "\n")


def mark_ready(path: str | None, content: dict | None = None) -> None:
    """Create (or touch) the ready file `path`; with `content`, it holds that as JSON."""
    if not path:
        return
    if content is not None:
        _write_atomically(path, json.dumps(content, sort_keys=True) + "\n")
        return
    with open(path, "a"):
        pass
    os.utime(path, None)


def write_counters(path: str | None, counters: dict) -> None:
    """An agent's final counters as JSON at `path` (--out), written atomically."""
    if path:
        _write_atomically(path, json.dumps(counters, sort_keys=True, indent=1) + "\n")


def report_counters(counters: dict, out: str | None = None) -> None:
    """The agent's last word: `counters` on stdout (one line) and in `out` if given.

    The line goes out with os.write until all of it is written: a line longer than the
    pipe (a RoCE responder of 127 streams writes ~0.5 MB) blocks until the run reads it,
    and a SIGTERM that came meanwhile made print() drop the rest of the line silently
    (the agent then exited 0 with its JSON cut at a multiple of the pipe's 64 KiB)."""
    write_counters(out, counters)
    line = json.dumps(counters, sort_keys=True, separators=(",", ":")) + "\n"
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # not a file (a test's capture)
        sys.stdout.write(line)
        sys.stdout.flush()
        return
    data = memoryview(line.encode())
    while data:
        data = data[os.write(fd, data):]      # EINTR is retried (PEP 475)
