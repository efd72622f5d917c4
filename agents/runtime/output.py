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
    """The agent's last word: `counters` on stdout (one line) and in `out` if given."""
    write_counters(out, counters)
    print(json.dumps(counters, sort_keys=True, separators=(",", ":")), flush=True)
