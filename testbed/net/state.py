"""Where a lab records what it owns, so `down` finds it even after SIGKILL.

The state file is written *before* anything is created and lists every
namespace the lab will make, so a builder killed half-way leaves a record
of all it might have made. Processes are recorded by pid together with the
inode of the namespace they were started in, so a reused pid is never
mistaken for ours.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FORMAT_VERSION = 1


def state_dir() -> Path:
    # One directory per lab. /run is a tmpfs, like /run/netns: both vanish
    # together on reboot.
    return Path(os.environ.get("TESTBED_STATE_DIR", "/run/testbed/labs"))


@dataclass
class ProcessRecord:
    pid: int
    netns: str
    name: str
    start_time: str   # field 22 of /proc/PID/stat: tells a reused pid apart


@dataclass
class LabState:
    lab: str
    netns: list[str]
    status: str                      # "building", "up", "failed", "destroying"
    plan_digest: str
    builder_pid: int
    created_unix: float = field(default_factory=time.time)
    run_dir: str | None = None
    processes: list[ProcessRecord] = field(default_factory=list)
    # One VM's part of a fabric spread over VMs (`up --vms V --vm NAME`): the VM and the
    # nodes built here (None: the whole fabric). Its port programs are unpinned by node,
    # since another part of the same lab may be pinned on this machine.
    vm: str | None = None
    nodes: list[str] | None = None
    format_version: int = STATE_FORMAT_VERSION

    @property
    def directory(self) -> Path:
        return state_dir() / self.lab

    @property
    def path(self) -> Path:
        return self.directory / "state.json"

    def save(self) -> None:
        path = self.path
        state_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)   # atomic: a SIGKILL never leaves half a file

    @property
    def plan_path(self) -> Path:
        return self.directory / "plan.json"

    def remove(self) -> None:
        self.plan_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
        # Control sockets, ready files and event logs of the lab's own agents.
        shutil.rmtree(self.directory / "agents", ignore_errors=True)
        for sock in self.directory.glob("*.sock"):
            sock.unlink(missing_ok=True)
        try:
            self.directory.rmdir()
        except OSError:
            pass   # something else was put there; leave it for a person to see

    @classmethod
    def load(cls, lab: str) -> LabState | None:
        path = state_dir() / lab / "state.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as exc:
            raise RuntimeError(f"{path}: unreadable lab state ({exc}); remove the file and "
                               "run `testbed down --all` to clean up by prefix") from None
        if data.get("format_version", 0) > STATE_FORMAT_VERSION:
            raise RuntimeError(f"{path}: written by a newer testbed (format "
                               f"{data['format_version']}); use that version to tear it down")
        data["processes"] = [ProcessRecord(**p) for p in data.get("processes", [])]
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def list_states() -> list[LabState]:
    out: list[LabState] = []
    directory = state_dir()
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*/state.json")):
        state = LabState.load(path.parent.name)
        if state is not None:
            out.append(state)
    return out


def process_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces or parentheses: split after the last ')'.
    return stat.rsplit(")", 1)[1].split()[19]
