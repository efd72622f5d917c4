"""What the host asks the guest to do, as data: one JSON file in the job share.

The host writes `job.json` into a directory it shares with the guest (9p tag `job`);
the guest's second stage reads it, runs `argv`, copies the `copy_back` directories'
new or changed entries into their shares, and writes `rc` (the exit code) next to it.
A file `stop` written by the host asks the guest to interrupt the command (SIGINT,
as Ctrl-C would) and finish as usual: the run still writes its directory and it
still comes back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

JOB_FILE = "job.json"
RC_FILE = "rc"
STOP_FILE = "stop"
READY_FILE = "ready"          # written by the guest once the command has started
UP_RC_FILE = "up_rc"          # stay_up: the command's exit code, written before waiting
GUEST_JOB_DIR = "/run/testbed-vm/job"
# Guest exit codes of its own (not the command's)
RC_GUEST_FAILED = 125


@dataclass(frozen=True)
class Share:
    """A host directory the guest mounts read-write at the same path (9p tag `tag`)."""
    tag: str
    path: str


@dataclass(frozen=True)
class Job:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    # Host directories written in the guest's overlay and copied back when the command
    # ends (run directories: SQLite in WAL mode wants a local filesystem, not 9p).
    copy_back: list[Share] = field(default_factory=list)
    # Host directories mounted read-write directly (small files: the calibration).
    rw: list[Share] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)   # modprobe'd before the command
    stay_up: bool = False     # `up --vm`: keep the guest running until `stop` appears
    stop_argv: list[str] = field(default_factory=list)  # run on `stop` when stay_up

    def dump(self, directory: Path) -> Path:
        path = directory / JOB_FILE
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: Path) -> Job:
        data = json.loads((directory / JOB_FILE).read_text())
        data["copy_back"] = [Share(**s) for s in data.get("copy_back", [])]
        data["rw"] = [Share(**s) for s in data.get("rw", [])]
        return cls(**data)
